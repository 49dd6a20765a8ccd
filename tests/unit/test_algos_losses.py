"""Policy / value losses, entropy and total loss: hand values, gradients, masking."""

import math

import pytest
import torch

from hpc_rlhf.algos import entropy_from_logits, policy_loss, total_loss, value_loss

ALL = torch.ones(1, 5, dtype=torch.bool)


def ppo_inputs(ratios, advantages):
    old_logprobs = torch.full((1, len(ratios)), -1.0)
    logprobs = (old_logprobs + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    return logprobs, old_logprobs, torch.tensor([advantages])


def test_ppo_clip_higher_by_hand():
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1]
    advantages = [1.0, 1.0, -1.0, -1.0, 2.0]
    logprobs, old_logprobs, adv = ppo_inputs(ratios, advantages)
    loss, stats = policy_loss(
        logprobs, old_logprobs, adv, ALL, clip_eps_low=0.2, clip_eps_high=0.28
    )
    # -min(r A, clip(r, 0.8, 1.28) A) per token.
    expected = torch.tensor([[-1.28, -0.5, 0.8, 1.5, -2.2]])
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    # d/dlogprobs of -r A is -r A where unclipped, 0 where the clipped branch wins.
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, 0.0, 1.5, -2.2]]))
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)
    assert not stats["clip_fraction"].requires_grad


def test_cispo_by_hand_clipped_tokens_keep_their_gradient():
    """CISPO: loss_t = -sg(clip(r_t, 0.8, 1.28)) A_t log pi_t; d/dlogprobs = -clip(r_t) A_t, also where PPO's clip
    would give 0 (tokens 0 and 2 of test_ppo_clip_higher_by_hand)."""
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1]
    advantages = [1.0, 1.0, -1.0, -1.0, 2.0]
    logprobs, old_logprobs, adv = ppo_inputs(ratios, advantages)
    loss, stats = policy_loss(logprobs, old_logprobs, adv, ALL, loss_type="cispo", clip_eps_low=0.2,
                              clip_eps_high=0.28)
    weights = [1.28, 0.8, 0.8, 1.28, 1.1]  # the ratio clipped to [0.8, 1.28]
    logp = [-1.0 + math.log(r) for r in ratios]
    expected = torch.tensor([[-w * a * lp for w, a, lp in zip(weights, advantages, logp, strict=True)]])
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.28, -0.8, 0.8, 1.28, -2.2]]))
    assert stats["clip_fraction"].item() == pytest.approx(4 / 5)  # every ratio outside the band but 1.1


def test_sapo_by_hand_soft_gate():
    """SAPO: loss_t = -(4/tau) sigmoid(tau (r_t - 1)) A_t, tau 1.0 for A > 0 and 1.05 otherwise; the gradient in
    log pi is -4 s (1 - s) r_t A_t: the plain policy gradient -A_t at r_t = 1, fading as r_t moves away."""
    ratios = [1.0, 1.5, 0.5, 3.0]
    advantages = [1.0, 1.0, -1.0, 1.0]
    logprobs, old_logprobs, adv = ppo_inputs(ratios, advantages)
    loss, stats = policy_loss(logprobs, old_logprobs, adv, torch.ones(1, 4, dtype=torch.bool), loss_type="sapo",
                              sapo_tau_pos=1.0, sapo_tau_neg=1.05)

    def sigmoid(x):
        return 1.0 / (1.0 + math.exp(-x))

    taus = [1.0, 1.0, 1.05, 1.0]
    gates = [sigmoid(t * (r - 1.0)) for t, r in zip(taus, ratios, strict=True)]
    expected = [-(4.0 / t) * g * a for t, g, a in zip(taus, gates, advantages, strict=True)]
    torch.testing.assert_close(loss, torch.tensor([expected]))
    assert loss[0, 0].item() == pytest.approx(-2.0)  # sigmoid(0) = 1/2
    loss.sum().backward()
    grads = [-4.0 * g * (1.0 - g) * r * a for g, r, a in zip(gates, ratios, advantages, strict=True)]
    torch.testing.assert_close(logprobs.grad, torch.tensor([grads]))
    assert logprobs.grad[0, 0].item() == pytest.approx(-1.0)  # the policy gradient itself at r = 1
    # Gate weights 4 s (1 - s): 1, 0.940, 0.934, 0.420: only the token at r = 3 is gated (weight < 0.5).
    assert stats["gate_fraction"].item() == pytest.approx(1 / 4)
    assert stats["gate_weight_mean"].item() == pytest.approx(sum(4 * g * (1 - g) for g in gates) / 4)


def test_cispo_and_sapo_refuse_the_dual_clip():
    logprobs, old_logprobs, adv = ppo_inputs([1.0] * 5, [1.0] * 5)
    for loss_type in ("cispo", "sapo"):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(logprobs, old_logprobs, adv, ALL, loss_type=loss_type, dual_clip=3.0)


def test_symmetric_clip_is_the_default():
    logprobs, old_logprobs, adv = ppo_inputs([1.25, 1.25, 1.25, 1.25, 1.25], [1.0] * 5)
    loss, _ = policy_loss(logprobs, old_logprobs, adv, ALL, clip_eps_low=0.2)
    torch.testing.assert_close(loss, torch.full((1, 5), -1.2))


def test_dual_clip_caps_negative_advantages_only():
    ratios = [5.0, 5.0, 0.5, 2.0, 1.0]
    advantages = [-1.0, 1.0, -1.0, -1.0, -1.0]
    logprobs, old_logprobs, adv = ppo_inputs(ratios, advantages)
    loss, stats = policy_loss(logprobs, old_logprobs, adv, ALL, dual_clip=3.0)
    # Token 0: standard loss 5, capped at 3. Token 1: A > 0, clipped to 1.2.
    # Token 2: ratio below the band, clipped branch 0.8. Token 3: 2 < 3, no cap.
    torch.testing.assert_close(loss, torch.tensor([[3.0, -1.2, 0.8, 2.0, 1.0]]))
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, 0.0, 2.0, 1.0]]))
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logprobs, old_logprobs, adv, ALL, dual_clip=0.9)


def test_gspo_matches_sequence_level_objective_and_gradient():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    old_logprobs = -torch.rand(3, 4, generator=g)
    base = old_logprobs + 0.3 * torch.randn(3, 4, generator=g)
    seq_advantage = torch.tensor([1.0, -2.0, 0.5])
    advantages = seq_advantage.unsqueeze(1).expand(3, 4)
    eps = 0.1

    logprobs = base.clone().requires_grad_(True)
    loss, _ = policy_loss(logprobs, old_logprobs, advantages, mask, loss_type="gspo",
                          clip_eps_low=eps)
    per_seq = torch.where(mask, loss, 0.0).sum(1) / mask.sum(1)
    per_seq.mean().backward()

    # Naive GSPO: s_i = exp(mean_t log-ratio), J = mean_i min(s_i A_i, clip(s_i) A_i).
    reference = base.clone().requires_grad_(True)
    objectives = []
    for i in range(3):
        length = int(mask[i].sum())
        s = torch.exp((reference[i, :length] - old_logprobs[i, :length]).mean())
        a = seq_advantage[i]
        objectives.append(torch.min(s * a, s.clamp(1 - eps, 1 + eps) * a))
        # Each token of the row reports the same sequence-level loss value.
        torch.testing.assert_close(loss[i, :length], (-objectives[-1]).detach().expand(length))
    (-torch.stack(objectives).mean()).backward()
    torch.testing.assert_close(logprobs.grad, reference.grad)
    assert (logprobs.grad[~mask] == 0).all()


def test_importance_weights_scale_the_loss_and_are_not_differentiated():
    logprobs, old_logprobs, adv = ppo_inputs([1.0, 1.1, 0.9, 1.0, 1.0], [1.0, -1.0, 2.0, 1.0, 0.5])
    weights = torch.tensor([[0.5, 2.0, 1.0, 0.0, 3.0]], requires_grad=True)
    plain, _ = policy_loss(logprobs, old_logprobs, adv, ALL)
    weighted, _ = policy_loss(logprobs, old_logprobs, adv, ALL, importance_weights=weights)
    torch.testing.assert_close(weighted, plain * weights.detach())
    weighted.sum().backward()
    assert weights.grad is None


@pytest.mark.parametrize("loss_type", ["ppo", "gspo", "cispo", "sapo"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_policy_loss_masked_positions_change_nothing(loss_type, poison):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]], dtype=torch.bool)
    logprobs = -torch.rand(2, 4, generator=g)
    old_logprobs = logprobs + 0.2 * torch.randn(2, 4, generator=g)
    advantages = torch.randn(2, 4, generator=g)
    weights = torch.rand(2, 4, generator=g)

    def run(*tensors):
        lp = tensors[0].clone().requires_grad_(True)
        dual_clip = 3.0 if loss_type in ("ppo", "gspo") else None
        loss, stats = policy_loss(lp, *tensors[1:3], mask, loss_type=loss_type, dual_clip=dual_clip,
                                  importance_weights=tensors[3])
        loss.sum().backward()
        return [loss, lp.grad] + list(stats.values())

    clean = run(logprobs, old_logprobs, advantages, weights)
    inputs = (logprobs, old_logprobs, advantages, weights)
    poisoned = run(*(torch.where(mask, t, poison) for t in inputs))
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)
    assert (poisoned[0][~mask] == 0).all() and (poisoned[1][~mask] == 0).all()


def test_value_loss_by_hand():
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    old_values = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[1.0, 0.1, -0.5, float("nan")]], requires_grad=True)
    returns = torch.tensor([[2.0, 1.0, 0.0, 0.0]])
    loss, _ = value_loss(values, old_values, returns, mask)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 0.5 * 0.81, 0.125, 0.0]]))

    loss, stats = value_loss(values, old_values, returns, mask, value_clip=0.2)
    # Clipped values: 0.2, 0.1, -0.2. Token 0: max(1, 3.24) -> clipped branch (no grad).
    # Token 1: within the clip. Token 2: max(0.25, 0.04) -> unclipped.
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 3.24, 0.5 * 0.81, 0.125, 0.0]]))
    loss.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.9, -0.5, 0.0]]))
    assert stats["value_clip_fraction"].item() == pytest.approx(1 / 3)


def test_entropy_from_logits_matches_categorical_and_ignores_masked_rows():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g) * 3
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    got = entropy_from_logits(logits, mask)
    torch.testing.assert_close(got, torch.where(mask, expected, 0.0))
    uniform = entropy_from_logits(torch.zeros(1, 1, 7), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(uniform, torch.tensor([[math.log(7)]]))

    poisoned = torch.where(mask.unsqueeze(-1), logits, float("nan")).requires_grad_(True)
    clean = logits.clone().requires_grad_(True)
    entropy_from_logits(poisoned, mask).sum().backward()
    entropy_from_logits(clean, mask).sum().backward()
    torch.testing.assert_close(entropy_from_logits(poisoned, mask), got)
    assert torch.isfinite(poisoned.grad).all()
    torch.testing.assert_close(poisoned.grad, clean.grad)
    assert (poisoned.grad[~mask] == 0).all()


def test_total_loss_combines_terms():
    policy, kl, entropy, aux = (torch.tensor(v) for v in (1.0, 0.5, 2.0, 4.0))
    assert total_loss(policy).item() == 1.0
    got = total_loss(policy, kl_loss=kl, kl_coef=0.1, entropy=entropy, entropy_coef=0.01,
                     aux_loss=aux, aux_loss_coef=0.001, aux_weight=0.25)
    assert got.item() == pytest.approx(1.0 + 0.05 - 0.02 + 0.001)
    # Zero coefficient means the term is not added at all, even if it is NaN.
    assert total_loss(policy, aux_loss=torch.tensor(float("nan"))).item() == 1.0
