"""Micro-batches of token sequences, padded or packed, and the per-sequence reductions over them.

A micro-batch is a list of :class:`TokenSample` (token ids + which tokens are training targets). It is
laid out either

* **padded**: one sample per row, right-padded, 2D attention mask; or
* **packed**: several samples per row (first-fit decreasing into rows of ``max_tokens_per_row``), with
  ``position_ids`` restarting at 0 for every sample and attention isolated between samples:
  a 4D block-diagonal causal mask for eager / SDPA (transformers returns a 4D mask untouched), or, for
  ``flash_attention_2`` / ``_3``, no mask at all: the rows are flattened into one (transformers detects
  packing from ``position_ids`` only for a single row), it reads the sample boundaries from the
  restarting ``position_ids`` and runs flash-attn's varlen kernel (no padding FLOPs).

Both layouts carry ``segment_ids`` (which sample a token belongs to, -1 for padding), next-token
``target_ids`` / ``target_mask`` aligned with the logits, and ``last_pos`` (row, column of each sample's
last token, for reward-model scores). So one set of reductions (``sequence_logprobs``,
``sequence_last_values`` in ``hpc_rlhf.models.forward``) serves both, and packed results equal padded ones
up to float round-off. This module only lays tokens out; the forwards that consume the layout live in
``hpc_rlhf.models.forward``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch


@dataclass(frozen=True)
class TokenSample:
    """One sequence: ``input_ids`` and, per token, whether it is a training target (``loss_mask``)."""

    input_ids: tuple[int, ...]
    loss_mask: tuple[bool, ...]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            raise ValueError(f"input_ids ({len(self.input_ids)}) and loss_mask ({len(self.loss_mask)}) differ in "
                             "length")
        if not self.input_ids:
            raise ValueError("empty TokenSample")

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        """Trained tokens (the first token is never predicted, so it never counts)."""
        return sum(self.loss_mask[1:])


class CollatedBatch(TypedDict):
    """A micro-batch laid out by :func:`collate` (R rows, T columns, S samples)."""

    input_ids: torch.Tensor  # (R, T) long
    position_ids: torch.Tensor  # (R, T) long, restarting at 0 for every sample
    segment_ids: torch.Tensor  # (R, T) long: sample index, -1 on padding
    target_ids: torch.Tensor  # (R, T) long: the next token of the same sample
    target_mask: torch.Tensor  # (R, T) bool: that next token is trained on
    last_pos: torch.Tensor  # (S, 2) long: row and column of each sample's last token
    packed: bool
    num_samples: int


def pack_rows(lengths: Sequence[int], max_tokens_per_row: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, every row holding at most ``max_tokens_per_row``.

    A sample longer than the budget gets a row of its own (the budget is a target, never a truncation).
    Deterministic: ties keep the input order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_tokens_per_row - lengths[i])
    return rows


def collate(samples: Sequence[TokenSample], pad_token_id: int, *, packing: bool = False,
            max_tokens_per_row: int | None = None) -> CollatedBatch:
    """Lay out a micro-batch.

    Returns a :class:`CollatedBatch` (R rows, T columns, S samples): ``input_ids``, ``position_ids``,
    ``segment_ids`` (sample index, -1 on padding), ``target_ids`` (the next token of the same sample),
    ``target_mask`` (that next token is trained on), all (R, T); ``last_pos`` (S, 2); ``packed``;
    ``num_samples``.
    """
    if not samples:
        raise ValueError("cannot collate an empty micro-batch")
    lengths = [len(s) for s in samples]
    if packing:
        budget = max(max_tokens_per_row or max(lengths), max(lengths))
        rows = pack_rows(lengths, budget)
    else:
        rows = [[i] for i in range(len(samples))]
    width = max(sum(lengths[i] for i in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.full(shape, -1, dtype=torch.long)
    target_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    target_mask = torch.zeros(shape, dtype=torch.bool)
    last_pos = torch.zeros(len(samples), 2, dtype=torch.long)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            sample, n = samples[i], lengths[i]
            ids = torch.tensor(sample.input_ids, dtype=torch.long)
            input_ids[r, col:col + n] = ids
            position_ids[r, col:col + n] = torch.arange(n)
            segment_ids[r, col:col + n] = i
            target_ids[r, col:col + n - 1] = ids[1:]
            target_mask[r, col:col + n - 1] = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
            last_pos[i] = torch.tensor([r, col + n - 1])
            col += n
        # Padding positions keep counting so that transformers' packed-sequence detection (used with
        # flash-attn) sees the padding as one more segment, never as part of the last sample.
        if col < width:
            position_ids[r, col:] = torch.arange(width - col)
    return CollatedBatch(input_ids=input_ids, position_ids=position_ids, segment_ids=segment_ids,
                         target_ids=target_ids, target_mask=target_mask, last_pos=last_pos, packed=packing,
                         num_samples=len(samples))


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(R, T) segment ids -> (R, 1, T, T) additive mask: 0 where a query may attend, ``finfo.min`` elsewhere.

    A token attends to earlier-or-equal tokens of its own sample; a padding token (-1) only to itself,
    so no softmax row is empty (no NaN).
    """
    length = segment_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1)
    real = (segment_ids >= 0).unsqueeze(2)
    eye = torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    allowed = (same & causal & real) | eye
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.unsqueeze(1)
