"""What each role computes on its own ranks during a PPO-family step.

The controller moves shards in and results out (``hpc_rlhf.dist.channel``); these functions only see
their shard. The loss math comes from ``hpc_rlhf.algos``; the optimizer from the training-engine facade.

Every training shard carries ``num_tokens`` / ``num_seqs``: per mini-batch, the global count of action
tokens / rows over all data-parallel ranks, computed once by the controller. With them the summed
micro-batch losses equal the full mini-batch mean however the batch is split (``aggregate_loss``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from hpc_rlhf.algos import (
    aggregate_loss,
    entropy_from_logits,
    kl_estimate,
    policy_loss,
    rollout_importance_weights,
    total_loss,
    value_loss,
)
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.trainers.experience import action_logits, action_logprobs, action_values, trim_padding


def _micro_slices(rows: int, micro: int) -> list[slice]:
    return [slice(i, min(i + micro, rows)) for i in range(0, rows, micro)]


@torch.no_grad()
def forward_logprobs(model: Any, shard: dict[str, torch.Tensor], micro: int, temperature: float) -> torch.Tensor:
    """Log-probs of the shard's response tokens, micro-batch by micro-batch: (B, R) fp32."""
    num_actions = shard["action_mask"].shape[1]
    outs = [action_logprobs(model, shard["sequences"][s], shard["attention_mask"][s], num_actions, temperature)
            for s in _micro_slices(shard["sequences"].shape[0], micro)]
    return torch.cat(outs).float()


@torch.no_grad()
def forward_values(model: Any, shard: dict[str, torch.Tensor], micro: int) -> torch.Tensor:
    num_actions = shard["action_mask"].shape[1]
    outs = [action_values(model, shard["sequences"][s], shard["attention_mask"][s], num_actions)
            for s in _micro_slices(shard["sequences"].shape[0], micro)]
    return torch.cat(outs).float()


def _minibatches(shard: dict[str, Any], rows_per_minibatch: int) -> list[tuple[int, slice]]:
    rows = shard["sequences"].shape[0]
    return [(i, slice(i * rows_per_minibatch, (i + 1) * rows_per_minibatch))
            for i in range(rows // rows_per_minibatch)]


def _mean_stats(stats: dict[str, list[float]]) -> dict[str, float]:
    return {k: sum(v) / len(v) for k, v in stats.items() if v}


def _micro_rows(shard: dict[str, Any], rows: slice) -> dict[str, torch.Tensor]:
    """The shard's per-sample tensors for ``rows``, without the columns that are padding in all of them."""
    num_rows = shard["sequences"].shape[0]
    picked = {k: v[rows] for k, v in shard.items() if isinstance(v, torch.Tensor) and v.dim() == 2
              and v.shape[0] == num_rows}
    return trim_padding(picked)


def _shares_to_losses(stats: dict[str, float], num_micro: int) -> dict[str, float]:
    """``x_share`` (mean micro-batch share) -> ``x``: this rank's sum of shares per mini-batch.

    Averaging that over the data-parallel ranks (as the controller does for every stat) gives the
    exact mini-batch mean loss.
    """
    return {(k[: -len("_share")] if k.endswith("_share") else k): (v * num_micro if k.endswith("_share") else v)
            for k, v in stats.items()}


def train_actor(engine: Any, shard: dict[str, Any], cfg: RunConfig, dp_size: int) -> dict[str, float]:
    """PPO-family actor update on this rank's shard; returns mean stats over its micro-batches.

    Shard tensors: ``sequences`` / ``attention_mask`` (B, P+R); ``action_mask``, ``advantages``,
    ``rollout_logprobs`` and optionally ``old_logprobs`` / ``ref_logprobs`` (B, R).
    ``old_logprobs`` is absent when the update is exactly on-policy (one epoch, one optimizer step per
    rollout), in which case the current logprobs (detached) are the old ones.
    """
    algo, temperature = cfg.algo, cfg.rollout.temperature
    rows_per_mb = cfg.train.train_batch_size // dp_size
    micro = cfg.train.micro_train_batch_size
    stats: dict[str, list[float]] = defaultdict(list)
    engine.train()
    for _epoch in range(cfg.train.max_epochs):
        for mb_index, mb in _minibatches(shard, rows_per_mb):
            micro_slices = _micro_slices(rows_per_mb, micro)
            for s in micro_slices:
                rows = _micro_rows(shard, slice(mb.start + s.start, mb.start + s.stop))
                mask, num_actions = rows["action_mask"], rows["action_mask"].shape[1]
                logits = action_logits(engine, rows["sequences"], rows["attention_mask"], num_actions)
                logprobs = logprobs_from_logits(logits, rows["sequences"][:, -num_actions:], temperature)
                old = rows["old_logprobs"] if "old_logprobs" in rows else logprobs.detach()
                is_weights = None
                if algo.is_correction != "none":
                    low, high = algo.is_truncation
                    is_weights, is_stats = rollout_importance_weights(
                        old, rows["rollout_logprobs"], mask, algo.is_correction, low, high)
                    for k, v in is_stats.items():
                        stats[f"is/{k}"].append(float(v))
                pg, pg_stats = policy_loss(
                    logprobs, old, rows["advantages"], mask, loss_type=algo.policy_loss_type,
                    clip_eps_low=algo.eps_clip_low, clip_eps_high=algo.eps_clip_high,
                    dual_clip=algo.dual_clip, importance_weights=is_weights)
                counts = {"global_num_tokens": shard["num_tokens"][mb_index],
                          "global_num_seqs": shard["num_seqs"][mb_index], "dp_size": dp_size,
                          "max_tokens": cfg.rollout.generate_max_len}
                pg_loss = aggregate_loss(pg, mask, algo.loss_agg_mode, **counts)
                kl_loss = None
                if algo.kl.use_loss and "ref_logprobs" in rows:
                    kl = kl_estimate(logprobs, rows["ref_logprobs"], mask, algo.kl.estimator)
                    kl_loss = aggregate_loss(kl, mask, algo.loss_agg_mode, **counts)
                    stats["kl_loss_share"].append(float(kl_loss.detach()))
                entropy = None
                if algo.entropy_loss_coef > 0:
                    entropy = aggregate_loss(entropy_from_logits(logits, mask), mask, algo.loss_agg_mode, **counts)
                loss = total_loss(pg_loss, kl_loss=kl_loss, kl_coef=shard["kl_coef"], entropy=entropy,
                                  entropy_coef=algo.entropy_loss_coef, num_micro_batches=len(micro_slices))
                engine.backward(loss)
                step_info = engine.step()
                # A micro-batch loss is a share of the mini-batch loss; summing shares gives the mean.
                stats["policy_loss_share"].append(float(pg_loss.detach()))
                for k, v in pg_stats.items():
                    stats[k].append(float(v))
            if step_info.get("grad_norm") is not None:
                stats["actor_grad_norm"].append(float(step_info["grad_norm"]))
            stats["actor_lr"].append(float(step_info["lr"]))
    return _shares_to_losses(_mean_stats(stats), len(_micro_slices(rows_per_mb, micro)))


def train_critic(engine: Any, shard: dict[str, Any], cfg: RunConfig, dp_size: int) -> dict[str, float]:
    """Clipped value regression towards ``returns`` (GAE targets) on this rank's shard."""
    rows_per_mb = cfg.train.train_batch_size // dp_size
    micro = cfg.train.micro_train_batch_size
    stats: dict[str, list[float]] = defaultdict(list)
    engine.train()
    for _epoch in range(cfg.train.max_epochs):
        for mb_index, mb in _minibatches(shard, rows_per_mb):
            for s in _micro_slices(rows_per_mb, micro):
                rows = _micro_rows(shard, slice(mb.start + s.start, mb.start + s.stop))
                mask = rows["action_mask"]
                values = action_values(engine, rows["sequences"], rows["attention_mask"], mask.shape[1])
                per_token, v_stats = value_loss(values, rows["values"], rows["returns"], mask, cfg.algo.value_clip)
                loss = aggregate_loss(per_token, mask, "token_mean", global_num_tokens=shard["num_tokens"][mb_index],
                                      dp_size=dp_size)
                engine.backward(loss)
                step_info = engine.step()
                stats["critic_loss_share"].append(float(loss.detach()))
                for k, v in v_stats.items():
                    stats[f"critic/{k}"].append(float(v))
            if step_info.get("grad_norm") is not None:
                stats["critic_grad_norm"].append(float(step_info["grad_norm"]))
    return _shares_to_losses(_mean_stats(stats), len(_micro_slices(rows_per_mb, micro)))
