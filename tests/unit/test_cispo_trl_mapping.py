"""docs/migrating.md's mapping of TRL's CISPO (``loss_type="cispo"``, ``epsilon_high``) reproduces TRL's loss:
``algo.eps_clip_high = epsilon_high - 1`` and ``algo.eps_clip_low = 1`` (no lower bound)."""

from __future__ import annotations

import torch

from hpc_rlhf.algos.losses import policy_loss


def trl_cispo_per_token(logprobs, old_logprobs, advantages, epsilon_high):
    """TRL GRPOTrainer's CISPO term (``_compute_loss``, token-level importance sampling): the ratio capped from
    above at ``epsilon_high`` itself, detached, times the advantage and the log-prob; no lower cap."""
    ratio = torch.exp(logprobs - old_logprobs)
    weight = torch.clamp(ratio, max=epsilon_high).detach()
    return -weight * advantages * logprobs


def _tensors():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=gen) * 3
    # ratios from e^-2.5 (far below 0.8) to e^2.5 (above the cap 5)
    shift = torch.linspace(-2.5, 2.5, 18).view(3, 6)
    advantages = torch.randn(3, 6, generator=gen)
    return old, shift, advantages


def test_the_documented_mapping_gives_trls_loss_and_gradient_on_the_same_tensors():
    old, shift, advantages = _tensors()
    mask = torch.ones(3, 6, dtype=torch.bool)
    epsilon_high = 5.0  # TRL's recommended CISPO value
    ours_lp = (old + shift).requires_grad_(True)
    trl_lp = (old + shift).requires_grad_(True)
    ours, _ = policy_loss(ours_lp, old, advantages, mask, loss_type="cispo",
                          clip_eps_low=1.0, clip_eps_high=epsilon_high - 1)
    theirs = trl_cispo_per_token(trl_lp, old, advantages, epsilon_high)
    torch.testing.assert_close(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    torch.testing.assert_close(ours_lp.grad, trl_lp.grad)


def test_the_old_mapping_with_the_default_lower_bound_is_another_loss():
    old, shift, advantages = _tensors()
    mask = torch.ones(3, 6, dtype=torch.bool)
    ours, _ = policy_loss(old + shift, old, advantages, mask, loss_type="cispo", clip_eps_low=0.2, clip_eps_high=5.0)
    theirs = trl_cispo_per_token(old + shift, old, advantages, 5.0)
    low = torch.exp(shift) < 0.8  # TRL leaves these weights alone; eps_clip_low=0.2 raises them to 0.8
    assert low.any()
    assert not torch.allclose(ours[low], theirs[low])
