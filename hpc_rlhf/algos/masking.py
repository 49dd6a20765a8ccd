"""Masked reductions shared by the algos modules.

Every helper selects with ``torch.where`` instead of multiplying by the mask:
``nan * 0`` is ``nan``, so a multiplied mask lets NaN/inf in padded positions
leak into sums and gradients. ``where`` also routes a zero gradient to the
unselected branch, so masked inputs get exactly zero gradient.

Masks are boolean (or 0/1) tensors broadcastable to the value tensor.
"""

from __future__ import annotations

import torch


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a bool tensor (accepts bool, int or 0/1 float masks)."""
    return mask if mask.dtype == torch.bool else mask != 0


def fill_masked(values: torch.Tensor, mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``values`` where ``mask`` is true, ``fill`` elsewhere (same shape as ``values``).

    Use this on *inputs* before any nonlinear op: the backward of ``where`` gives
    masked positions a zero gradient, and the op then never sees a NaN/inf there,
    so ``0 * nan`` cannot appear in the chain rule either.
    """
    return torch.where(as_bool_mask(mask), values, torch.full_like(values, fill))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over positions where ``mask`` is true (along ``dim`` or all)."""
    filled = fill_masked(values, mask)
    return filled.sum() if dim is None else filled.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of true positions of ``mask`` (along ``dim`` or all), as int64."""
    mask = as_bool_mask(mask)
    return mask.sum() if dim is None else mask.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over true positions; 0 where there are none (instead of nan)."""
    mask = torch.broadcast_to(as_bool_mask(mask), values.shape)
    count = masked_count(mask, dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Biased (population) variance over all true positions, scalar."""
    mean = masked_mean(values, mask)
    return masked_mean((fill_masked(values, mask) - mean) ** 2, mask)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, shift_mean: bool = True
) -> torch.Tensor:
    """Normalise ``values`` to zero mean, unit variance over all true positions.

    Statistics are global over the whole tensor (the batch), as in PPO
    implementations (OpenRLHF ``masked_normalize``). Masked positions come out 0.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    centred = fill_masked(values, mask) - mean if shift_mean else fill_masked(values, mask)
    return fill_masked(centred * torch.rsqrt(var + eps), mask)
