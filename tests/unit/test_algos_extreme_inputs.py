"""Extreme and degenerate inputs: hand-computed values (OpenRLHF's clamping semantics) and properties.

A diverged token (a log-ratio of 100 after a bad update or a rollout/trainer mismatch) must neither
produce a NaN nor dominate a step; a zero-variance group or an all-masked row must give finite values.
"""

import math

import pytest
import torch

from hpc_rlhf.algos import (
    CORRECTION_MODES,
    ESTIMATORS,
    KL_ESTIMATORS,
    compute_advantages,
    kl_estimate,
    policy_loss,
    rollout_importance_weights,
    value_loss,
)
from hpc_rlhf.algos.advantages import dr_grpo_rewards, reinforce_baseline_rewards

ONE = torch.tensor([[True]])


def _policy_case(log_ratio, advantage, **kwargs):
    logprobs = torch.tensor([[float(log_ratio)]], requires_grad=True)
    loss, stats = policy_loss(logprobs, torch.tensor([[0.0]]), torch.tensor([[float(advantage)]]), ONE, **kwargs)
    loss.sum().backward()
    return loss.item(), logprobs.grad.item(), stats


# ---------------------------------------------------------------- 1. policy loss: clamped log-ratio


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_log_ratio_100_positive_advantage_gives_clipped_loss_and_zero_gradient(loss_type):
    loss, grad, _ = _policy_case(100.0, 1.0, loss_type=loss_type)
    assert loss == pytest.approx(-1.2)  # -min(r A, clip(r) A) = -(1 + eps) A
    assert grad == 0.0


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_log_ratio_100_zero_advantage_gives_zero_loss_and_gradient(loss_type):
    loss, grad, _ = _policy_case(100.0, 0.0, loss_type=loss_type)
    assert loss == 0.0
    assert grad == 0.0


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_log_ratio_100_dual_clip_caps_loss_with_zero_gradient(loss_type):
    loss, grad, stats = _policy_case(100.0, -1.0, loss_type=loss_type, dual_clip=3.0)
    assert loss == pytest.approx(3.0)  # -max(min(r A, clip(r) A), c A) = -c A
    assert grad == 0.0
    assert stats["dual_clip_fraction"].item() == 1.0


@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
def test_log_ratio_minus_100_gives_finite_loss_and_gradient(loss_type):
    # r = exp(-20) (clamped): the unclipped branch wins for A = 1 and A = -1 with dual clip.
    for advantage, kwargs in ((1.0, {}), (-1.0, {"dual_clip": 3.0}), (0.0, {})):
        loss, grad, stats = _policy_case(-100.0, advantage, loss_type=loss_type, **kwargs)
        assert math.isfinite(loss) and math.isfinite(grad)
        assert all(torch.isfinite(v) for v in stats.values())


def test_ppo_kl_stats_name_their_estimator():
    # old - new = log 2 on the one token: k1 (OpenRLHF's ppo_kl) = log 2, k3 = 1/2 - 1 + log 2... with
    # log_ratio = new - old = -log 2: k3 = exp(log 2) - 1 - log 2.
    logprobs = torch.tensor([[-math.log(2.0)]])
    _, stats = policy_loss(logprobs, torch.tensor([[0.0]]), torch.tensor([[1.0]]), ONE)
    assert stats["ppo_kl_k1"].item() == pytest.approx(math.log(2.0))
    assert stats["ppo_kl_k3"].item() == pytest.approx(2.0 - 1.0 - math.log(2.0))
    assert "approx_kl" not in stats


# ---------------------------------------------------------------- 2. KL estimators: value clamp


def test_k3_value_is_clamped_not_the_log_ratio():
    # logprob -5 vs reference -1: log_ratio -4, k3 = e^4 - 1 - 4 = 49.6 -> clamped to 10.
    got = kl_estimate(torch.tensor([[-5.0]]), torch.tensor([[-1.0]]), ONE, "k3")
    assert got.item() == pytest.approx(10.0)
    got = kl_estimate(torch.tensor([[-12.0]]), torch.tensor([[0.0]]), ONE, "k3")
    assert got.item() == pytest.approx(10.0)  # was e^10 - 11 = 22015 with the log-ratio clamp


def test_k2_value_is_clamped():
    # log_ratio 6: k2 = 18 -> 10; log_ratio -3: k2 = 4.5 stays.
    got = kl_estimate(torch.tensor([[6.0, -3.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), "k2")
    torch.testing.assert_close(got, torch.tensor([[10.0, 4.5]]))


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_clamped_kl_tokens_have_zero_gradient_even_at_log_ratio_100(estimator):
    logprobs = torch.tensor([[100.0, -100.0, -0.5]], requires_grad=True)
    kl = kl_estimate(logprobs, torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool), estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all()
    assert logprobs.grad[0, :2].tolist() == [0.0, 0.0]
    assert logprobs.grad[0, 2].item() != 0.0


# ---------------------------------------------------------------- 3. reward clipping after shaping


def test_reward_clip_applies_after_group_shaping_as_openrlhf():
    # rewards [0, 4, 12, 30], group_norm: (r - 11.5) / std (std = sqrt(177)); every shaped value is
    # inside +-10, so the clip changes nothing (clipping raw rewards first would give [-1.22, -.41, .82, .82]).
    mask = torch.ones(4, 1, dtype=torch.bool)
    advantages, _ = compute_advantages("group_norm", torch.tensor([0.0, 4.0, 12.0, 30.0]), mask, 4,
                                       reward_clip_range=(-10.0, 10.0))
    std = math.sqrt(177.0)
    expected = [[(r - 11.5) / (std + 1e-6)] for r in (0.0, 4.0, 12.0, 30.0)]
    torch.testing.assert_close(advantages, torch.tensor(expected))
    assert advantages.flatten().tolist() == pytest.approx([-0.864, -0.564, 0.038, 1.390], abs=1e-3)


def test_reward_clip_clips_the_shaped_reward():
    # rloo [0, 30]: shaped [-30, 30], clipped to [-10, 10].
    mask = torch.ones(2, 1, dtype=torch.bool)
    advantages, _ = compute_advantages("rloo", torch.tensor([0.0, 30.0]), mask, 2, reward_clip_range=(-10.0, 10.0))
    torch.testing.assert_close(advantages, torch.tensor([[-10.0], [10.0]]))


# ---------------------------------------------------------------- 4. seq_mask_tis: unclamped gate


def test_seq_mask_tis_gates_on_the_unclamped_geometric_mean():
    # One token at log-weight -30 in a 30-token row: mean log-weight -1, geometric mean e^-1 = 0.368 < 0.5.
    mask = torch.ones(1, 30, dtype=torch.bool)
    old = torch.zeros(1, 30)
    old[0, 0] = -30.0
    weights, stats = rollout_importance_weights(old, torch.zeros(1, 30), mask, "seq_mask_tis", 0.5, 5.0)
    assert (weights == 0).all()
    assert stats["masked_fraction"].item() == 1.0


def test_rollout_kl_stats_name_their_estimator():
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.tensor([[math.log(2.0), 0.0]])
    _, stats = rollout_importance_weights(old, torch.zeros(1, 2), mask, "tis")
    # k1 of KL(pi_rollout || pi_old) = mean(rollout - old): OpenRLHF's vllm_kl.
    assert stats["rollout_kl_k1"].item() == pytest.approx(-math.log(2.0) / 2)
    assert stats["rollout_kl_k3"].item() == pytest.approx((2 - 1 - math.log(2.0)) / 2)
    assert "rollout_kl" not in stats


# ---------------------------------------------------------------- 5./6. group estimators


@pytest.mark.parametrize("shaping", [reinforce_baseline_rewards, dr_grpo_rewards])
def test_group_shaping_refuses_groups_of_one(shaping):
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        shaping(torch.tensor([1.0, 2.0]), 1)


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "rloo", "group_norm", "dr_grpo"])
def test_group_estimators_refuse_groups_of_one(estimator):
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        compute_advantages(estimator, torch.tensor([1.0, 2.0]), torch.ones(2, 3, dtype=torch.bool), 1)


@pytest.mark.parametrize("estimator", ["reinforce_baseline", "rloo", "group_norm", "dr_grpo"])
def test_group_estimators_refuse_discounting(estimator):
    # rloo, gamma 0.9, rewards [1, 0], 3 tokens would give [[.81, .9, 1], ...]; OpenRLHF forces gamma = 1.
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages(estimator, torch.tensor([1.0, 0.0]), torch.ones(2, 3, dtype=torch.bool), 2, gamma=0.9)


# ---------------------------------------------------------------- properties over random inputs


def _random_case(seed, rows=8, cols=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, cols, generator=g) > 0.3
    mask[0] = False  # an all-masked row
    # log-ratios up to +-100, some tokens ordinary
    scale = torch.where(torch.rand(rows, cols, generator=g) > 0.5, 100.0, 1.0)
    log_ratio = (torch.rand(rows, cols, generator=g) * 2 - 1) * scale
    old = -torch.rand(rows, cols, generator=g) * 5
    return g, mask, old, log_ratio


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("loss_type", ["ppo", "gspo"])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_is_finite_with_finite_gradients(seed, loss_type, dual_clip):
    g, mask, old, log_ratio = _random_case(seed)
    advantages = torch.randn(mask.shape, generator=g) * 3
    advantages[1] = 0.0  # a zero-variance group
    logprobs = (old + log_ratio).requires_grad_(True)
    weights, _ = rollout_importance_weights(old, old - torch.randn(mask.shape, generator=g) * 50, mask, "tis")
    loss, stats = policy_loss(logprobs, old, advantages, mask, loss_type=loss_type, dual_clip=dual_clip,
                              importance_weights=weights)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logprobs.grad).all()
    assert all(torch.isfinite(v) for v in stats.values())
    assert (logprobs.grad[~mask] == 0).all()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_estimates_are_bounded_with_finite_gradients(seed, estimator):
    _, mask, ref, log_ratio = _random_case(seed)
    logprobs = (ref + log_ratio).requires_grad_(True)
    kl = kl_estimate(logprobs, ref, mask, estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and (kl.abs() <= 10.0).all()
    assert torch.isfinite(logprobs.grad).all()


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_corrections_are_finite(seed, mode):
    _, mask, rollout, log_ratio = _random_case(seed)
    weights, stats = rollout_importance_weights(rollout + log_ratio, rollout, mask, mode)
    assert torch.isfinite(weights).all() and (weights[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("seed", range(8))
def test_value_loss_is_finite_with_finite_gradients(seed):
    g, mask, old, log_ratio = _random_case(seed)
    values = (old + log_ratio).requires_grad_(True)
    loss, stats = value_loss(values, old, torch.randn(mask.shape, generator=g) * 100, mask, value_clip=0.5)
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(values.grad).all()
    assert torch.isfinite(stats["value_clip_fraction"])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_estimators_are_finite_on_zero_variance_groups_and_empty_rows(seed, estimator):
    g, mask, _, _ = _random_case(seed)
    rewards = torch.randn(8, generator=g) * 100
    rewards[:4] = 7.0  # a zero-variance group of 4
    values = torch.randn(mask.shape, generator=g)
    kl = torch.randn(mask.shape, generator=g)
    advantages, returns = compute_advantages(estimator, rewards, mask, 4, values=values, kl=kl, kl_coef=0.1,
                                             reward_clip_range=(-10.0, 10.0))
    assert torch.isfinite(advantages).all() and torch.isfinite(returns).all()
    assert (advantages[0] == 0).all()  # the all-masked row
