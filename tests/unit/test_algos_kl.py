"""KL estimators: hand values, sign/gradient properties, clamping, masking."""

import math

import pytest
import torch

from hpc_rlhf.algos import KL_ESTIMATORS, kl_estimate

MASK = torch.tensor([[True, True, False]])


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([[math.log(0.5), math.log(0.1), 0.0]])
    ref_logprobs = torch.tensor([[math.log(0.25), math.log(0.2), 0.0]])
    ln2 = math.log(2.0)
    expected = {
        "k1": [ln2, -ln2, 0.0],
        "k2": [0.5 * ln2**2, 0.5 * ln2**2, 0.0],
        # k3 = ref/pi - 1 - log(ref/pi)
        "k3": [0.5 - 1 + ln2, 2.0 - 1 - ln2, 0.0],
    }
    for estimator, values in expected.items():
        got = kl_estimate(logprobs, ref_logprobs, MASK, estimator)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.tensor([values]))


def test_k3_is_non_negative_and_zero_only_at_equality():
    g = torch.Generator().manual_seed(0)
    logprobs = torch.randn(64, 32, generator=g) * 5
    ref_logprobs = torch.randn(64, 32, generator=g) * 5
    mask = torch.ones(64, 32, dtype=torch.bool)
    assert (kl_estimate(logprobs, ref_logprobs, mask, "k3") >= 0).all()
    assert (kl_estimate(logprobs, ref_logprobs, mask, "k2") >= 0).all()
    assert (kl_estimate(logprobs, logprobs, mask, "k3") == 0).all()


def test_estimate_is_clamped_and_k3_stays_finite():
    logprobs = torch.tensor([[0.0, -200.0, 0.0]])
    ref_logprobs = torch.tensor([[-15.0, 0.0, 0.0]])
    torch.testing.assert_close(kl_estimate(logprobs, ref_logprobs, MASK, "k1"),
                               torch.tensor([[10.0, -10.0, 0.0]]))
    # k3(15) = 14 + e^-15 and k3(-200) = e^200 - 201 are both above the bound of 10 (OpenRLHF's value clamp).
    k3 = kl_estimate(logprobs, ref_logprobs, MASK, "k3")
    torch.testing.assert_close(k3, torch.tensor([[10.0, 10.0, 0.0]]))
    unclamped = kl_estimate(logprobs, ref_logprobs, MASK, "k1", value_clamp=None)
    torch.testing.assert_close(unclamped, torch.tensor([[15.0, -200.0, 0.0]]))
    inside = kl_estimate(torch.tensor([[-1.0, -3.0]]), torch.tensor([[-3.0, -1.0]]), MASK[:, :2], "k3", value_clamp=20)
    torch.testing.assert_close(inside, torch.tensor([[math.exp(-2) + 1, math.exp(2) - 3]]))


def test_low_precision_inputs_are_computed_in_fp32():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.bfloat16)
    ref_logprobs = torch.tensor([[-1.5, -2.0, -1.0]], dtype=torch.bfloat16)
    assert kl_estimate(logprobs, ref_logprobs, MASK, "k3").dtype == torch.float32


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_gradient_descent_on_kl_moves_logprobs_toward_ref(estimator):
    g = torch.Generator().manual_seed(1)
    ref_logprobs = -torch.rand(4, 6, generator=g) * 3
    # k1's gradient is the constant +1 (it only pushes logprobs down), so it moves
    # toward the reference only from above; k2 and k3 must work from both sides.
    offset = torch.rand(4, 6, generator=g) + 0.1
    if estimator != "k1":
        offset = offset * torch.where(torch.rand(4, 6, generator=g) > 0.5, 1.0, -1.0)
    logprobs = (ref_logprobs + offset).requires_grad_(True)
    mask = torch.ones(4, 6, dtype=torch.bool)
    kl_estimate(logprobs, ref_logprobs, mask, estimator).sum().backward()
    assert torch.isfinite(logprobs.grad).all()
    # The gradient has the sign of (logprobs - ref): a descent step shrinks the gap.
    assert (torch.sign(logprobs.grad) == torch.sign(offset)).all()
    stepped = logprobs.detach() - 0.05 * logprobs.grad
    assert ((stepped - ref_logprobs).abs() < offset.abs()).all()
    new_kl = kl_estimate(stepped, ref_logprobs, mask, estimator).sum()
    old_kl = kl_estimate(logprobs.detach(), ref_logprobs, mask, estimator).sum()
    assert new_kl < old_kl


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_masked_positions_change_nothing(estimator, poison):
    g = torch.Generator().manual_seed(2)
    logprobs = -torch.rand(3, 5, generator=g)
    ref_logprobs = -torch.rand(3, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool)

    def run(lp, ref):
        lp = lp.clone().requires_grad_(True)
        ref = ref.clone().requires_grad_(True)
        kl = kl_estimate(lp, ref, mask, estimator)
        kl.sum().backward()
        return kl, lp.grad, ref.grad

    clean = run(logprobs, ref_logprobs)
    poisoned = run(torch.where(mask, logprobs, poison), torch.where(mask, ref_logprobs, poison))
    for a, b in zip(clean, poisoned):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b)
        assert (b[~mask] == 0).all()
