"""What the controller computes between phases: rewards, sample selection, advantages, counts, metrics.

No process groups and no controller object here: each function takes what it reads and returns what it
computes; the state that outlives a step (reward normaliser, KL controller) stays on ``ControllerState``
in ``setup``, whose caller passes in the values it needs. They see the whole step batch on rank 0.
"""

from __future__ import annotations

from typing import Any

import torch

from hpc_rlhf.rewards.scoring import score_trajectories
from hpc_rlhf.algos import (
    compute_advantages,
    count_tokens_and_seqs,
    dynamic_filter_mask,
    episode_index_from_branches,
    episode_means,
    expand_to_rows,
    kl_estimate,
    masked_mean,
    overlong_penalty,
)
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.trainers.rl.batching import episode_minibatch_layout
from hpc_rlhf.trainers.rl.experience import take_rows
from hpc_rlhf.trainers.rl.rollout_health import extra_log_metrics


def attach_rewards(trajectories: list, reward_fn: Any, tokenizer: Any, model_scores: dict | None) -> list:
    """Set ``reward`` / ``score`` on every trajectory (and return them) from the reward-model role's
    ``model_scores`` when there is one, else from ``reward_fn`` (a reward function or remote server; ``None``
    when the agent's environment set the rewards)."""
    if model_scores is not None:
        for t, s in zip(trajectories, model_scores["scores"].tolist(), strict=True):
            t.reward = t.score = float(s)
        return trajectories
    score_trajectories(trajectories, reward_fn, tokenizer)
    return trajectories


def episode_index_of(trajectories: list) -> torch.Tensor:
    """(B,) episode of each row: an agent episode that branched has several consecutive rows, the first with
    ``branch_index`` 0 (``hpc_rlhf.algos.episodes``); otherwise row ``i`` is episode ``i``."""
    return episode_index_from_branches(torch.tensor([t.branch_index for t in trajectories], dtype=torch.long))


def _episode_filter(trajectories: list, cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO's dynamic filter over episodes: ``(keep (E,) bool, episode_index (B,))``. An episode's score is
    the mean of its rows' (they share the agent's reward)."""
    index = episode_index_of(trajectories)
    scores = torch.tensor([t.score if t.score is not None else t.reward for t in trajectories])
    low, high = cfg.algo.dynamic_filtering_reward_range
    return dynamic_filter_mask(episode_means(scores, index), cfg.rollout.n_samples_per_prompt, low, high), index


def kept_by_dynamic_filtering(trajectories: list, cfg: RunConfig) -> int:
    """Episodes that DAPO's dynamic filtering would keep (whole groups whose scores are not all alike)."""
    if not trajectories:
        return 0
    return int(_episode_filter(trajectories, cfg)[0].sum())


def append_groups(trajectories: list, more: list) -> list:
    """``trajectories`` then ``more`` (a refill round), with ``more``'s group indices continuing the numbering."""
    offset = max((t.group_index for t in trajectories), default=-1) + 1
    for t in more:
        t.group_index += offset
    return trajectories + more


def select_samples(trajectories: list, cfg: RunConfig) -> list:
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
    index = episode_index_of(trajectories).tolist()
    usable = min(index[-1] + 1, cfg.rollout.rollout_batch_size * n)
    usable -= usable % cfg.train.train_batch_size
    return [t for t, episode in zip(trajectories, index, strict=True) if episode < usable]


def make_advantages(batch: dict[str, torch.Tensor], cfg: RunConfig, rewards: torch.Tensor,
                    kl_coef: float) -> dict[str, torch.Tensor]:
    """Advantages and returns for the whole step batch (whitening and group baselines are global).

    ``batch["episode_index"]`` (B,): each row's episode (group statistics are per episode, see
    ``hpc_rlhf.algos.episodes``). ``rewards`` (B,): the sequence rewards after any running normalisation
    (``algo.normalize_reward``); ``kl_coef``: the KL controller's current coefficient, used when the KL is folded
    into the reward.
    Returns ``advantages`` / ``returns`` (B, R) and, with a reference model and old log-probs, the per-token
    ``kl`` (B, R). (On-policy with a fixed-coefficient KL loss there are no old log-probs: the actor measures
    the KL in its loss.)
    """
    algo = cfg.algo
    mask = batch["action_mask"]
    out: dict[str, torch.Tensor] = {}
    folded_kl = None
    if "ref_logprobs" in batch and "old_logprobs" in batch:
        kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], mask, algo.kl.estimator)
        out["kl"] = kl
        if not algo.kl.use_loss:
            folded_kl = kl
    advantages, returns = compute_advantages(
        algo.advantage_estimator, rewards, mask, cfg.rollout.n_samples_per_prompt,
        episode_index=batch["episode_index"],
        values=batch.get("values"), kl=folded_kl, kl_coef=kl_coef if folded_kl is not None else 0.0,
        gamma=algo.gamma, lambd=algo.lambd, reward_clip_range=algo.reward_clip_range,
        norm_adv_by_std=not algo.no_advantage_std_norm,
    )
    out["advantages"], out["returns"] = advantages, returns
    return out


def episode_layout(view: dict[str, torch.Tensor], episode_index: torch.Tensor, train_batch_size: int,
                   dp_size: int) -> tuple[dict[str, torch.Tensor], int, bool]:
    """The training view laid out as whole episodes per mini-batch (``batching.episode_minibatch_layout``):
    ``train_batch_size`` episodes per optimizer step, padded with copies of their own rows whose action mask is
    cleared. Returns ``(view, rows per rank per mini-batch, regrouped)``. Unchanged (``regrouped`` False) with
    one row per episode; else mini-batch ``k`` is the ``k``-th contiguous chunk of ``dp_size x M`` rows, which
    the caller deals to the ranks (``batching.balanced_order``) before ``split_rows``."""
    order, is_padding, rows_per_rank = episode_minibatch_layout(episode_index.tolist(), train_batch_size, dp_size)
    if order == list(range(episode_index.shape[0])):
        return view, rows_per_rank, False
    view = take_rows(view, order)
    view["action_mask"] = view["action_mask"] & ~torch.tensor(is_padding).unsqueeze(1)
    return view, rows_per_rank, True


def minibatch_counts(action_mask: torch.Tensor, dp_size: int, rows_per_minibatch: int) -> dict[str, list[int]]:
    """Global action-token and row counts of each mini-batch.

    The batch is cut into ``dp_size`` contiguous shards; mini-batch ``i`` is rows
    ``[i*m, (i+1)*m)`` of every shard. These counts normalise the loss exactly (``aggregate_loss``).
    """
    rows = action_mask.shape[0]
    shard = rows // dp_size
    num_tokens, num_seqs = [], []
    for i in range(shard // rows_per_minibatch):
        picked = torch.cat([action_mask[d * shard + i * rows_per_minibatch : d * shard + (i + 1) * rows_per_minibatch]
                            for d in range(dp_size)])
        tokens, seqs = count_tokens_and_seqs(picked)
        num_tokens.append(int(tokens))
        num_seqs.append(int(seqs))
    return {"num_tokens": num_tokens, "num_seqs": num_seqs}


def rollout_metrics(trajectories: list, batch: dict | None, generation_s: float) -> dict[str, float]:
    """Reward, length and throughput of the step's rollouts (before filtering for the reward mean), and the
    episode means of their ``extra_logs`` (``agent/...``, ``extra/...``). ``reward`` / ``score`` are means over
    episodes (an episode's rows averaged first); lengths and truncation are over rows (trained sequences)."""
    lengths = [len(t.response_ids) for t in trajectories]
    generated = sum(sum(t.action_mask) for t in trajectories)
    index = episode_index_of(trajectories)
    rewards = episode_means(torch.tensor([float(t.reward) for t in trajectories]), index)
    scores = episode_means(torch.tensor([float(t.score if t.score is not None else t.reward) for t in trajectories]),
                           index)
    row: dict[str, float] = {
        "reward": float(rewards.mean()),
        "score": float(scores.mean()),
        "response_length": sum(lengths) / len(lengths),
        "truncated_fraction": sum(t.truncated for t in trajectories) / len(trajectories),
        "rollout_tokens_per_s": generated / max(generation_s, 1e-9),
        "num_samples": float(len(trajectories)),
        "num_episodes": float(rewards.shape[0]),
        "num_trained_samples": float(0 if batch is None else batch["sequences"].shape[0]),
    }
    if batch is not None and "kl" in batch:
        row["kl"] = float(masked_mean(batch["kl"], batch["action_mask"]))
    row.update(extra_log_metrics(trajectories))
    return row
