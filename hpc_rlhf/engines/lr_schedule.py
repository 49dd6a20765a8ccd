"""Learning-rate schedules as pure functions of the step (no torch state).

``cosine_with_warmup_min_lr`` is the schedule OpenRLHF uses (``cosine_with_min_lr`` in
transformers): linear warmup from 0 to the peak LR, then half a cosine down to
``min_lr_ratio`` x peak at ``num_training_steps``, then flat at the floor.
"""

from __future__ import annotations

import math


def num_warmup_steps(num_training_steps: int, warmup_ratio: float) -> int:
    """Warmup length in optimizer steps: ``ceil(ratio x total)`` (0 when the ratio is 0)."""
    return math.ceil(num_training_steps * warmup_ratio)


def cosine_with_warmup_min_lr(step: int, *, num_training_steps: int, warmup_steps: int,
                              min_lr_ratio: float) -> float:
    """LR multiplier (fraction of the peak LR) before optimizer step ``step`` (0-based).

    - ``step < warmup_steps``: ``step / warmup_steps`` (linear from 0; the first step runs at LR 0 as in
      transformers' ``get_cosine_with_min_lr_schedule_with_warmup``).
    - afterwards: ``min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + cos(pi * progress))`` with
      ``progress = (step - warmup) / (total - warmup)`` clamped to [0, 1].
    """
    if num_training_steps < 1:
        raise ValueError(f"num_training_steps must be >= 1, got {num_training_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must lie in [0, 1], got {min_lr_ratio}")
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, num_training_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_lr_lambda(num_training_steps: int, warmup_ratio: float, min_lr_ratio: float):
    """The multiplier function for ``torch.optim.lr_scheduler.LambdaLR`` (a closure: LambdaLR state_dict
    keeps only last_epoch and base_lrs, so a resumed scheduler rebuilds it from the same arguments)."""
    warmup = num_warmup_steps(num_training_steps, warmup_ratio)

    def lr_lambda(step: int) -> float:
        return cosine_with_warmup_min_lr(step, num_training_steps=num_training_steps, warmup_steps=warmup,
                                         min_lr_ratio=min_lr_ratio)

    return lr_lambda
