"""What each role computes on its own ranks during a PPO-family step.

The controller moves shards in and results out (``hpc_rlhf.world.channel``); these functions only see
their shard. The loss math comes from ``hpc_rlhf.algos``; the optimizer from the training-engine facade.

Every training shard carries ``num_tokens`` / ``num_seqs``: per mini-batch, the global count of action
tokens / rows over all data-parallel ranks, computed once by the controller. With them the summed
micro-batch losses equal the full mini-batch mean however the batch is split (``aggregate_loss``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf.algos import (
    aggregate_loss,
    kl_estimate,
    policy_loss,
    rollout_importance_weights,
    rollout_mismatch_kl,
    total_loss,
    value_loss,
)
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.models.micro_forward import SequenceParallel, forward_scope
from hpc_rlhf.trainers.rl.batching import plan_micro_batches, split_to_count
from hpc_rlhf.trainers.rl.experience import trim_padding


@dataclass(frozen=True)
class Batching:
    """How one rank cuts its rows into micro-batches: ``micro_size`` rows each, or as many as fit
    ``max_tokens`` (``train.use_dynamic_batch``); ``packed`` forwards one packed row per micro-batch."""

    packed: bool = False
    micro_size: int | None = 1
    max_tokens: int | None = None

    @classmethod
    def for_training(cls, cfg: RunConfig) -> Batching:
        t = cfg.train
        if t.use_dynamic_batch:
            # The budget is per GPU; ring attention spreads one micro-batch over ds.ring_attn_size GPUs.
            return cls(t.packing_samples, None, t.max_tokens_per_gpu * cfg.ds.ring_attn_size)
        return cls(t.packing_samples, t.micro_train_batch_size, None)

    @classmethod
    def for_experience(cls, cfg: RunConfig) -> Batching:
        t, r = cfg.train, cfg.rollout
        if t.use_dynamic_batch:
            return cls(t.packing_samples, None, (r.max_tokens_per_gpu or t.max_tokens_per_gpu) * cfg.ds.ring_attn_size)
        return cls(t.packing_samples, r.micro_rollout_batch_size, None)

    def plan(self, attention_mask: torch.Tensor, dp_group: Any = None) -> list[torch.Tensor]:
        """Row indices (long tensors) of each micro-batch of these (B, T) rows.

        Token-budgeted plans differ between ranks; every rank of ``dp_group`` then splits its plan up to
        the largest count, because ZeRO's collectives run in every forward/backward.
        """
        lengths = attention_mask.sum(dim=1).tolist()
        plan = plan_micro_batches(lengths, micro_size=self.micro_size, max_tokens=self.max_tokens,
                                  packed=self.packed)
        if self.max_tokens is not None and dp_group is not None and dist.get_world_size(dp_group) > 1:
            count = torch.tensor([len(plan)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
            plan = split_to_count(plan, int(count), lengths)
        return [torch.tensor(rows, dtype=torch.long) for rows in plan]


def _micro_rows(shard: dict[str, Any], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """The shard's per-sample tensors at rows ``index``, without the columns that are padding in all of them."""
    num_rows = shard["sequences"].shape[0]
    picked = {k: v[index] for k, v in shard.items() if isinstance(v, torch.Tensor) and v.dim() == 2
              and v.shape[0] == num_rows}
    return trim_padding(picked)


def _per_row_forward(shard: dict[str, torch.Tensor], batching: Batching, dp_group: Any, fn) -> torch.Tensor:
    """Run ``fn(micro_rows) -> (b, r)`` over micro-batches; reassemble (B, R) fp32 in row order."""
    out = torch.zeros(shard["action_mask"].shape, dtype=torch.float32)
    for index in batching.plan(shard["attention_mask"], dp_group):
        rows = _micro_rows(shard, index)
        result = fn(rows).float().cpu()
        out[index, : result.shape[1]] = result
    return out


@torch.no_grad()
def forward_logprobs(model: Any, shard: dict[str, torch.Tensor], batching: Batching, temperature: float,
                     sp: SequenceParallel | None = None) -> torch.Tensor:
    """Log-probs of the shard's response tokens, micro-batch by micro-batch: (B, R) fp32."""
    def logprobs(rows):
        with forward_scope(model, rows, packed=batching.packed, sp=sp) as fwd:
            return fwd.policy_logprobs(temperature)[0]

    return _per_row_forward(shard, batching, getattr(model, "dp_group", None), logprobs)


@torch.no_grad()
def forward_values(model: Any, shard: dict[str, torch.Tensor], batching: Batching,
                   sp: SequenceParallel | None = None) -> torch.Tensor:
    """Critic values before each response token: (B, R) fp32."""
    def values(rows):
        with forward_scope(model, rows, packed=batching.packed, sp=sp) as fwd:
            return fwd.critic_values()

    return _per_row_forward(shard, batching, getattr(model, "dp_group", None), values)


def _minibatches(shard: dict[str, Any], rows_per_minibatch: int) -> list[tuple[int, slice]]:
    rows = shard["sequences"].shape[0]
    return [(i, slice(i * rows_per_minibatch, (i + 1) * rows_per_minibatch))
            for i in range(rows // rows_per_minibatch)]


def _finish_stats(stats: dict[str, list[float]], num_updates: int) -> dict[str, float]:
    """Means of the per-micro-batch stats; ``x_share`` entries become ``x``, their sum per update.

    A micro-batch loss is a share of its mini-batch loss, so the shares of one optimizer step sum to this
    rank's part of the mini-batch mean; averaging that over the data-parallel ranks (as the controller
    does for every stat) gives the exact mini-batch mean loss. Token-budgeted plans vary the number of
    micro-batches per update, hence sums over updates, not a mean times a count.
    """
    out = {}
    for k, v in stats.items():
        if not v:
            continue
        if k.endswith("_share"):
            out[k[: -len("_share")]] = sum(v) / num_updates
        else:
            out[k] = sum(v) / len(v)
    return out


def _updates(shard: dict[str, Any], cfg: RunConfig, dp_size: int, batching: Batching, dp_group: Any):
    """Yield ``(mini-batch index, micro-batch rows, micro-batches in this update, is it the last)`` for every
    epoch and mini-batch. ``shard["rows_per_minibatch"]``: this rank's rows of one mini-batch (the controller's
    layout: ``train.train_batch_size`` episodes per mini-batch, ``controller_steps.episode_layout``)."""
    rows_per_mb = shard["rows_per_minibatch"]
    for _epoch in range(cfg.train.max_epochs):
        for mb_index, mb in _minibatches(shard, rows_per_mb):
            plan = batching.plan(shard["attention_mask"][mb], dp_group)
            for i, index in enumerate(plan):
                yield mb_index, _micro_rows(shard, index + mb.start), len(plan), i == len(plan) - 1


def _num_updates(shard: dict[str, Any], cfg: RunConfig) -> int:
    return cfg.train.max_epochs * len(_minibatches(shard, shard["rows_per_minibatch"]))


def _actor_micro_step(engine: Any, fwd: Any, rows: dict[str, torch.Tensor], counts: dict[str, Any], kl_coef: float,
                      num_micro: int, last: bool, cfg: RunConfig, stats: dict[str, list[float]]) -> dict:
    """Loss of one micro-batch (``rows``, forwards in ``fwd``), its backward and the engine step.

    ``counts``: the global normalisers of its mini-batch (``aggregate_loss`` keyword arguments).
    """
    algo = cfg.algo
    mask = rows["action_mask"]
    logprobs, entropy_per_token = fwd.policy_logprobs(cfg.rollout.temperature, with_entropy=algo.entropy_loss_coef > 0)
    old = rows["old_logprobs"] if "old_logprobs" in rows else logprobs.detach()
    is_weights = None
    if algo.is_correction != "none":
        low, high = algo.is_truncation
        is_weights, is_stats = rollout_importance_weights(
            old, rows["rollout_logprobs"], mask, algo.is_correction, low, high)
    else:  # the engine-vs-trainer mismatch is logged every step: it is what shows that weight sync is right
        is_stats = rollout_mismatch_kl(old, rows["rollout_logprobs"], mask)
    for k, v in is_stats.items():
        stats[f"is/{k}"].append(float(v))
    pg, pg_stats = policy_loss(
        logprobs, old, rows["advantages"], mask, loss_type=algo.policy_loss_type,
        clip_eps_low=algo.eps_clip_low, clip_eps_high=algo.eps_clip_high,
        dual_clip=algo.dual_clip, importance_weights=is_weights)
    pg_loss = aggregate_loss(pg, mask, algo.loss_agg_mode, **counts)
    kl_loss = None
    if algo.kl.use_loss and "ref_logprobs" in rows:
        kl = kl_estimate(logprobs, rows["ref_logprobs"], mask, algo.kl.estimator)
        kl_loss = aggregate_loss(kl, mask, algo.loss_agg_mode, **counts)
        stats["kl_loss_share"].append(float(kl_loss.detach()))
        if "old_logprobs" not in rows:
            # On-policy: no old-logprob forward ran, so the controller could not measure the KL to the
            # reference; these logprobs are the old ones, so its token mean here is that metric exactly.
            kl_mean = aggregate_loss(kl.detach(), mask, "token_mean", **counts)
            stats["kl_share"].append(float(kl_mean))
    entropy = None
    if entropy_per_token is not None:
        entropy = aggregate_loss(entropy_per_token, mask, algo.loss_agg_mode, **counts)
    loss = total_loss(pg_loss, kl_loss=kl_loss, kl_coef=kl_coef, entropy=entropy,
                      entropy_coef=algo.entropy_loss_coef, num_micro_batches=num_micro)
    engine.backward(loss * fwd.loss_scale, boundary=last)
    step_info = engine.step()
    stats["policy_loss_share"].append(float(pg_loss.detach()))
    for k, v in pg_stats.items():
        stats[k].append(float(v))
    return step_info


def train_actor(engine: Any, shard: dict[str, Any], cfg: RunConfig, dp_size: int,
                sp: SequenceParallel | None = None) -> dict[str, float]:
    """PPO-family actor update on this rank's shard; returns mean stats over its micro-batches.

    Shard tensors: ``sequences`` / ``attention_mask`` (B, P+R); ``action_mask``, ``advantages``,
    ``rollout_logprobs`` and optionally ``old_logprobs`` / ``ref_logprobs`` (B, R).
    ``old_logprobs`` is absent when the update is exactly on-policy (one epoch, one optimizer step per
    rollout), in which case the current logprobs (detached) are the old ones. ``dp_size`` counts model
    replicas; with ``sp`` every rank of a replica's sp group computes the same micro-batch loss from its
    chunk of the sequence.
    """
    batching = Batching.for_training(cfg)
    stats: dict[str, list[float]] = defaultdict(list)
    engine.train()
    for mb_index, rows, num_micro, last in _updates(shard, cfg, dp_size, batching, getattr(engine, "dp_group", None)):
        counts = {"global_num_tokens": shard["num_tokens"][mb_index], "global_num_seqs": shard["num_seqs"][mb_index],
                  "dp_size": dp_size, "max_tokens": cfg.rollout.generate_max_len}
        with forward_scope(engine, rows, packed=batching.packed, sp=sp) as fwd:
            step_info = _actor_micro_step(engine, fwd, rows, counts, shard["kl_coef"], num_micro, last, cfg, stats)
        if last:
            if step_info.get("grad_norm") is not None:
                stats["actor_grad_norm"].append(float(step_info["grad_norm"]))
            stats["actor_lr"].append(float(step_info["lr"]))
    return _finish_stats(stats, _num_updates(shard, cfg))


def train_critic(engine: Any, shard: dict[str, Any], cfg: RunConfig, dp_size: int,
                 sp: SequenceParallel | None = None) -> dict[str, float]:
    """Clipped value regression towards ``returns`` (GAE targets) on this rank's shard."""
    batching = Batching.for_training(cfg)
    stats: dict[str, list[float]] = defaultdict(list)
    engine.train()
    for mb_index, rows, _num_micro, last in _updates(shard, cfg, dp_size, batching,
                                                     getattr(engine, "dp_group", None)):
        mask = rows["action_mask"]
        with forward_scope(engine, rows, packed=batching.packed, sp=sp) as fwd:
            per_token, v_stats = value_loss(fwd.critic_values(), rows["values"], rows["returns"], mask,
                                            cfg.algo.value_clip)
            loss = aggregate_loss(per_token, mask, "token_mean", global_num_tokens=shard["num_tokens"][mb_index],
                                  dp_size=dp_size)
            engine.backward(loss * fwd.loss_scale, boundary=last)
            step_info = engine.step()
        stats["critic_loss_share"].append(float(loss.detach()))
        for k, v in v_stats.items():
            stats[f"critic/{k}"].append(float(v))
        if last and step_info.get("grad_norm") is not None:
            stats["critic_grad_norm"].append(float(step_info["grad_norm"]))
    return _finish_stats(stats, _num_updates(shard, cfg))
