"""The RL step's data as types: :class:`StepBatch` (the step's rows as tensors) and :class:`TrainShard` (what one
data-parallel replica of a training role receives: its rows plus the numbers that normalise its loss).

Layout of one batch row: ``[pad ... prompt | response ... pad]``: prompts are left-padded to a common
length P and responses right-padded to a common length R, so the response (action) tokens sit at the
same columns ``P .. P+R-1`` in every row and the logits that predict them at ``P-1 .. P+R-2``.

That layout is what moves between ranks and what the losses see. The forwards over it (padded, packed
into one row of real tokens, or split along the sequence) are in ``hpc_rlhf.models.forward`` and
``hpc_rlhf.models.micro_forward``; they return per-action outputs in the same (B, R) layout, so every
loss is computed the same way whichever forward ran.

A batch is built once, from the step's trajectories (:meth:`StepBatch.from_trajectories`); the roles' outputs
(log-probs, values) and the controller's advantages are set on it as fields. Every row shuffle goes through
:meth:`StepBatch.take_rows` / :meth:`StepBatch.split_rows` / :meth:`StepBatch.cat`, which apply to every field
that is set, so the fields stay aligned row for row. Which rows go where is decided in ``row_layout``.

Between ranks a batch travels as a plain dict of tensors (:meth:`StepBatch.to_wire`): the controller channel
(``hpc_rlhf.world.channel``) sends the tensors of dicts as raw collectives and pickles only the rest.

Runs on rank 0 (the batch, the shards) and on each role's ranks (they rebuild their shard from the wire).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from hpc_rlhf.algos import episode_index_from_branches
from hpc_rlhf.algos.moe import not_recorded
from hpc_rlhf.models.vision import VISUAL_FIELDS, pad_visual_field, visual_row_fields
from hpc_rlhf.rollout.base import Trajectory

# Always set: what every forward reads.
_FORWARD_FIELDS = ("sequences", "attention_mask", "action_mask")
# (B, P+R, ...): one entry per token of the row; every other 2-D field is (B, R)
_FULL_ROW_FIELDS = ("sequences", "attention_mask", "routed_experts", "mrope_position_ids")
# (B, N_max, ...) per-row padded to the widest row: padded again when batches of other widths are concatenated
_RAGGED_FIELDS = ("pixel_values", "image_grid_thw")


def episode_index_of(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """(B,) long: episode of each row. An agent episode that branched has several consecutive rows, the first
    with ``branch_index`` 0 (``hpc_rlhf.algos.episodes``); otherwise row ``i`` is episode ``i``."""
    return episode_index_from_branches(torch.tensor([t.branch_index for t in trajectories], dtype=torch.long))


def _routes_in_rows(trajectories: Sequence[Trajectory], max_prompt: int, max_resp: int) -> torch.Tensor | None:
    """The trajectories' recorded routes (P+R, L, k) in the batch layout (B, max_prompt + max_resp, L, k), or None
    when none carries routes; rows and positions without routes are marked not recorded."""
    recorded = [t.routed_experts for t in trajectories if t.routed_experts is not None]
    if not recorded:
        return None
    shape, dtype = recorded[0].shape[1:], recorded[0].dtype
    routes = torch.full((len(trajectories), max_prompt + max_resp, *shape), not_recorded(dtype), dtype=dtype)
    for i, t in enumerate(trajectories):
        if t.routed_experts is not None:
            start = max_prompt - len(t.prompt_ids)
            routes[i, start : start + len(t.routed_experts)] = t.routed_experts
    return routes


def required(value: torch.Tensor | None, name: str) -> torch.Tensor:
    """A step-batch field that must be set where it is read; a missing one is named."""
    if value is None:
        raise ValueError(f"the step batch has no {name}: the role or phase that sets it did not run")
    return value


@dataclass
class StepBatch:
    """The rows of one RL step (B rows, prompts padded to P columns, responses to R), or a part of them.

    ``sequences`` / ``attention_mask`` / ``action_mask`` are always set; the other fields are ``None`` until
    computed (or when a part of the batch leaves them out, see :meth:`select`).
    """

    sequences: torch.Tensor
    """(B, P+R) long: left-padded prompt ids, then right-padded response ids (pad: the tokenizer's)."""
    attention_mask: torch.Tensor
    """(B, P+R) long: 1 on the real tokens of prompt and response."""
    action_mask: torch.Tensor
    """(B, R) bool: the tokens the model generated (trained); agent feedback tokens and padding are False."""
    rollout_logprobs: torch.Tensor | None = None
    """(B, R) fp32: the rollout engine's sampling log-prob of each response token (0 where not generated)."""
    response_length: torch.Tensor | None = None
    """(B,) long: tokens after the prompt (generated and feedback)."""
    rewards: torch.Tensor | None = None
    """(B,) fp32: sequence reward of each row (an episode's rows share it), before normalisation."""
    episode_index: torch.Tensor | None = None
    """(B,) long: episode of each row, ``0 .. E-1``, an episode's rows consecutive (:func:`episode_index_of`)."""
    old_logprobs: torch.Tensor | None = None
    """(B, R) fp32: the actor's log-probs before the update (None when the update is exactly on-policy)."""
    ref_logprobs: torch.Tensor | None = None
    """(B, R) fp32: the reference model's log-probs (with a ``ref`` role)."""
    teacher_logprobs: torch.Tensor | None = None
    """(B, R) fp32: the distillation teacher's log-probs of the sampled tokens (with a ``teacher`` role)."""
    values: torch.Tensor | None = None
    """(B, R) fp32: the critic's value before each response token (with a ``critic`` role)."""
    kl: torch.Tensor | None = None
    """(B, R) fp32: per-token KL estimate old vs reference (with both of them)."""
    advantages: torch.Tensor | None = None
    """(B, R) fp32: advantages (0 off the action mask)."""
    returns: torch.Tensor | None = None
    """(B, R) fp32: value targets."""
    routed_experts: torch.Tensor | None = None
    """(B, P+R, L, k) uint8/int16: the experts the rollout engine routed each token to in each of the L MoE layers
    (when it recorded them, ``hpc_rlhf.models.routing_replay``); padding and unrecorded positions hold the
    not-recorded marker."""
    pixel_values: torch.Tensor | None = None
    """(B, N_max, D) fp32: each row's image patches (its prompt's, ``hpc_rlhf.rollout.visual.PromptVisual``), zero
    padded past the row's own; set when any row has images (vision-language models)."""
    image_grid_thw: torch.Tensor | None = None
    """(B, I_max, 3) long: each row's image patch grids (temporal, height, width); all-zero rows are padding."""
    mrope_position_ids: torch.Tensor | None = None
    """(B, P+R, 3) long: each token's 3-D rotary position (``hpc_rlhf.models.mrope``), 0 on padding."""

    @classmethod
    def from_trajectories(cls, trajectories: Sequence[Trajectory], pad_token_id: int, *,
                          scored: bool = True) -> StepBatch:
        """Trajectories -> padded rows (the layout above), in trajectory order.

        Sets every field up to ``episode_index``; ``rewards`` only when ``scored`` (the reward model's input is
        built before there are rewards).
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
        rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32) if scored else None
        visual = (visual_row_fields([t.visual for t in trajectories], sequences, attention_mask)
                  if any(t.visual is not None for t in trajectories) else {})
        return cls(sequences, attention_mask, action_mask, rollout_logprobs, response_length, rewards,
                   episode_index_of(trajectories), routed_experts=_routes_in_rows(trajectories, max_prompt, max_resp),
                   **visual)

    # ------------------------------------------------------------------ fields
    @property
    def num_rows(self) -> int:
        return self.sequences.shape[0]

    @property
    def scored_rewards(self) -> torch.Tensor:
        """(B,) fp32 ``rewards``, which a batch built from scored trajectories always has."""
        return required(self.rewards, "rewards")

    @property
    def episodes(self) -> torch.Tensor:
        """(B,) long ``episode_index``, which a batch built from trajectories always has."""
        return required(self.episode_index, "episode_index")

    @property
    def student_logprobs(self) -> torch.Tensor:
        """(B, R) fp32: the policy's log-probs of its sampled tokens: the actor's before the update when that
        forward ran, else the rollout engine's (the same weights in synchronous layouts: an exactly on-policy
        step skips the actor forward; in asynchronous ones the policy that sampled)."""
        return self.old_logprobs if self.old_logprobs is not None else required(self.rollout_logprobs,
                                                                                 "rollout_logprobs")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def select(self, *names: str) -> StepBatch:
        """The same rows with only ``names`` (plus the forward fields, always kept) set; the rest ``None``.
        What a role receives: only the columns it reads travel."""
        unknown = set(names) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"StepBatch has no field(s) {sorted(unknown)}")
        keep = set(_FORWARD_FIELDS) | set(VISUAL_FIELDS) | set(names)  # images: every forward needs them
        return StepBatch(**{k: v for k, v in self.tensors().items() if k in keep})

    def forward_inputs(self) -> dict[str, torch.Tensor]:
        """``sequences`` / ``attention_mask`` / ``action_mask`` by name, and ``routed_experts`` and the image fields
        when set: what ``models.micro_forward`` reads."""
        optional = ("routed_experts", *VISUAL_FIELDS)
        names = _FORWARD_FIELDS + tuple(k for k in optional if getattr(self, k) is not None)
        return {k: getattr(self, k) for k in names}

    def to(self, device: torch.device | str) -> StepBatch:
        """Every field on ``device`` (the engine's: rows travel and are cut on the host, forwards run there)."""
        return StepBatch(**{k: v.to(device, non_blocking=True) for k, v in self.tensors().items()})

    # ------------------------------------------------------------------ rows
    def take_rows(self, index: Sequence[int] | torch.Tensor) -> StepBatch:
        """Rows ``index`` (in that order, repeats allowed) of every field."""
        picked = torch.as_tensor(index, dtype=torch.long)
        return StepBatch(**{k: v[picked] for k, v in self.tensors().items()})

    def split_rows(self, num_parts: int) -> list[StepBatch]:
        """``num_parts`` equal, contiguous row shards (inverse: :meth:`cat`)."""
        rows = self.num_rows
        if rows % num_parts:
            raise ValueError(f"cannot split {rows} samples into {num_parts} equal shards")
        size = rows // num_parts
        return [StepBatch(**{k: v[i * size : (i + 1) * size] for k, v in self.tensors().items()})
                for i in range(num_parts)]

    @staticmethod
    def cat(parts: Sequence[StepBatch]) -> StepBatch:
        """The rows of ``parts`` one after the other; every part must have the same fields set."""
        names = list(parts[0].tensors())
        for part in parts[1:]:
            if list(part.tensors()) != names:
                raise ValueError(f"cannot concatenate batches with fields {names} and {list(part.tensors())}")
        return StepBatch(**{k: torch.cat(pad_visual_field([getattr(p, k) for p in parts]) if k in _RAGGED_FIELDS
                                         else [getattr(p, k) for p in parts]) for k in names})

    def trim_padding(self) -> StepBatch:
        """Drop the columns that are padding in every row (for one micro-batch).

        ``sequences`` / ``attention_mask`` (B, P+R) lose all-pad columns on the left of the prompts and on
        the right of the longest response; per-action fields (B, R) keep their first ``r`` columns, the
        longest response of these rows; (B,) fields are unchanged. Outputs are unchanged: dropped columns are
        masked everywhere.
        """
        mask = self.attention_mask
        num_actions = self.action_mask.shape[1]
        prompt_len = mask.shape[1] - num_actions
        used = mask.bool().any(dim=0)
        first = int(used[:prompt_len].float().argmax()) if bool(used[:prompt_len].any()) else prompt_len - 1
        resp = int(used[prompt_len:].nonzero().max()) + 1 if bool(used[prompt_len:].any()) else 1
        out = {}
        for key, value in self.tensors().items():
            if key in _FULL_ROW_FIELDS:
                out[key] = value[:, first : prompt_len + resp]
            elif key in _RAGGED_FIELDS:
                out[key] = value
            elif value.dim() == 2:
                out[key] = value[:, :resp]
            else:
                out[key] = value
        return StepBatch(**out)

    # ------------------------------------------------------------------ between ranks
    def to_wire(self) -> dict[str, torch.Tensor]:
        return self.tensors()

    @classmethod
    def from_wire(cls, wire: dict[str, torch.Tensor]) -> StepBatch:
        return cls(**wire)


@dataclass
class TrainShard:
    """What one data-parallel replica of a training role receives for the step's update.

    ``rows`` holds ``num_minibatches x rows_per_minibatch`` rows: mini-batch ``k`` is rows
    ``[k*m, (k+1)*m)`` (``m = rows_per_minibatch``), and every replica's ``k``-th chunk belongs to the same
    global mini-batch (``row_layout.train_shards``).
    """

    rows: StepBatch
    rows_per_minibatch: int
    """m: this replica's rows of one mini-batch (``train.train_batch_size`` episodes over all replicas)."""
    num_tokens: list[int]
    """Per mini-batch: action tokens over ALL replicas; with ``num_seqs`` it normalises the loss exactly
    however the rows are split (``hpc_rlhf.algos.aggregate_loss``)."""
    num_seqs: list[int]
    """Per mini-batch: rows with at least one action token, over all replicas."""
    kl_coef: float = 0.0
    """The KL-loss coefficient of this step (the actor with ``algo.kl.use_loss``; 0 otherwise)."""

    @property
    def num_minibatches(self) -> int:
        return self.rows.num_rows // self.rows_per_minibatch

    def minibatch(self, k: int) -> slice:
        """Rows of mini-batch ``k``."""
        return slice(k * self.rows_per_minibatch, (k + 1) * self.rows_per_minibatch)

    def split(self, num_parts: int) -> list[TrainShard]:
        """The rows in ``num_parts`` equal contiguous shards, each with the same (global) counts."""
        return [replace(self, rows=part) for part in self.rows.split_rows(num_parts)]

    def to_wire(self) -> dict[str, Any]:
        return {"rows": self.rows.to_wire(), "rows_per_minibatch": self.rows_per_minibatch,
                "num_tokens": self.num_tokens, "num_seqs": self.num_seqs, "kl_coef": self.kl_coef}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> TrainShard:
        return cls(**{**wire, "rows": StepBatch.from_wire(wire["rows"])})
