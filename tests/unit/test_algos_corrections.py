"""Rollout/trainer mismatch importance weights: TIS, ICEPOP, sequence-mask TIS."""

import math

import pytest
import torch

from hpc_rlhf.algos import CORRECTION_MODES, policy_loss, rollout_importance_weights

LOG = math.log


def weights_for(raw_ratios, mask, mode, low=0.5, high=5.0):
    rollout_logprobs = torch.full((len(raw_ratios), len(raw_ratios[0])), -2.0)
    old_logprobs = rollout_logprobs + torch.log(torch.tensor(raw_ratios))
    return rollout_importance_weights(old_logprobs, rollout_logprobs, mask, mode, low, high)


def test_tis_truncates_into_the_band():
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    weights, stats = weights_for([[0.3, 1.0, 3.0, 8.0, 8.0]], mask, "tis")
    torch.testing.assert_close(weights, torch.tensor([[0.5, 1.0, 3.0, 5.0, 0.0]]))
    assert stats["truncated_fraction"].item() == pytest.approx(0.5)
    assert stats["masked_fraction"].item() == 0.0


def test_icepop_zeroes_tokens_outside_the_band():
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    weights, stats = weights_for([[0.3, 1.0, 3.0, 8.0, 1.0]], mask, "icepop")
    torch.testing.assert_close(weights, torch.tensor([[0.0, 1.0, 3.0, 0.0, 0.0]]))
    assert stats["masked_fraction"].item() == pytest.approx(0.5)


def test_seq_mask_tis_drops_whole_sequences_by_geometric_mean():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    raw = [[1.2, 0.9, 50.0],   # geo mean sqrt(1.08) ~ 1.04: kept, raw token weights
           [8.0, 4.0, 1.0],    # geo mean sqrt(32) ~ 5.66 > 5: dropped
           [0.1, 6.0, 1.0]]    # geo mean (0.6)^(1/3) ~ 0.84: kept although tokens are outside
    weights, stats = weights_for(raw, mask, "seq_mask_tis")
    expected = torch.tensor([[1.2, 0.9, 0.0], [0.0, 0.0, 0.0], [0.1, 6.0, 1.0]])
    torch.testing.assert_close(weights, expected)
    assert stats["masked_fraction"].item() == pytest.approx(2 / 7)


def test_rollout_kl_diagnostic_by_hand():
    mask = torch.tensor([[1, 1]], dtype=torch.bool)
    _, stats = weights_for([[2.0, 1.0]], mask, "tis")
    # ratio pi_old / pi_rollout = 2 on one token, 1 on the other: k1 = mean(log pi_rollout - log pi_old).
    assert stats["rollout_kl_k1"].item() == pytest.approx(-LOG(2) / 2)
    assert stats["rollout_kl_k3"].item() == pytest.approx((2 - 1 - LOG(2)) / 2)


@pytest.mark.parametrize("mode", CORRECTION_MODES)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_weights_are_detached_and_masked(mode, poison):
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    old_logprobs = (-torch.rand(2, 4, generator=g)).requires_grad_(True)
    rollout_logprobs = old_logprobs.detach() + 0.3 * torch.randn(2, 4, generator=g)
    clean, clean_stats = rollout_importance_weights(old_logprobs, rollout_logprobs, mask, mode)
    assert not clean.requires_grad
    poisoned, poisoned_stats = rollout_importance_weights(
        torch.where(mask, old_logprobs.detach(), poison),
        torch.where(mask, rollout_logprobs, poison), mask, mode,
    )
    torch.testing.assert_close(poisoned, clean)
    assert (poisoned[~mask] == 0).all()
    for key in clean_stats:
        torch.testing.assert_close(poisoned_stats[key], clean_stats[key])


def test_huge_mismatch_gives_finite_weights():
    mask = torch.ones(1, 2, dtype=torch.bool)
    old_logprobs = torch.tensor([[0.0, -500.0]])
    rollout_logprobs = torch.tensor([[-500.0, 0.0]])
    for mode in CORRECTION_MODES:
        weights, stats = rollout_importance_weights(old_logprobs, rollout_logprobs, mask, mode)
        assert torch.isfinite(weights).all()
    weights, _ = rollout_importance_weights(old_logprobs, rollout_logprobs, mask, "icepop")
    assert (weights == 0).all()


def test_weights_feed_policy_loss():
    mask = torch.ones(1, 3, dtype=torch.bool)
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    weights, _ = weights_for([[0.3, 1.0, 8.0]], mask, "icepop")
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.ones(1, 3), mask,
                          importance_weights=weights)
    loss.sum().backward()
    # Ratio 1, A = 1: loss -1 and gradient -1 per token, times the weight (0 outside the band).
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.0, 0.0]]))
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.0, 0.0]]))


def test_invalid_band_or_mode_fails():
    mask = torch.ones(1, 1, dtype=torch.bool)
    with pytest.raises(ValueError, match="low <= high"):
        rollout_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), mask, "tis", 2.0, 1.0)
    with pytest.raises(ValueError, match="mode"):
        rollout_importance_weights(torch.zeros(1, 1), torch.zeros(1, 1), mask, "cispo")
