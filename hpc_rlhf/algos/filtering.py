"""DAPO sample shaping: dynamic sampling filter and soft overlong punishment.

Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale" (arXiv:2503.14476), sections 3.2 (dynamic sampling) and 3.4 (overlong
reward shaping).
"""

from __future__ import annotations

import torch


def dynamic_filter_mask(
    scores: torch.Tensor,
    n_samples_per_prompt: int,
    low: float = 0.0,
    high: float = 1.0,
) -> torch.Tensor:
    """Keep a prompt group iff ``low < mean(score of its samples) < high``.

    A group whose samples all score the same (all solved or all failed) has zero
    group-relative advantage and only dilutes the batch; DAPO drops it and
    samples more prompts. The bounds are strict, so with 0/1 accuracy scores and
    the default band both all-0 and all-1 groups are dropped.

    Args:
        scores: (B,) per-sample scores, rows of one prompt consecutive.
        n_samples_per_prompt: group size n; B must be a multiple of n.
        low, high: open band on the group mean.
    Returns:
        (B,) bool keep mask, constant within each group.
    """
    if scores.dim() != 1 or n_samples_per_prompt < 1 or scores.shape[0] % n_samples_per_prompt:
        raise ValueError(
            f"scores must be (B,) with B a multiple of n_samples_per_prompt="
            f"{n_samples_per_prompt}, got {tuple(scores.shape)}"
        )
    group_mean = scores.float().view(-1, n_samples_per_prompt).mean(dim=1)
    keep_group = (group_mean > low) & (group_mean < high)
    return keep_group.repeat_interleave(n_samples_per_prompt)


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO soft overlong punishment, to be added to the task reward.

    With ``L_max = max_length`` and ``L_cache = buffer_length``::

        0                                       if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache       if L_max - L_cache < L <= L_max
        -1                                      if L > L_max

    all multiplied by ``penalty_factor``: the penalty ramps linearly from 0 to
    ``-penalty_factor`` over the last ``buffer_length`` tokens.

    Args:
        response_lengths: (B,) generated token counts.
        max_length: L_max.
        buffer_length: L_cache, 0 < L_cache <= L_max.
        penalty_factor: scale of the penalty (>= 0).
    Returns:
        (B,) fp32 penalties (<= 0).
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong buffer_length must be in (0, max_length={max_length}], got {buffer_length}"
        )
    lengths = response_lengths.float()
    expected_length = max_length - buffer_length
    ramp = (expected_length - lengths) / buffer_length
    penalty = torch.where(lengths > max_length, -1.0, ramp.clamp(max=0.0))
    return penalty * penalty_factor
