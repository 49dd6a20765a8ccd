"""Stateful scalars of the RL loop: KL coefficient controllers and a running reward normaliser.

Each keeps its state in plain Python floats and exposes ``state_dict`` /
``load_state_dict`` so a resumed run continues with the same coefficient and
statistics (the dicts are JSON-serialisable).
"""

from __future__ import annotations

import math

import torch


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op kept for interface parity."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, section 2.2).

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n_steps / horizon)``.
    The coefficient grows when the policy drifts past ``target`` nats and shrinks
    below it; ``horizon`` (in samples) sets how fast.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}"
            )
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update from the observed mean KL over ``n_steps`` new samples; returns the new beta."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


class RunningRewardNormalizer:
    """Running mean / std of rewards, merged batch by batch.

    Uses the parallel form of Welford's algorithm (Chan, Golub & LeVeque 1979),
    so updating with a batch equals updating element by element, in float64.
    ``normalize`` returns ``(r - mean) / (std + eps)`` (or ``r / (std + eps)``
    with ``center=False``), optionally clipped to ``[-clip, clip]``.
    """

    def __init__(self, eps: float = 1e-8, clip: float | None = None, center: bool = True):
        self.eps = eps
        self.clip = clip
        self.center = center
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        """Population variance of everything seen (0 before two samples)."""
        return self.m2 / self.count if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, rewards: torch.Tensor) -> None:
        """Fold a batch of rewards (any shape, finite values) into the statistics."""
        batch = rewards.detach().reshape(-1).to(torch.float64)
        batch_count = batch.numel()
        if batch_count == 0:
            return
        batch_mean = batch.mean().item()
        batch_m2 = ((batch - batch_mean) ** 2).sum().item()
        total = self.count + batch_count
        delta = batch_mean - self.mean
        self.mean += delta * batch_count / total
        self.m2 += batch_m2 + delta * delta * self.count * batch_count / total
        self.count = total

    def normalize(self, rewards: torch.Tensor) -> torch.Tensor:
        """(any shape) -> same shape and dtype, normalised with the current statistics."""
        out = rewards.to(torch.float64)
        if self.center:
            out = out - self.mean
        # One sample has no spread: leave the scale alone rather than divide by eps.
        scale = self.std if self.count > 1 else 1.0
        out = out / (scale + self.eps)
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out.to(rewards.dtype)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self.m2 = float(state["m2"])
