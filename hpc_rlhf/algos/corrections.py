"""Rollout/trainer mismatch corrections (importance weights from engine logprobs).

The inference engine (vLLM) samples with kernels and precision that differ from
the trainer's forward pass, so the tokens come from ``pi_rollout`` while the PPO
ratio uses ``old_logprobs`` recomputed by the trainer (``pi_old``). The token
weight ``w_t = exp(old_logprobs - rollout_logprobs)`` corrects for that (Yao et
al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training", https://fengyao.notion.site/off-policy-rl). Multiply it into the
per-token policy loss (``policy_loss(..., importance_weights=w)``).

Modes, with band ``[low, high]`` (inclusive):

* ``tis``: truncated IS, ``w_t = clamp(w_t, low, high)``.
* ``icepop``: ``w_t`` kept inside the band, 0 outside (masks the token; Ling
  Team 2025, "Every Step Evolves: Scaling RL for Trillion-Scale Thinking Model",
  arXiv:2510.18855).
* ``seq_mask_tis``: the sequence weight is the geometric mean
  ``exp(mean_t log w_t)`` of the *unclamped* token weights; a row whose sequence weight is
  outside the band gets weight 0 on every token, other rows keep their raw token weights
  (as OpenRLHF's ``seq-mask-tis``).

Weights are detached and 0 on masked positions.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.masking import as_bool_mask, fill_masked, masked_mean

CORRECTION_MODES = ("tis", "icepop", "seq_mask_tis")

# exp(20) ~ 5e8: far outside any sensible band, yet finite, so a corrupted
# logprob yields a masked/truncated weight rather than inf * 0 = nan.
_MAX_ABS_LOG_WEIGHT = 20.0


def rollout_importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    mode: str = "tis",
    low: float = 0.5,
    high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights correcting for sampling with the rollout engine.

    Args:
        old_logprobs: (B, T) trainer log-probs of the sampled tokens (before the update).
        rollout_logprobs: (B, T) log-probs the engine reported when sampling.
        action_mask: (B, T) bool.
        mode: ``tis`` | ``icepop`` | ``seq_mask_tis``.
        low, high: weight band (OpenRLHF's defaults).
    Returns:
        ``(weights (B, T) fp32 detached, stats)`` with stats ``masked_fraction``
        (action tokens whose weight was zeroed by the band), ``truncated_fraction``
        (tis: tokens clamped), ``rollout_kl_k1`` (masked mean of ``rollout_logprobs - old_logprobs``:
        OpenRLHF's ``vllm_kl``) and ``rollout_kl_k3``, two estimates of KL(pi_rollout || pi_old).
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(
            f"unknown rollout correction mode {mode!r}; choose one of {CORRECTION_MODES}"
        )
    if not low <= high:
        raise ValueError(f"rollout correction band needs low <= high, got [{low}, {high}]")
    mask = as_bool_mask(action_mask)
    with torch.no_grad():
        raw_log_weight = fill_masked(old_logprobs.detach().float(), mask) - fill_masked(
            rollout_logprobs.detach().float(), mask
        )
        log_weight = raw_log_weight.clamp(-_MAX_ABS_LOG_WEIGHT, _MAX_ABS_LOG_WEIGHT)
        raw = torch.exp(log_weight)
        in_band = (raw >= low) & (raw <= high)
        zeroed = torch.zeros_like(mask)
        truncated = torch.zeros_like(mask)
        if mode == "tis":
            weights = raw.clamp(low, high)
            truncated = ~in_band
        elif mode == "icepop":
            weights = torch.where(in_band, raw, 0.0)
            zeroed = ~in_band
        else:
            # The gate reads the unclamped mean: a row with one token at log-weight -30 among 30
            # must be judged by e^-1, not by the e^(-20/30) its clamped weight would give.
            seq_weight = torch.exp(masked_mean(raw_log_weight, mask, dim=1))
            seq_in_band = ((seq_weight >= low) & (seq_weight <= high)).unsqueeze(1)
            weights = torch.where(seq_in_band, raw, 0.0)
            zeroed = ~seq_in_band.expand_as(mask)
        weights = fill_masked(weights, mask)
        stats = {
            "masked_fraction": masked_mean(zeroed.float(), mask),
            "truncated_fraction": masked_mean(truncated.float(), mask),
            **_mismatch_kl(raw_log_weight, mask),
        }
    return weights, stats


def rollout_mismatch_kl(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, action_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine that sampled is from the trainer's policy: two estimates of KL(pi_rollout || pi_old).

    Args:
        old_logprobs: (B, T) trainer log-probs of the sampled tokens (before the update).
        rollout_logprobs: (B, T) log-probs the engine reported when sampling.
        action_mask: (B, T) bool.
    Returns:
        ``rollout_kl_k1`` (masked mean of ``rollout_logprobs - old_logprobs``, OpenRLHF's ``vllm_kl``) and
        ``rollout_kl_k3`` (masked mean of ``r - 1 - log r`` with ``r = pi_old / pi_rollout``; >= 0 per token).
        Both are ~0 when the engine samples with the trainer's weights in the trainer's precision: the check that
        a weight sync arrived whole.
    """
    mask = as_bool_mask(action_mask)
    with torch.no_grad():
        log_ratio = fill_masked(old_logprobs.detach().float(), mask) - fill_masked(
            rollout_logprobs.detach().float(), mask
        )
        return _mismatch_kl(log_ratio, mask)


def _mismatch_kl(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    # Tokens come from pi_rollout, so with ratio pi_old / pi_rollout both estimate KL(pi_rollout || pi_old).
    clamped = log_ratio.clamp(-_MAX_ABS_LOG_WEIGHT, _MAX_ABS_LOG_WEIGHT)
    return {
        "rollout_kl_k1": masked_mean(-log_ratio, mask),
        "rollout_kl_k3": masked_mean(torch.expm1(clamped) - clamped, mask),
    }
