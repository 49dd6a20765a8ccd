"""Per-step rollout metrics on hand-built trajectories: response lengths, clipping, reward per data source."""

import pytest

from hpc_rlhf.agents.executor import UNKNOWN_SOURCE
from hpc_rlhf.data.prompts import Prompt, source_name
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.controller_steps import LENGTH_FINISH_REASONS, rollout_metrics


def _row(source, reward, length, finish="stop", branch=0, group=0, truncated=None):
    return Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[2] * length, action_mask=[1] * length,
                      rollout_logprobs=[0.0] * length, reward=reward, score=reward, group_index=group,
                      finish_reason=finish, truncated=finish in LENGTH_FINISH_REASONS if truncated is None else truncated,
                      branch_index=branch, data_source=source)


def _two_sources():
    """math: three episodes, rewards 1, 0, 0.5 (mean 0.5); code: two, rewards 2, 0 (mean 1). Lengths 3, 8, 5, 1, 7."""
    return [
        _row("math", 1.0, 3, "stop"),
        _row("math", 0.0, 8, "length"),
        _row("math", 0.5, 5, "stop", group=1),
        _row("code", 2.0, 1, "max_len", group=2),
        _row("code", 0.0, 7, "max_turns", group=2, truncated=True),  # a turn limit: truncated, not clipped
    ]


def test_length_metrics_by_hand():
    metrics = rollout_metrics(_two_sources(), None, 1.0)
    assert metrics["response_length"] == pytest.approx((3 + 8 + 5 + 1 + 7) / 5)
    assert metrics["response_length/max"] == 8.0
    assert metrics["response_length/min"] == 1.0
    assert metrics["response_length/clip_fraction"] == pytest.approx(2 / 5)  # "length" and "max_len"
    assert metrics["truncated_fraction"] == pytest.approx(3 / 5)  # ... plus the max_turns episode


def test_reward_per_source_by_hand():
    metrics = rollout_metrics(_two_sources(), None, 1.0)
    assert metrics["reward/math"] == pytest.approx(0.5)  # (1 + 0 + 0.5) / 3
    assert metrics["reward/code"] == pytest.approx(1.0)  # (2 + 0) / 2
    assert metrics["reward"] == pytest.approx(3.5 / 5)  # over all episodes, not the mean of the source means
    assert sorted(k for k in metrics if k.startswith("reward/")) == ["reward/code", "reward/math"]


def test_one_source_reward_equals_the_overall_reward():
    rows = [_row("gsm8k", r, 2, group=g) for g, r in enumerate([0.0, 1.0, 1.0, 0.25])]
    metrics = rollout_metrics(rows, None, 1.0)
    assert metrics["reward/gsm8k"] == metrics["reward"] == pytest.approx(0.5625)


def test_reward_per_source_counts_episodes_not_rows():
    # A math episode that branched into 3 rows (reward 1 each) and a one-row math episode with reward 0:
    # 0.5 per episode, not 0.75 per row; the rows' lengths all count.
    rows = [_row("math", 1.0, 2, branch=b) for b in range(3)] + [_row("math", 0.0, 4, group=1),
                                                                  _row("code", 3.0, 6, group=2)]
    metrics = rollout_metrics(rows, None, 1.0)
    assert metrics["reward/math"] == pytest.approx(0.5)
    assert metrics["reward/code"] == pytest.approx(3.0)
    assert metrics["num_episodes"] == 3 and metrics["response_length/max"] == 6.0


def test_a_trajectory_without_a_source_is_reported_as_unknown():
    rows = [_row(None, 1.0, 2), _row("math", 0.0, 2, group=1)]
    metrics = rollout_metrics(rows, None, 1.0)
    assert metrics[f"reward/{UNKNOWN_SOURCE}"] == 1.0 and metrics["reward/math"] == 0.0
    assert Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[2], action_mask=[1],
                      rollout_logprobs=[0.0]).data_source is None  # executors written before the field still work


def test_source_name_is_the_data_source_column_else_the_file_stem():
    assert source_name(Prompt("q", None, "/data/math_train.jsonl", 0)) == "math_train"
    assert source_name(Prompt("q", None, "/data/mix.parquet", 3, data_source="gsm8k")) == "gsm8k"
