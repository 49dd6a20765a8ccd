"""What the controller computes between phases: rewards, sample selection, advantages, metrics.

No process groups and no controller object here: each function takes what it reads and returns what it
computes; the state that outlives a step (reward normaliser, KL controller) stays on ``ControllerState``
in ``setup``, whose caller passes in the values it needs. They see the trajectories, or the whole step batch
(``StepBatch``), on rank 0. Where the batch's rows go next is ``row_layout``'s business.

Runs on rank 0 only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch

from hpc_rlhf.agents.executor import UNKNOWN_SOURCE
from hpc_rlhf.algos import (
    compute_advantages,
    distill_advantages,
    dynamic_filter_mask,
    episode_means,
    expand_to_rows,
    kl_estimate,
    masked_mean,
    overlong_penalty,
    reverse_kl_metrics,
)
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.rewards.scoring import score_trajectories
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.rollout.placeholder_tokens import PLACEHOLDER_FINISH
from hpc_rlhf.trainers.rl.rollout_health import extra_log_metrics, first_rows
from hpc_rlhf.trainers.rl.step_batch import StepBatch, episode_index_of


def attach_rewards(trajectories: list[Trajectory], reward_fn: Any, tokenizer: Tokenizer,
                   model_scores: torch.Tensor | None) -> list[Trajectory]:
    """Set ``reward`` / ``score`` on every trajectory (and return them) from the reward-model role's
    ``model_scores`` (B,) when there is one, else from ``reward_fn`` (a reward function or remote server;
    ``None`` when the agent's environment set the rewards)."""
    if model_scores is not None:
        for t, s in zip(trajectories, model_scores.tolist(), strict=True):
            t.reward = t.score = float(s)
        return trajectories
    score_trajectories(trajectories, reward_fn, tokenizer)
    return trajectories


def _episode_filter(trajectories: list[Trajectory], cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO's dynamic filter over episodes: ``(keep (E,) bool, episode_index (B,))``. An episode's score is
    the mean of its rows' (they share the agent's reward)."""
    index = episode_index_of(trajectories)
    scores = torch.tensor([t.score if t.score is not None else t.reward for t in trajectories])
    low, high = cfg.algo.dynamic_filtering_reward_range
    return dynamic_filter_mask(episode_means(scores, index), cfg.rollout.n_samples_per_prompt, low, high), index


def kept_by_dynamic_filtering(trajectories: list[Trajectory], cfg: RunConfig) -> int:
    """Episodes that DAPO's dynamic filtering would keep (whole groups whose scores are not all alike)."""
    if not trajectories:
        return 0
    return int(_episode_filter(trajectories, cfg)[0].sum())


def append_groups(trajectories: list[Trajectory], more: list[Trajectory]) -> list[Trajectory]:
    """``trajectories`` then ``more`` (a refill round), with ``more``'s group indices continuing the numbering."""
    offset = max((t.group_index for t in trajectories), default=-1) + 1
    for t in more:
        t.group_index += offset
    return trajectories + more


def select_samples(trajectories: list[Trajectory], cfg: RunConfig) -> list[Trajectory]:
    """Overlong penalty, DAPO dynamic filtering, then trim to whole training batches; returns the kept
    trajectories (the overlong penalty is added to their ``reward`` and logged in ``extra_logs``).

    Filtering drops whole prompt groups; the remainder is cut to at most one step's episodes
    (``rollout.rollout_batch_size`` x ``n_samples_per_prompt``; refill rounds may have generated more) and
    to a multiple of ``train.train_batch_size`` episodes (whole groups first) so every optimizer step sees a
    full batch. An episode is one row, or all the rows of a branching agent episode (kept or cut together).
    """
    algo, n = cfg.algo, cfg.rollout.n_samples_per_prompt
    if algo.overlong_buffer_len is not None:
        lengths = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.float32)
        penalty = overlong_penalty(lengths, cfg.rollout.generate_max_len, algo.overlong_buffer_len,
                                   algo.overlong_penalty_factor)
        for t, p in zip(trajectories, penalty.tolist(), strict=True):
            t.extra_logs["overlong_penalty"] = p
            t.reward += p
    if algo.dynamic_filtering and trajectories:
        keep, index = _episode_filter(trajectories, cfg)
        trajectories = [t for t, k in zip(trajectories, expand_to_rows(keep, index).tolist(), strict=True) if k]
    if not trajectories:
        return []
    episodes: list[int] = episode_index_of(trajectories).tolist()
    usable = min(episodes[-1] + 1, cfg.rollout.rollout_batch_size * n)
    usable -= usable % cfg.train.train_batch_size
    return [t for t, episode in zip(trajectories, episodes, strict=True) if episode < usable]


def make_advantages(batch: StepBatch, cfg: RunConfig, rewards: torch.Tensor, kl_coef: float) -> StepBatch:
    """The step batch with advantages and returns (whitening and group baselines are global).

    ``batch.episode_index`` (B,): each row's episode (group statistics are per episode, see
    ``hpc_rlhf.algos.episodes``). ``rewards`` (B,): the sequence rewards after any running normalisation
    (``algo.normalize_reward``); ``kl_coef``: the KL controller's current coefficient, used when the KL is folded
    into the reward.
    Sets ``advantages`` / ``returns`` (B, R) and, with a reference model and old log-probs, the per-token
    ``kl`` (B, R). (On-policy with a fixed-coefficient KL loss there are no old log-probs: the actor measures
    the KL in its loss.) With a distillation teacher (``batch.teacher_logprobs``) the per-token distillation
    advantage (``hpc_rlhf.algos.distillation``) is the advantage (``algo.advantage_estimator=distill``) or is
    added to the estimator's; the returns (the critic's targets) stay the task reward's.
    """
    algo = cfg.algo
    mask = batch.action_mask
    kl = folded_kl = None
    if batch.ref_logprobs is not None and batch.old_logprobs is not None:
        kl = kl_estimate(batch.old_logprobs, batch.ref_logprobs, mask, algo.kl.estimator)
        if not algo.kl.use_loss:
            folded_kl = kl
    distill = None
    if batch.teacher_logprobs is not None:
        distill = distill_advantages(batch.teacher_logprobs, batch.student_logprobs, mask, algo.distill_coef)
    if algo.advantage_estimator == "distill":
        if distill is None:
            raise ValueError("algo.advantage_estimator=distill but the step batch has no teacher log-probs")
        return replace(batch, kl=kl, advantages=distill, returns=distill)
    advantages, returns = compute_advantages(
        algo.advantage_estimator, rewards, mask, cfg.rollout.n_samples_per_prompt,
        episode_index=batch.episode_index,
        values=batch.values, kl=folded_kl, kl_coef=kl_coef if folded_kl is not None else 0.0,
        gamma=algo.gamma, lambd=algo.lambd, reward_clip_range=algo.reward_clip_range,
        norm_adv_by_std=not algo.no_advantage_std_norm,
    )
    if distill is not None:
        advantages = advantages + distill
    return replace(batch, kl=kl, advantages=advantages, returns=returns)


def distillation_metrics(batch: StepBatch | None) -> dict[str, float]:
    """``distill/reverse_kl`` and ``distill/teacher_logprob`` of the step's trained rows (with a teacher)."""
    if batch is None or batch.teacher_logprobs is None:
        return {}
    stats = reverse_kl_metrics(batch.teacher_logprobs, batch.student_logprobs, batch.action_mask)
    return {f"distill/{k}": v for k, v in stats.items()}


# Finish reasons of a row whose generation stopped at a length limit: the engine's token cap of the request
# ("length": ``rollout.generate_max_len``, or what is left of ``data.max_len`` for a multi-turn turn) or a
# multi-turn episode's whole ``data.max_len`` budget ("max_len", ``hpc_rlhf.agents.multi_turn``).
LENGTH_FINISH_REASONS = ("length", "max_len")


def response_length_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """``response_length`` (mean), ``/max``, ``/min`` of the rows' response tokens (generated plus agent feedback),
    ``response_length/clip_fraction``: the fraction of rows whose ``finish_reason`` is in
    :data:`LENGTH_FINISH_REASONS` (a multi-turn episode ended by ``max_turns`` does not count), and
    ``truncated_fraction``: the rows flagged ``truncated`` by their executor (length or, multi-turn, ``max_turns``)."""
    lengths = [len(t.response_ids) for t in trajectories]
    return {
        "response_length": sum(lengths) / len(lengths),
        "response_length/max": float(max(lengths)),
        "response_length/min": float(min(lengths)),
        "response_length/clip_fraction": sum(t.finish_reason in LENGTH_FINISH_REASONS for t in trajectories)
        / len(trajectories),
        "truncated_fraction": sum(t.truncated for t in trajectories) / len(trajectories),
    }


def reward_by_source(trajectories: list[Trajectory], episode_rewards: torch.Tensor) -> dict[str, float]:
    """``reward/<source>``: the mean reward of each data source's episodes.

    Args:
        trajectories: the step's rows; an episode's source is that of its first row (``branch_index`` 0).
        episode_rewards: (E,) the reward of each episode, in episode order.
    The source is ``Trajectory.data_source`` (the name evaluation uses, ``hpc_rlhf.data.prompts.source_name``),
    or ``UNKNOWN_SOURCE`` ("unknown") for a trajectory whose executor did not set it.
    """
    sources = [t.data_source or UNKNOWN_SOURCE for t in first_rows(trajectories)]
    if len(sources) != episode_rewards.shape[0]:
        raise ValueError(f"{len(sources)} episodes but {episode_rewards.shape[0]} episode rewards")
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for source, reward in zip(sources, episode_rewards.tolist(), strict=True):
        sums[source] += reward
        counts[source] += 1
    return {f"reward/{source}": sums[source] / counts[source] for source in sorted(sums)}


def _reward(trajectory: Trajectory) -> float:
    if trajectory.reward is None:
        raise ValueError(f"a trajectory of group {trajectory.group_index} has no reward: the step's reward source "
                         "scored none")
    return float(trajectory.reward)


def rollout_metrics(trajectories: list[Trajectory], batch: StepBatch | None, generation_s: float) -> dict[str, float]:
    """Reward, length and throughput of the step's rollouts (before filtering for the reward mean), and the
    episode means of their ``extra_logs`` (``agent/...``, ``extra/...``). ``reward`` / ``score`` and
    ``reward/<source>`` (:func:`reward_by_source`) are means over episodes (an episode's rows averaged first);
    lengths, clipping and truncation (:func:`response_length_metrics`) are over rows (trained sequences). With a
    distillation teacher, :func:`distillation_metrics` of the trained rows."""
    generated = sum(sum(t.action_mask) for t in trajectories)
    index = episode_index_of(trajectories)
    rewards = episode_means(torch.tensor([_reward(t) for t in trajectories]), index)
    scores = episode_means(torch.tensor([_reward(t) if t.score is None else t.score for t in trajectories]), index)
    row: dict[str, float] = {
        "reward": float(rewards.mean()),
        "score": float(scores.mean()),
        **response_length_metrics(trajectories),
        "rollout_tokens_per_s": generated / max(generation_s, 1e-9),
        "num_samples": float(len(trajectories)),
        "num_episodes": float(rewards.shape[0]),
        "num_trained_samples": float(0 if batch is None else batch.num_rows),
        # rows the engine cut at a vision placeholder it sampled; each failed alone (rollout.placeholder_tokens)
        "placeholder_fraction": sum(t.finish_reason == PLACEHOLDER_FINISH for t in trajectories)
        / max(len(trajectories), 1),
    }
    if batch is not None and batch.kl is not None:
        row["kl"] = float(masked_mean(batch.kl, batch.action_mask))
    row.update(distillation_metrics(batch))
    row.update(reward_by_source(trajectories, rewards))
    row.update(extra_log_metrics(trajectories))
    return row
