"""Episodes with several training rows (branching agents): group math per episode, layout, selection, metrics."""

from __future__ import annotations

import pytest
import torch

from hpc_rlhf.algos import (
    compute_advantages,
    episode_index_from_branches,
    episode_means,
    expand_to_rows,
)
from hpc_rlhf.config import load_config
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.controller_steps import kept_by_dynamic_filtering, rollout_metrics, select_samples
from hpc_rlhf.trainers.rl.row_layout import (
    balanced_order,
    episode_layout,
    episode_minibatch_layout,
    minibatch_counts,
)
from hpc_rlhf.trainers.rl.step_batch import StepBatch

# 2 prompts x 3 episodes; the episodes branched into 1, 3, 2 and 2, 1, 1 rows.
ROWS_PER_EPISODE = [1, 3, 2, 2, 1, 1]
EPISODE_REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.25])


def _episode_index():
    return torch.repeat_interleave(torch.arange(len(ROWS_PER_EPISODE)), torch.tensor(ROWS_PER_EPISODE))


def test_episode_index_means_and_expansion():
    branches = torch.tensor([b for rows in ROWS_PER_EPISODE for b in range(rows)])
    index = episode_index_from_branches(branches)
    assert index.tolist() == _episode_index().tolist()
    row_values = torch.tensor([1.0, 0.0, 2.0, 4.0, 3.0, 5.0, 1.0, 1.0, 7.0, 9.0])
    assert episode_means(row_values, index).tolist() == [1.0, 2.0, 4.0, 1.0, 7.0, 9.0]
    assert expand_to_rows(EPISODE_REWARDS, index).tolist() == [
        r for r, k in zip(EPISODE_REWARDS.tolist(), ROWS_PER_EPISODE, strict=True) for _ in range(k)]
    with pytest.raises(ValueError, match=r"skips episodes \[1\]"):
        episode_means(torch.ones(2), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="first row must start an episode"):
        episode_index_from_branches(torch.tensor([1, 0]))


def _reference_group_advantages(estimator: str, rewards: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """Each estimator's textbook formula over the n episodes of each prompt, written out here independently."""
    out = []
    for group in rewards.view(-1, n).tolist():
        mean = sum(group) / n
        std = (sum((r - mean) ** 2 for r in group) / (n - 1)) ** 0.5
        for r in group:
            if estimator == "group_norm":
                out.append((r - mean) / (std + eps))
            elif estimator == "rloo":
                out.append(r - (sum(group) - r) / (n - 1))
            else:  # dr_grpo
                out.append(r - mean)
    return torch.tensor(out)


@pytest.mark.parametrize("estimator", ["group_norm", "rloo", "dr_grpo"])
def test_group_estimators_normalise_over_episodes_with_uneven_branch_counts(estimator):
    index = _episode_index()
    num_rows = index.shape[0]
    mask = torch.zeros(num_rows, 6, dtype=torch.bool)
    for row in range(num_rows):
        mask[row, : 2 + row % 4] = True  # rows of different lengths
    row_rewards = EPISODE_REWARDS[index]
    advantages, _ = compute_advantages(estimator, row_rewards, mask, 3, episode_index=index)
    expected = _reference_group_advantages(estimator, EPISODE_REWARDS, 3)[index]
    # Every action token of a row carries its episode's group advantage; every other position is 0.
    assert torch.allclose(advantages, expected.unsqueeze(1) * mask, atol=1e-5)
    # Treating the rows as the group's samples would be wrong (and is refused: 10 rows are not groups of 3).
    with pytest.raises(ValueError, match="not a multiple of n_samples_per_prompt"):
        compute_advantages(estimator, row_rewards, mask, 3)


def test_one_row_per_episode_is_unchanged_and_token_estimators_run_per_row():
    torch.manual_seed(0)
    rewards, mask = torch.randn(6), torch.rand(6, 5) > 0.3
    values = torch.randn(6, 5)
    identity = torch.arange(6)
    for estimator in ("gae", "reinforce", "reinforce_baseline", "group_norm"):
        plain = compute_advantages(estimator, rewards, mask, 3, values=values)
        indexed = compute_advantages(estimator, rewards, mask, 3, values=values, episode_index=identity)
        assert all(torch.equal(a, b) for a, b in zip(plain, indexed, strict=True)), estimator
    # GAE over branching rows: each row is a sequence ending with its episode's reward.
    index = _episode_index()
    row_mask = torch.ones(index.shape[0], 3, dtype=torch.bool)
    _, returns = compute_advantages("gae", EPISODE_REWARDS[index], row_mask, 1, values=torch.zeros(index.shape[0], 3),
                                    gamma=1.0, lambd=1.0, episode_index=index, whiten=False)
    assert torch.allclose(returns[:, -1], EPISODE_REWARDS[index])


def test_layout_keeps_whole_episodes_per_minibatch_and_pads_with_their_own_rows():
    episode_of_row = _episode_index().tolist()  # 6 episodes, 10 rows
    order, is_padding, rows_per_rank = episode_minibatch_layout(episode_of_row, episodes_per_minibatch=3, dp_size=2)
    # Mini-batch 0 = episodes 0..2 (6 rows), mini-batch 1 = episodes 3..5 (4 rows): 3 rows per rank each.
    assert rows_per_rank == 3 and len(order) == 12
    for k in range(2):
        block = slice(6 * k, 6 * (k + 1))
        real = [row for row, pad in zip(order[block], is_padding[block], strict=True) if not pad]
        padded = [row for row, pad in zip(order[block], is_padding[block], strict=True) if pad]
        assert sorted(real) == [r for r, e in enumerate(episode_of_row) if e // 3 == k]
        assert set(padded) <= set(real)
    assert sum(is_padding) == 2
    # One row per episode, T a multiple of dp: the identity, no padding.
    order, is_padding, rows_per_rank = episode_minibatch_layout(list(range(8)), 4, 2)
    assert order == list(range(8)) and not any(is_padding) and rows_per_rank == 2
    with pytest.raises(ValueError, match="do not split"):
        episode_minibatch_layout(episode_of_row, 4, 2)


def test_episode_layout_masks_padding_so_the_loss_counts_see_real_rows_only():
    index = _episode_index()
    action_mask = torch.ones(index.shape[0], 4, dtype=torch.bool)
    sequences = torch.arange(index.shape[0]).unsqueeze(1).repeat(1, 6)
    view = StepBatch(sequences=sequences, attention_mask=torch.ones_like(sequences), action_mask=action_mask)
    laid_out, rows_per_rank, regrouped = episode_layout(view, index, 3, 2)
    assert regrouped and rows_per_rank == 3 and laid_out.sequences.shape[0] == 12
    # Deal each contiguous mini-batch to the 2 ranks, as the trainer does, then count as the trainer does.
    laid_out = laid_out.take_rows(balanced_order([1] * 12, 2, rows_per_rank))
    counts = minibatch_counts(laid_out.action_mask, 2, rows_per_rank)
    # Mini-batch 0: the 6 rows of episodes 0..2; mini-batch 1: the 4 rows of episodes 3..5 (+2 masked copies).
    assert counts == {"num_seqs": [6, 4], "num_tokens": [24, 16]}
    shards = laid_out.split_rows(2)
    for k, episodes in enumerate(([0, 1, 2], [3, 4, 5])):
        rows = torch.cat([shard.sequences[3 * k : 3 * (k + 1), 0] for shard in shards])
        assert {int(index[r]) for r in rows} == set(episodes)
    unchanged, _, regrouped = episode_layout(view, torch.arange(index.shape[0]), 10, 2)
    assert unchanged is view and not regrouped


def _row(reward, group, branch=0, logs=None):
    return Trajectory(prompt="p", label=None, prompt_ids=[1], response_ids=[2, 3], action_mask=[1, 1],
                      rollout_logprobs=[0.0, 0.0], reward=reward, score=reward, group_index=group,
                      branch_index=branch, extra_logs=dict(logs or {}))


def _branching_step():
    """2 prompts x 2 episodes; prompt 0's episodes score alike (filtered), prompt 1's differ."""
    rows = []
    for group, episodes in ((0, [(1.0, 3), (1.0, 1)]), (1, [(0.0, 2), (1.0, 1)])):
        for reward, num_rows in episodes:
            rows += [_row(reward, group, b, {"num_branches": float(num_rows), "num_turns": 2.0})
                     for b in range(num_rows)]
    return rows


def test_selection_filtering_and_metrics_count_episodes():
    cfg = load_config(None, ["rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2",
                             "train.train_batch_size=2", "algo.dynamic_filtering=true",
                             "algo.dynamic_filtering_reward_range=[0.01,0.99]"])
    rows = _branching_step()
    assert kept_by_dynamic_filtering(rows, cfg) == 2  # episodes of prompt 1 (3 rows)
    kept = select_samples(rows, cfg)
    assert [(t.group_index, t.branch_index) for t in kept] == [(1, 0), (1, 1), (1, 0)]
    metrics = rollout_metrics(rows, None, 1.0)
    assert metrics["reward"] == pytest.approx(0.75)  # mean over 4 episodes, not over the 7 rows (6/7)
    assert metrics["num_episodes"] == 4 and metrics["num_samples"] == 7
    assert metrics["agent/rows_per_episode"] == pytest.approx(7 / 4)
    assert metrics["agent/num_branches"] == pytest.approx(7 / 4)  # per episode, not per row
    cfg = load_config(None, ["rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=1",
                             "train.train_batch_size=2"])
    assert len(select_samples(_branching_step(), cfg)) == 4  # one step = 2 episodes = prompt 0's 4 rows
