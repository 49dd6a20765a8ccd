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


def kl_estimate(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    action_mask: torch.Tensor,
    estimator: str = "k3",
    log_ratio_clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, in fp32, 0 on masked positions.

    Args:
        logprobs: (B, T) log-probs of the sampled tokens under the policy.
        ref_logprobs: (B, T) log-probs of the same tokens under the reference.
        action_mask: (B, T) bool.
        estimator: ``k1`` | ``k2`` | ``k3``.
        log_ratio_clamp: clamp ``log_ratio`` to ``[-c, c]`` before the estimator,
            as OpenRLHF does; keeps ``exp`` in k3 finite for a bf16-noisy or
            diverged token (the gradient of a clamped token is 0). None disables.
    Returns:
        (B, T) fp32.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
    mask = as_bool_mask(action_mask)
    # Sanitise inputs first: a -inf logprob on a padded token must not reach exp().
    log_ratio = fill_masked(logprobs.float(), mask) - fill_masked(ref_logprobs.float(), mask)
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(min=-log_ratio_clamp, max=log_ratio_clamp)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.expm1(-log_ratio) + log_ratio
    return fill_masked(kl, mask)
