"""Per-token loss -> scalar micro-batch loss, exact under micro-batching and data parallelism.

The contract
------------
A training step sees one global batch, split over ``dp_size`` data-parallel
ranks and, on each rank, over several micro-batches (gradient accumulation).
The trainer

1. counts the global normaliser of each mini-batch once, before the first
   micro-batch, over the rows of every dp shard (``count_tokens_and_seqs``; the RL
   controller does it on the whole batch before sharding it:
   ``hpc_rlhf.trainers.rl.row_layout.minibatch_counts``);
2. for every micro-batch, calls ``aggregate_loss(..., global_num_tokens or
   global_num_seqs, dp_size)`` and back-propagates the result *unscaled*;
3. lets the engine average gradients over the dp ranks (DeepSpeed's all-reduce).

Each micro-batch loss is ``sum(unit losses of this micro-batch) * dp_size / global_count``.
Summing over micro-batches then averaging over ranks gives
``(1/dp) * sum_ranks sum_micro sum(...) * dp / global_count = sum(all units) / global_count``:
the full-batch mean, exactly, whatever the sharding or the padding. Hence:

* Do not let the engine divide by the number of accumulation steps again
  (DeepSpeed does by default: call ``backward(loss, scale_wrt_gas=False)`` or
  multiply the loss by ``gradient_accumulation_steps`` first).
* Padding rows (no action token) count for nothing: they add 0 to the sum and
  are not counted by ``count_tokens_and_seqs``.
* The logged value of one micro-batch loss is a *share* of the step loss; sum
  over micro-batches and average over ranks to log the step loss.

Modes (the "unit" being averaged):

* ``token_mean``: every action token weighs the same (DAPO token-level loss).
  Normaliser: global number of action tokens.
* ``seq_mean_token_mean``: mean over tokens inside a row, then mean over rows
  (GRPO / GSPO). Normaliser: global number of rows with an action token.
* ``seq_mean_token_sum``: sum over tokens inside a row, mean over rows.
  Normaliser: global number of rows with an action token.
* ``seq_mean_token_sum_norm``: sum over all tokens / (num rows * ``max_tokens``),
  a constant length normaliser (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783).
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.masking import as_bool_mask, fill_masked, masked_count, masked_sum

AGGREGATION_MODES = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


def count_tokens_and_seqs(action_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local normaliser counts for one shard: ``(num_action_tokens, num_seqs_with_actions)``.

    Args:
        action_mask: (B, T) bool.
    Returns:
        Two int64 scalar tensors; sum them over the dp group (and over the rank's
        micro-batches) to get ``global_num_tokens`` / ``global_num_seqs``.
    """
    mask = as_bool_mask(action_mask)
    return mask.sum(), mask.any(dim=1).sum()


def aggregate_loss(
    per_token_loss: torch.Tensor,
    action_mask: torch.Tensor,
    mode: str = "token_mean",
    *,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss of one micro-batch to the scalar to back-propagate.

    ``loss = sum over units of this micro-batch * dp_size / global_count`` (see the
    module docstring for why this is exact under micro-batching and dp averaging).

    Args:
        per_token_loss: (B, T); masked positions are ignored even if NaN/inf.
        action_mask: (B, T) bool.
        mode: one of ``AGGREGATION_MODES``.
        global_num_tokens: action tokens in the whole step batch (all ranks, all
            micro-batches); needed by ``token_mean``.
        global_num_seqs: rows with at least one action token in the whole step
            batch; needed by the ``seq_mean_*`` modes.
        dp_size: number of data-parallel ranks whose gradients the engine averages.
        max_tokens: constant length normaliser for ``seq_mean_token_sum_norm``
            (e.g. the generation max length); required for that mode.
    Without a global count the local count is used: exact only for a single
    micro-batch on a single rank, so ``dp_size > 1`` then raises.
    Returns:
        0-dim tensor in the dtype of ``per_token_loss`` (fp32 if lower precision).
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}"
        )
    mask = as_bool_mask(action_mask)
    loss = fill_masked(per_token_loss.float(), mask)

    if mode == "token_mean":
        units = loss.sum()
        global_count = global_num_tokens
        local_count = masked_count(mask)
    else:
        local_count = mask.any(dim=1).sum()
        global_count = global_num_seqs
        if mode == "seq_mean_token_mean":
            tokens_per_seq = masked_count(mask, dim=1).clamp(min=1).to(loss.dtype)
            units = (masked_sum(loss, mask, dim=1) / tokens_per_seq).sum()
        elif mode == "seq_mean_token_sum":
            units = loss.sum()
        else:
            if max_tokens is None:
                raise ValueError("aggregation 'seq_mean_token_sum_norm' needs max_tokens")
            units = loss.sum() / max_tokens

    if global_count is None:
        if dp_size != 1:
            raise ValueError(
                f"aggregate_loss mode {mode!r} with dp_size={dp_size} needs the global count "
                "(global_num_tokens / global_num_seqs) summed over the dp group"
            )
        global_count = local_count
    global_count = torch.as_tensor(global_count, dtype=loss.dtype, device=loss.device)
    # An all-padding step batch has count 0 and units 0: return 0, not nan.
    return units * dp_size / global_count.clamp(min=1)


def token_share(local_count: int | float | torch.Tensor, global_count: int | float | torch.Tensor,
                dp_size: int = 1) -> torch.Tensor:
    """Weight of a per-micro-batch *mean* (e.g. the MoE load-balancing loss) in the step loss: 0-dim fp32.

    ``local_count * dp_size / global_count``: the micro-batch's tokens over the mini-batch's (all ranks).
    Summed over micro-batches and averaged over ranks, ``share * mean`` gives the token-weighted mean of the
    micro-batch means, the same contract as :func:`aggregate_loss`; 0 for an all-padding mini-batch.
    """
    global_count = torch.as_tensor(global_count, dtype=torch.float32)
    return torch.as_tensor(local_count, dtype=torch.float32) * dp_size / global_count.clamp(min=1)
