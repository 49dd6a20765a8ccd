"""Per-token KL estimators between the policy and the reference policy.

Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html).
Tokens are sampled from the policy, ``log_ratio = logprobs - ref_logprobs``:

* ``k1 = log_ratio``                          unbiased, high variance, can be negative.
* ``k2 = log_ratio**2 / 2``                   biased, low variance, >= 0.
* ``k3 = exp(-log_ratio) - 1 + log_ratio``    unbiased, low variance, >= 0
  (verl's ``low_var_kl``).

Used either as a per-token penalty folded into the reward
(:func:`hpc_rlhf.algos.advantages.token_level_rewards`) or as a loss term
aggregated with :func:`hpc_rlhf.algos.aggregation.aggregate_loss`. As a loss,
note that the gradient of k1 is the constant 1 per token (it only lowers
``logprobs``); k2 and k3 pull ``logprobs`` toward ``ref_logprobs`` from both sides.
"""

from __future__ import annotations

import torch

from hpc_rlhf.algos.masking import as_bool_mask, fill_masked

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp(80) is finite in fp32 (overflow is above ~88.7).
_MAX_SAFE_LOG_RATIO = 80.0


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: str = "k3",
    value_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, in fp32, 0 on masked positions.

    The *estimate* is clamped to ``[-value_clamp, value_clamp]``, as OpenRLHF's
    ``compute_approx_kl`` does: one diverged token adds at most ``value_clamp`` to the
    penalty, and a clamped token gets zero gradient. (Clamping the log-ratio instead would
    let k3 reach ``exp(c) - 1 - c``, e.g. 22015 for c = 10.)

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprobs: (B, T) log-probs of the same tokens under the reference.
        action_mask: (B, T) bool.
        estimator: ``k1`` | ``k2`` | ``k3``.
        value_clamp: bound c on the estimate's absolute value; None disables (then k3 can
            overflow to inf for a log-ratio below about -88).
    Returns:
        (B, T) fp32.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
    mask = as_bool_mask(action_mask)
    # Sanitise inputs first: a -inf logprob on a padded token must not reach exp().
    log_ratio = fill_masked(logprobs.float(), mask) - fill_masked(ref_logprobs.float(), mask)
    if value_clamp is not None:
        # Every estimator is monotone in |log_ratio| on each side of 0 and already >= c at
        # |log_ratio| = c + 1, so this pre-clamp leaves the clamped value unchanged; it only keeps
        # exp() finite, so the zero gradient of a clamped token is 0 rather than 0 * inf = nan.
        bound = min(value_clamp + 1.0, _MAX_SAFE_LOG_RATIO)
        log_ratio = log_ratio.clamp(min=-bound, max=bound)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    if value_clamp is not None:
        kl = kl.clamp(min=-value_clamp, max=value_clamp)
    return fill_masked(kl, mask)
