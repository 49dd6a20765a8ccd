"""Turn trajectories into padded tensors and run the experience forwards on them.

Layout of one batch row: ``[pad ... prompt | response ... pad]``: prompts are left-padded to a common
length P and responses right-padded to a common length R, so the response (action) tokens sit at the
same columns ``P .. P+R-1`` in every row and the logits that predict them at ``P-1 .. P+R-2``.

That layout is what moves between ranks and what the losses see. With ``train.packing_samples`` a
micro-batch is packed into one row of real tokens just for the forward (:func:`pack_actions`), and
the per-action outputs are scattered back into the (B, R) layout, so every loss is computed the same
way whether the forward was packed or padded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpc_rlhf.algos import entropy_from_logits
from hpc_rlhf.data.packing import TokenSample, collate, model_inputs
from hpc_rlhf.models.loading import position_ids_from_mask, score_at_last_token, sequence_scores, token_values
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.models.sequence_parallel import (
    gather_from_sp,
    sequence_parallel_attention,
    shard_for_sp,
    sp_token_logits,
    sp_token_values,
)


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
    return policy_logprobs(model, sequences, attention_mask, num_actions, temperature)[0]


def action_values(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int) -> torch.Tensor:
    """Critic value of the state before each response token: (B, P+R) -> (B, R) fp32."""
    return token_values(model, sequences, attention_mask)[:, -num_actions - 1 : -1]


@dataclass
class PackedActions:
    """A micro-batch of padded rows packed into one row of its N real tokens, for one forward.

    ``inputs``: :func:`hpc_rlhf.data.packing.collate` output of one packed row (sample boundaries in
    ``segment_ids``, ``position_ids`` restarting per sample). The K positions whose output belongs to an
    action column are ``positions`` (K,) in that row: the logits there predict ``targets`` (K,), and a
    critic's value there is the value of the state before that action. ``rows`` / ``cols`` (K,) place each
    one back into the (B, R) layout of ``shape``.
    """

    inputs: dict
    positions: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(K,) per-action outputs -> (B, R), zeros elsewhere. Differentiable."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows.to(values.device), self.cols.to(values.device)), values)


def pack_actions(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                 pad_token_id: int = 0) -> PackedActions:
    """(B, P+R) padded rows -> one packed row. Prompt and response tokens of a row are contiguous
    (left-padded prompt, right-padded response), so each sample is its real tokens in order."""
    prompt_cols = sequences.shape[1] - num_actions
    samples, prompt_lens = [], []
    for ids, real in zip(sequences.tolist(), attention_mask.bool().tolist()):
        tokens = [t for t, keep in zip(ids, real) if keep]
        prompt = sum(real[:prompt_cols])
        samples.append(TokenSample(tuple(tokens), (False,) * prompt + (True,) * (len(tokens) - prompt)))
        prompt_lens.append(prompt)
    inputs = collate(samples, pad_token_id, packing=True, max_tokens_per_row=sum(len(s) for s in samples))
    positions = inputs["target_mask"][0].nonzero().squeeze(1)
    rows = inputs["segment_ids"][0, positions]
    # Position t predicts token t+1 of its sample; response token j sits at sample position prompt + j.
    cols = inputs["position_ids"][0, positions] + 1 - torch.tensor(prompt_lens, dtype=torch.long)[rows]
    return PackedActions(inputs, positions, inputs["target_ids"][0, positions], rows, cols,
                         (sequences.shape[0], num_actions))


def _layout_of(model: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.dtype, torch.device]:
    """(inner module, attention implementation, parameter dtype, device) of a model or engine wrapper."""
    module = getattr(model, "module", model)
    param = next(iter(module.parameters()))
    return module, module.config._attn_implementation, param.dtype, param.device


def policy_logprobs(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    num_actions: int, temperature: float = 1.0, *, packed: bool = False,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally the entropy) of the response tokens: (B, P+R) -> two (B, R) fp32.

    ``packed`` runs the forward over one packed row of real tokens (no padding FLOPs; the LM head only
    on action positions) and returns the same values as the padded forward, up to float round-off.
    """
    if not packed:
        logits = action_logits(model, sequences, attention_mask, num_actions)
        logprobs = logprobs_from_logits(logits, sequences[:, -num_actions:], temperature)
        return logprobs, (entropy_from_logits(logits, attention_mask[:, -num_actions:]) if with_entropy else None)
    pack = pack_actions(sequences, attention_mask, num_actions)
    _, attn, dtype, device = _layout_of(model)
    logits = model(**model_inputs(pack.inputs, attn, dtype, device), use_cache=False,
                   logits_to_keep=pack.positions.to(device)).logits  # (1, K, V)
    logprobs = logprobs_from_logits(logits, pack.targets.to(device).unsqueeze(0), temperature)[0]
    entropy = None
    if with_entropy:
        entropy = pack.scatter(entropy_from_logits(logits, torch.ones_like(logprobs).unsqueeze(0))[0])
    return pack.scatter(logprobs), entropy


def critic_values(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                  num_actions: int, *, packed: bool = False) -> torch.Tensor:
    """Value of the state before each response token: (B, P+R) -> (B, R) fp32, padded or packed."""
    if not packed:
        return action_values(model, sequences, attention_mask, num_actions)
    pack = pack_actions(sequences, attention_mask, num_actions)
    module, attn, dtype, device = _layout_of(model)
    base = getattr(module, module.base_model_prefix)
    hidden = base(**model_inputs(pack.inputs, attn, dtype, device), use_cache=False).last_hidden_state
    return pack.scatter(module.score(hidden[0, pack.positions.to(device)]).squeeze(-1).float())


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


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel subgroup (``ds.ring_attn_size``): its ring attention peers."""

    group: Any
    rank: int
    size: int
    head_stride: int = 1


class MicroForward:
    """The forwards of one micro-batch (B, P+R), padded, packed or split along the sequence.

    Use it through :func:`forward_scope`, and call ``backward`` inside the ``with`` block: under
    sequence parallelism, ring attention must also run when checkpointed layers are recomputed.
    """

    def __init__(self, model: torch.nn.Module, rows: dict[str, torch.Tensor], packed: bool,
                 sp: SequenceParallel | None = None, shard: Any = None) -> None:
        self.model, self.packed, self.sp, self.shard = model, packed, sp, shard
        self.sequences, self.attention_mask = rows["sequences"], rows["attention_mask"]
        self.num_actions = rows["action_mask"].shape[1] if "action_mask" in rows else None  # None: RM scoring

    @property
    def loss_scale(self) -> float:
        """Factor for the loss before ``backward``: each sp rank back-propagates only its own chunk and
        ZeRO averages gradients over dp x sp ranks, so scaling by sp turns the sp part into the sum."""
        return float(self.sp.size) if self.sp else 1.0

    def policy_logprobs(self, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) fp32 log-probs of the response tokens, and their entropy when asked."""
        if self.sp is None:
            return policy_logprobs(self.model, self.sequences, self.attention_mask, self.num_actions, temperature,
                                   packed=self.packed, with_entropy=with_entropy)
        logits = sp_token_logits(self.model, self.shard)  # (B, S_local, V), or (1, N_local, V) packed
        logprobs = self._gather(logprobs_from_logits(logits, self.shard.labels, temperature))
        entropy = None
        if with_entropy:
            entropy = self._gather(entropy_from_logits(logits, torch.ones(logits.shape[:2], dtype=torch.bool,
                                                                          device=logits.device)))
        return logprobs, entropy

    def critic_values(self) -> torch.Tensor:
        """(B, R) fp32 value of the state before each response token."""
        if self.sp is None:
            return critic_values(self.model, self.sequences, self.attention_mask, self.num_actions,
                                 packed=self.packed)
        return self._gather(sp_token_values(self.model, self.shard))

    def sequence_scores(self) -> torch.Tensor:
        """(B,) fp32 reward-model score of each row: the ``score`` head at its last real token."""
        if self.sp is None:
            return sequence_scores(self.model, self.sequences, self.attention_mask)
        values = gather_from_sp(sp_token_values(self.model, self.shard), self.shard, self.sp.group)  # (B, T)
        return score_at_last_token(values, self.attention_mask)

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token outputs of this chunk -> (B, R) action columns of the full rows (differentiable)."""
        full = gather_from_sp(local, self.shard, self.sp.group)  # column t: output for token t+1
        return full[:, -self.num_actions - 1 : -1]


@contextlib.contextmanager
def forward_scope(model: torch.nn.Module, rows: dict[str, torch.Tensor], *, packed: bool = False,
                  sp: SequenceParallel | None = None) -> Iterator[MicroForward]:
    """Forwards of one micro-batch; under ``sp`` the model's attention is ring attention in the block.

    Every rank of the sp group calls this with the same ``rows``; each runs the model on its chunk of
    the sequence (packed into one row of real tokens when ``packed``) and gathers the per-token outputs.
    """
    if sp is None:
        yield MicroForward(model, rows, packed)
        return
    shard = shard_for_sp(rows["sequences"], rows["attention_mask"], sp_rank=sp.rank, sp_size=sp.size, pack=packed)
    with sequence_parallel_attention(model, sp.group, shard, head_stride=sp.head_stride):
        yield MicroForward(model, rows, packed, sp, shard)


def take_rows(batch: dict[str, Any], index: Sequence[int]) -> dict[str, Any]:
    """Rows ``index`` (in that order) of every (B, ...) tensor of ``batch``; other entries unchanged."""
    rows = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    picked = torch.tensor(list(index), dtype=torch.long)
    return {k: (v[picked] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v)
            for k, v in batch.items()}


def cat_rows(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`split_rows` for dicts of tensors."""
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
