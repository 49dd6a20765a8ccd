"""The RL step batch as tensors: trajectories -> padded rows, and the row shuffles the controller does.

Layout of one batch row: ``[pad ... prompt | response ... pad]``: prompts are left-padded to a common
length P and responses right-padded to a common length R, so the response (action) tokens sit at the
same columns ``P .. P+R-1`` in every row and the logits that predict them at ``P-1 .. P+R-2``.

That layout is what moves between ranks and what the losses see. The forwards over it (padded, packed
into one row of real tokens, or split along the sequence) are in ``hpc_rlhf.models.forward`` and
``hpc_rlhf.models.micro_forward``; they return per-action outputs in the same (B, R) layout, so every
loss is computed the same way whichever forward ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


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

def take_rows(batch: dict[str, Any], index: Sequence[int]) -> dict[str, Any]:
    """Rows ``index`` (in that order) of every (B, ...) tensor of ``batch``; other entries unchanged."""
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    picked = torch.tensor(list(index), dtype=torch.long)
    return {k: (v[picked] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v)
            for k, v in batch.items()}


def cat_rows(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_rows` for dicts of tensors."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
