"""Advantage estimators: hand-computed values, a naive reference loop, invariances, masking."""

import math

import pytest
import torch

from hpc_rlhf.algos import (
    ESTIMATORS,
    GROUP_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    dr_grpo_rewards,
    gae_advantages,
    group_norm_rewards,
    reinforce_baseline_rewards,
    rloo_rewards,
    token_level_rewards,
)

B_MASK = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)


def random_mask(num_rows, num_positions, generator, allow_gaps=True):
    """Prompt prefix, then actions, then padding; optionally holes (env observations)."""
    mask = torch.zeros(num_rows, num_positions, dtype=torch.bool)
    for row in range(num_rows):
        start = int(torch.randint(0, 3, (1,), generator=generator))
        end = int(torch.randint(start + 1, num_positions + 1, (1,), generator=generator))
        mask[row, start:end] = True
        if allow_gaps and end - start > 3:
            mask[row, start + 1] = False
    return mask


def naive_gae(rewards_row, values_row, mask_row, gamma, lambd):
    """Per-row reference: walk the list of action positions only."""
    positions = [t for t in range(len(mask_row)) if mask_row[t]]
    advantages = [0.0] * len(mask_row)
    next_value, next_advantage = 0.0, 0.0
    for t in reversed(positions):
        delta = rewards_row[t] + gamma * next_value - values_row[t]
        next_advantage = delta + gamma * lambd * next_advantage
        next_value = values_row[t]
        advantages[t] = next_advantage
    return advantages


def test_token_level_rewards_by_hand():
    kl = torch.tensor([[9.0, 1.0, 2.0, 9.0], [1.0, -1.0, 0.5, 2.0]])
    got = token_level_rewards(torch.tensor([2.0, 3.0]), B_MASK, kl, kl_coef=0.1)
    expected = torch.tensor([[0.0, -0.1, 2.0 - 0.2, 0.0], [-0.1, 0.1, -0.05, 3.0 - 0.2]])
    torch.testing.assert_close(got, expected)


def test_token_level_rewards_row_without_actions_gets_nothing():
    mask = torch.tensor([[0, 0, 0], [0, 1, 0]], dtype=torch.bool)
    got = token_level_rewards(torch.tensor([5.0, 7.0]), mask)
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, 0.0], [0.0, 7.0, 0.0]]))


def test_discounted_returns_skip_masked_positions():
    # Actions at 0, 1, 3 (2 is an environment observation), padding at 4.
    mask = torch.tensor([[1, 1, 0, 1, 0]], dtype=torch.bool)
    token_rewards = torch.tensor([[1.0, 2.0, 100.0, 4.0, 100.0]])
    got = discounted_returns(token_rewards, mask, gamma=0.5)
    # G3 = 4, G1 = 2 + 0.5 * 4 = 4, G0 = 1 + 0.5 * 4 = 3
    torch.testing.assert_close(got, torch.tensor([[3.0, 4.0, 0.0, 4.0, 0.0]]))


def test_gae_by_hand():
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    token_rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    gamma, lambd = 0.9, 0.8
    d2 = 1.0 - 0.4
    d1 = 0.0 + 0.9 * 0.4 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma, lambd)
    torch.testing.assert_close(advantages, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(returns, torch.tensor([[a0 + 0.5, a1 + 0.2, a2 + 0.4]]))


def test_gae_with_unit_gamma_lambda_is_monte_carlo_minus_values():
    g = torch.Generator().manual_seed(0)
    mask = random_mask(6, 9, g, allow_gaps=False)
    token_rewards = torch.randn(6, 9, generator=g)
    values = torch.randn(6, 9, generator=g)
    advantages, returns = gae_advantages(token_rewards, values, mask, gamma=1.0, lambd=1.0)
    masked_rewards = torch.where(mask, token_rewards, 0.0)
    monte_carlo = masked_rewards.flip(1).cumsum(1).flip(1)
    torch.testing.assert_close(advantages, torch.where(mask, monte_carlo - values, 0.0))
    torch.testing.assert_close(returns, torch.where(mask, monte_carlo, 0.0))


@pytest.mark.parametrize("gamma,lambd", [(0.99, 0.95), (0.5, 0.0), (1.0, 0.7)])
def test_gae_matches_naive_loop_with_gaps(gamma, lambd):
    g = torch.Generator().manual_seed(1)
    mask = random_mask(5, 10, g)
    token_rewards = torch.randn(5, 10, generator=g)
    values = torch.randn(5, 10, generator=g)
    advantages, _ = gae_advantages(token_rewards, values, mask, gamma, lambd)
    expected = torch.tensor(
        [naive_gae(token_rewards[i].tolist(), values[i].tolist(), mask[i].tolist(), gamma, lambd)
         for i in range(5)]
    )
    torch.testing.assert_close(advantages, expected)


def test_reinforce_returns_and_batch_whitening():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([1.0, -2.0])
    advantages, returns = compute_advantages("reinforce", rewards, mask, 1, gamma=0.5)
    expected_returns = torch.tensor([[0.5, 1.0, 0.0], [-0.5, -1.0, -2.0]])
    torch.testing.assert_close(returns, expected_returns)
    tokens = [0.5, 1.0, -0.5, -1.0, -2.0]
    mean = sum(tokens) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in tokens) / 5)
    expected = torch.tensor([[0.5, 1.0, mean], [-0.5, -1.0, -2.0]])
    expected = torch.where(mask, (expected - mean) / std, 0.0)
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=1e-5)


def test_reinforce_baseline_subtracts_group_mean_then_whitens():
    mask = torch.ones(4, 2, dtype=torch.bool)
    rewards = torch.tensor([1.0, 3.0, 5.0, 5.0])
    raw, returns = compute_advantages("reinforce_baseline", rewards, mask, 2, whiten=False)
    torch.testing.assert_close(raw, torch.tensor([[-1.0, -1], [1, 1], [0, 0], [0, 0]]))
    torch.testing.assert_close(returns, raw)
    whitened, _ = compute_advantages("reinforce_baseline", rewards, mask, 2)
    # Token values -1 x2, 1 x2, 0 x4: mean 0, population std sqrt(4/8).
    torch.testing.assert_close(whitened, raw / math.sqrt(0.5), atol=1e-5, rtol=1e-5)


def test_rloo_by_hand():
    got = rloo_rewards(torch.tensor([1.0, 2.0, 6.0, 0.0, 0.0, 3.0]), 3)
    # Group 1 baselines: (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5. Group 2: 1.5, 1.5, 0.
    torch.testing.assert_close(got, torch.tensor([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]))


def test_group_norm_by_hand():
    # Constant groups have std 0: eps keeps their advantage at 0 instead of 0/0.
    got = group_norm_rewards(torch.tensor([1.0, 3.0, 0.0, 0.0, 1.0, 1.0]), 2)
    torch.testing.assert_close(
        got, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0, 0.0, 0.0]),
        atol=1e-5, rtol=1e-5,
    )
    got = group_norm_rewards(torch.tensor([0.0, 0.0, 1.0, 1.0]), 4, eps=0.0)
    half_over_std = 0.5 / math.sqrt(1 / 3)  # unbiased std of {0,0,1,1}
    torch.testing.assert_close(got, torch.tensor([-1, -1, 1, 1]) * half_over_std)


@pytest.mark.parametrize("estimator,expected_sequence_advantage", [
    ("group_norm", [-1 / math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2), 1 / math.sqrt(2)]),
    ("dr_grpo", [-1.0, 1.0, -0.5, 0.5]),
    ("rloo", [-2.0, 2.0, -1.0, 1.0]),
])
def test_group_estimators_broadcast_sequence_advantage(estimator, expected_sequence_advantage):
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([0.0, 2.0, 1.0, 2.0])
    advantages, _ = compute_advantages(estimator, rewards, mask, 2, eps=0.0)
    expected = torch.tensor(expected_sequence_advantage).unsqueeze(1).expand(4, 4)
    torch.testing.assert_close(advantages, torch.where(mask, expected, 0.0), atol=1e-6, rtol=1e-6)


SHAPING = {
    "group_norm": group_norm_rewards,
    "dr_grpo": dr_grpo_rewards,
    "reinforce_baseline": reinforce_baseline_rewards,
    "rloo": rloo_rewards,
}


def test_shaping_table_covers_every_group_estimator():
    assert set(SHAPING) == set(GROUP_ESTIMATORS)


@pytest.mark.parametrize("estimator", GROUP_ESTIMATORS)
@pytest.mark.parametrize("value", [0.1, 0.3, 0.7])
@pytest.mark.parametrize("n", [8, 16])
def test_constant_group_gives_exactly_zero_advantage(estimator, value, n):
    # The fp32 mean of n copies of 0.1 / 0.3 / 0.7 is not exactly the value; without the constant-group
    # guard group_norm turned that residue into advantages of 0.007 to 0.06.
    rewards = torch.full((2 * n,), value)
    shaped = SHAPING[estimator](rewards, n)
    assert (shaped == 0.0).all(), shaped
    mask = torch.ones(2 * n, 3, dtype=torch.bool)
    advantages, returns = compute_advantages(estimator, rewards, mask, n)
    assert (advantages == 0.0).all(), advantages
    assert (returns == 0.0).all(), returns


@pytest.mark.parametrize("estimator,expected_varied", [
    # Varied group {0, 1} x 4: mean 0.5, unbiased std sqrt(2/7); RLOO baselines 4/7 (for a 0) and 3/7 (for a 1).
    ("group_norm", [-0.5 / math.sqrt(2 / 7), 0.5 / math.sqrt(2 / 7)] * 4),
    ("dr_grpo", [-0.5, 0.5] * 4),
    ("reinforce_baseline", [-0.5, 0.5] * 4),
    ("rloo", [-4 / 7, 4 / 7] * 4),
])
def test_constant_group_beside_a_varied_group(estimator, expected_varied):
    n = 8
    rewards = torch.tensor([0.7] * n + [0.0, 1.0] * 4)
    expected = torch.tensor([0.0] * n + expected_varied)
    shaped = SHAPING[estimator](rewards, n)
    assert (shaped[:n] == 0.0).all(), shaped
    torch.testing.assert_close(shaped, expected, atol=1e-5, rtol=1e-5)
    mask = torch.ones(2 * n, 2, dtype=torch.bool)
    # No whitening: batch whitening (reinforce_baseline's default) shifts the zeros by the batch mean.
    advantages, _ = compute_advantages(estimator, rewards, mask, n, whiten=False)
    assert (advantages[:n] == 0.0).all(), advantages
    torch.testing.assert_close(advantages, expected.unsqueeze(1).expand(2 * n, 2), atol=1e-5, rtol=1e-5)


def test_group_norm_without_std_equals_dr_grpo():
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(8, generator=g)
    mask = random_mask(8, 6, g)
    a, _ = compute_advantages("group_norm", rewards, mask, 4, norm_adv_by_std=False)
    b, _ = compute_advantages("dr_grpo", rewards, mask, 4)
    torch.testing.assert_close(a, b)


def test_reward_clipping_clips_the_shaped_rewards():
    mask = torch.ones(2, 1, dtype=torch.bool)
    advantages, _ = compute_advantages(
        "dr_grpo", torch.tensor([-10.0, 3.0]), mask, 2, reward_clip_range=(-1.0, 1.0)
    )
    torch.testing.assert_close(advantages, torch.tensor([[-1.0], [1.0]]))


def test_kl_folded_into_rewards_of_group_estimator():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    kl = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    rewards = torch.tensor([1.0, 3.0])
    advantages, _ = compute_advantages("dr_grpo", rewards, mask, 2, kl=kl, kl_coef=0.1)
    # Sequence advantages -1, +1 on the last action token plus the KL-to-go.
    expected = torch.tensor([[-1 - 0.6, -1 - 0.5, -1 - 0.3], [1 - 0.9, 1 - 0.5, 0.0]])
    torch.testing.assert_close(advantages, expected)


def test_gae_dispatch_returns_are_raw_advantages_plus_values_and_whitening_is_optional():
    g = torch.Generator().manual_seed(3)
    mask = random_mask(4, 5, g)
    values = torch.randn(4, 5, generator=g)
    rewards = torch.randn(4, generator=g)
    raw, returns = compute_advantages("gae", rewards, mask, 1, values=values, gamma=0.9, lambd=0.9,
                                      whiten=False)
    torch.testing.assert_close(returns, torch.where(mask, raw + values, 0.0))
    whitened, returns_w = compute_advantages("gae", rewards, mask, 1, values=values, gamma=0.9,
                                             lambd=0.9)
    torch.testing.assert_close(returns_w, returns)
    assert abs(whitened[mask].mean().item()) < 1e-5
    assert abs(whitened[mask].std(unbiased=False).item() - 1.0) < 1e-4


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_permuting_prompt_groups_permutes_outputs(estimator):
    g = torch.Generator().manual_seed(4)
    n, num_prompts, num_positions = 3, 4, 7
    batch = n * num_prompts
    rewards = torch.randn(batch, generator=g)
    mask = random_mask(batch, num_positions, g)
    values = torch.randn(batch, num_positions, generator=g)
    kl = torch.rand(batch, num_positions, generator=g)
    gamma = 1.0 if estimator in GROUP_ESTIMATORS else 0.99  # group estimators refuse discounting
    kwargs = dict(kl=kl, kl_coef=0.05, gamma=gamma, lambd=0.95)
    advantages, returns = compute_advantages(estimator, rewards, mask, n, values=values, **kwargs)

    group_order = torch.tensor([2, 0, 3, 1])
    rows = (group_order.unsqueeze(1) * n + torch.arange(n)).reshape(-1)
    kwargs["kl"] = kl[rows]
    p_adv, p_ret = compute_advantages(estimator, rewards[rows], mask[rows], n, values=values[rows],
                                      **kwargs)
    torch.testing.assert_close(p_adv, advantages[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_ret, returns[rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_masked_values_and_kl_cannot_leak(estimator, poison):
    g = torch.Generator().manual_seed(5)
    mask = random_mask(4, 6, g)
    rewards = torch.randn(4, generator=g)
    values = torch.randn(4, 6, generator=g)
    kl = torch.rand(4, 6, generator=g)

    def run(values_in, kl_in):
        values_in = values_in.clone().requires_grad_(True)
        kl_in = kl_in.clone().requires_grad_(True)
        gamma = 1.0 if estimator in GROUP_ESTIMATORS else 0.9
        advantages, returns = compute_advantages(estimator, rewards, mask, 2, values=values_in,
                                                 kl=kl_in, kl_coef=0.1, gamma=gamma, lambd=0.9)
        (advantages.square().sum() + returns.sum()).backward()
        return advantages, returns, values_in.grad, kl_in.grad

    clean = run(values, kl)
    poisoned = run(torch.where(mask, values, poison), torch.where(mask, kl, poison))
    if estimator != "gae":
        assert clean[2] is None and poisoned[2] is None  # values are unused
        clean, poisoned = clean[:2] + clean[3:], poisoned[:2] + poisoned[3:]
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)
    assert (clean[0][~mask] == 0).all() and (clean[1][~mask] == 0).all()
    for grad in poisoned[2:]:
        assert (grad[~mask] == 0).all()


def test_invalid_arguments_fail_loudly():
    mask = torch.ones(4, 2, dtype=torch.bool)
    rewards = torch.zeros(4)
    with pytest.raises(ValueError, match="advantage_estimator"):
        compute_advantages("ppo", rewards, mask, 2)
    with pytest.raises(ValueError, match="multiple"):
        compute_advantages("group_norm", rewards, mask, 3)
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages("gae", rewards, mask, 1)
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages("rloo", rewards, mask, 1)
