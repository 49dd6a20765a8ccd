"""Turn trajectories into padded tensors and run the experience forwards on them.

Layout of one batch row: ``[pad ... prompt | response ... pad]``: prompts are left-padded to a common
length P and responses right-padded to a common length R, so the response (action) tokens sit at the
same columns ``P .. P+R-1`` in every row and the logits that predict them at ``P-1 .. P+R-2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpc_rlhf.models.loading import position_ids_from_mask, token_values
from hpc_rlhf.models.logprobs import logprobs_from_logits


def pack_trajectories(trajectories: Sequence[Any], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Trajectories -> padded tensors.

    Returns a dict with ``sequences`` (B, P+R) long, ``attention_mask`` (B, P+R) long,
    ``action_mask`` (B, R) bool (generated tokens only; feedback tokens of agents are 0),
    ``rollout_logprobs`` (B, R) fp32 and ``response_length`` (B,) long (tokens after the prompt).
    """
    num = len(trajectories)
    max_prompt = max(len(t.prompt_ids) for t in trajectories)
    max_resp = max(1, max(len(t.response_ids) for t in trajectories))
    sequences = torch.full((num, max_prompt + max_resp), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    action_mask = torch.zeros(num, max_resp, dtype=torch.bool)
    rollout_logprobs = torch.zeros(num, max_resp, dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        sequences[i, max_prompt - p : max_prompt] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attention_mask[i, max_prompt - p : max_prompt] = 1
        if r:
            sequences[i, max_prompt : max_prompt + r] = torch.tensor(t.response_ids, dtype=torch.long)
            attention_mask[i, max_prompt : max_prompt + r] = 1
            action_mask[i, :r] = torch.tensor(t.action_mask, dtype=torch.bool)
            rollout_logprobs[i, :r] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
    response_length = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long)
    return {"sequences": sequences, "attention_mask": attention_mask, "action_mask": action_mask,
            "rollout_logprobs": rollout_logprobs, "response_length": response_length}


def action_logits(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int) -> torch.Tensor:
    """Logits predicting the last ``num_actions`` tokens: (B, P+R) -> (B, R, V).

    ``logits_to_keep`` skips the LM head on prompt positions (a large saving with 150k vocabularies).
    """
    out = model(input_ids=sequences, attention_mask=attention_mask,
                position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                logits_to_keep=num_actions + 1)
    return out.logits[:, -num_actions - 1 : -1]


def trim_padding(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row of a micro-batch.

    ``sequences`` / ``attention_mask`` (B, P+R) lose all-pad columns on the left of the prompts and on
    the right of the longest response; per-action tensors (B, R) keep their first ``r`` columns, the
    longest response of these rows. Outputs are unchanged: dropped columns are masked everywhere.
    """
    mask = rows["attention_mask"]
    num_actions = rows["action_mask"].shape[1]
    prompt_len = mask.shape[1] - num_actions
    used = mask.bool().any(dim=0)
    first = int(used[:prompt_len].float().argmax()) if bool(used[:prompt_len].any()) else prompt_len - 1
    resp = int(used[prompt_len:].nonzero().max()) + 1 if bool(used[prompt_len:].any()) else 1
    out = {}
    for key, value in rows.items():
        if key in ("sequences", "attention_mask"):
            out[key] = value[:, first : prompt_len + resp]
        elif isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape[1] == num_actions:
            out[key] = value[:, :resp]
        else:
            out[key] = value
    return out


def action_logprobs(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    num_actions: int, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of the response tokens under ``model``: (B, P+R) -> (B, R) fp32.

    ``temperature`` matches the sampling temperature so the trainer's and the engine's logprobs
    describe the same distribution.
    """
    logits = action_logits(model, sequences, attention_mask, num_actions)
    return logprobs_from_logits(logits, sequences[:, -num_actions:], temperature)


def action_values(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int) -> torch.Tensor:
    """Critic value of the state before each response token: (B, P+R) -> (B, R) fp32."""
    return token_values(model, sequences, attention_mask)[:, -num_actions - 1 : -1]


def split_rows(batch: dict[str, Any], num_parts: int) -> list[dict[str, Any]]:
    """Split every (B, ...) tensor of ``batch`` into ``num_parts`` equal row shards.

    Non-tensor entries (scalars, config) are copied into every shard.
    """
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    if rows % num_parts:
        raise ValueError(f"cannot split {rows} samples into {num_parts} equal shards")
    size = rows // num_parts
    return [{k: (v[i * size : (i + 1) * size] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows
                 else v) for k, v in batch.items()} for i in range(num_parts)]


def cat_rows(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_rows` for dicts of tensors."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
