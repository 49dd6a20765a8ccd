"""DAPO filtering / overlong penalty, KL controllers, running reward normaliser."""

import json
import math

import pytest
import torch

from hpc_rlhf.algos import (
    AdaptiveKLController,
    FixedKLController,
    RunningRewardNormalizer,
    dynamic_filter_mask,
    overlong_penalty,
)


def test_dynamic_filter_keeps_groups_with_mean_strictly_inside_band():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    keep = dynamic_filter_mask(scores, 2)
    # Group means: 1 (all solved), 0.5, 0 (all failed), 0.5.
    assert keep.tolist() == [False, False, True, True, False, False, True, True]
    keep = dynamic_filter_mask(scores, 2, low=0.6, high=2.0)
    assert keep.tolist() == [True, True, False, False, False, False, False, False]
    with pytest.raises(ValueError, match="multiple"):
        dynamic_filter_mask(scores, 3)


def test_dynamic_filter_is_equivariant_to_group_order():
    g = torch.Generator().manual_seed(0)
    scores = (torch.rand(12, generator=g) > 0.5).float()
    keep = dynamic_filter_mask(scores, 3)
    rows = torch.tensor([9, 10, 11, 0, 1, 2, 6, 7, 8, 3, 4, 5])
    assert torch.equal(dynamic_filter_mask(scores[rows], 3), keep[rows])


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 15, 16, 18, 20, 21, 100])
    got = overlong_penalty(lengths, max_length=20, buffer_length=5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0, -1.0, -1.0]))
    got = overlong_penalty(lengths, max_length=20, buffer_length=5, penalty_factor=0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5, -0.5, -0.5]))
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(lengths, max_length=20, buffer_length=0)


def test_fixed_kl_controller():
    controller = FixedKLController(0.05)
    assert controller.update(100.0, 512) == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == 0.05


def test_adaptive_kl_controller_by_hand_and_resume():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 9: error 0.5 clipped to 0.2 -> beta * (1 + 0.2 * 100 / 10000).
    assert controller.update(9.0, 100) == pytest.approx(0.1 * 1.002)
    # KL 5.4: error -0.1 -> beta * (1 - 0.1 * 100 / 10000).
    assert controller.update(5.4, 100) == pytest.approx(0.1 * 1.002 * 0.999)
    state = json.loads(json.dumps(controller.state_dict()))
    restored = AdaptiveKLController(init_kl_coef=1.0, target=1.0, horizon=1)
    restored.load_state_dict(state)
    for kl in (3.0, 7.5, 12.0):
        assert restored.update(kl, 64) == controller.update(kl, 64)
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10)


def test_running_normalizer_matches_full_statistics_and_resumes():
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(n, generator=g) * 3 + 2 for n in (1, 7, 32, 5)]
    normalizer = RunningRewardNormalizer()
    for batch in batches[:2]:
        normalizer.update(batch)
    state = json.loads(json.dumps(normalizer.state_dict()))
    resumed = RunningRewardNormalizer()
    resumed.load_state_dict(state)
    for batch in batches[2:]:
        normalizer.update(batch)
        resumed.update(batch)

    everything = torch.cat(batches).double()
    mean, std = everything.mean().item(), everything.std(unbiased=False).item()
    for n in (normalizer, resumed):
        assert n.count == everything.numel()
        assert n.mean == pytest.approx(mean, rel=1e-12)
        assert n.std == pytest.approx(std, rel=1e-12)
    x = torch.tensor([mean + std, mean - 2 * std])
    torch.testing.assert_close(resumed.normalize(x), torch.tensor([1.0, -2.0]))


def test_running_normalizer_clip_and_uncentred():
    normalizer = RunningRewardNormalizer(clip=1.5)
    normalizer.update(torch.tensor([0.0, 2.0]))  # mean 1, std 1
    torch.testing.assert_close(normalizer.normalize(torch.tensor([1.0, 5.0, -9.0])),
                               torch.tensor([0.0, 1.5, -1.5]))
    uncentred = RunningRewardNormalizer(center=False)
    uncentred.update(torch.tensor([0.0, 4.0]))  # std 2
    torch.testing.assert_close(uncentred.normalize(torch.tensor([3.0])), torch.tensor([1.5]))
    single = RunningRewardNormalizer()
    single.update(torch.tensor([3.0]))
    assert math.isfinite(single.normalize(torch.tensor([10.0])).item())
