"""What each role computes on its own ranks during a PPO-family step.

The controller lays the step's rows out (``row_layout``) and moves shards in and results out (``loop``, over
``hpc_rlhf.world.channel``); these functions only see their shard: a :class:`StepBatch` of forward inputs for
the experience forwards, a :class:`TrainShard` for an update, plus the config sections they read. The loss math
comes from ``hpc_rlhf.algos``; the optimizer from the training-engine facade.

Every training shard carries ``num_tokens`` / ``num_seqs``: per mini-batch, the global count of action
tokens / rows over all data-parallel ranks, computed once by the controller. With them the summed
micro-batch losses equal the full mini-batch mean however the batch is split (``aggregate_loss``).

Runs on the ranks that host the role (rank 0 only where it hosts one).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
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
    token_share,
    total_loss,
    value_loss,
)
from hpc_rlhf.config.rollout import RolloutConfig
from hpc_rlhf.config.schema import AlgoConfig, DeepSpeedConfig, TrainConfig
from hpc_rlhf.models.micro_forward import SequenceParallel, forward_scope
from hpc_rlhf.models.moe import MoESpec, load_balancing_loss, routing_statistics, trained_moe_spec
from hpc_rlhf.trainers.rl.row_layout import Batching, split_to_count
from hpc_rlhf.trainers.rl.step_batch import StepBatch, TrainShard, required

# The step-batch fields each training role reads (the controller sends only these; the optional ones travel
# when set: old log-probs are absent on-policy, reference log-probs without a ``ref`` role).
TRAIN_FIELDS = {
    "actor": ("action_mask", "advantages", "rollout_logprobs", "old_logprobs", "ref_logprobs", "routed_experts"),
    "critic": ("action_mask", "values", "returns"),
}


@dataclass(frozen=True)
class UpdateSettings:
    """The numbers a training role's update reads besides its loss settings (``algo``)."""

    batching: Batching
    """How this rank cuts a mini-batch into micro-batches (``Batching.for_training``)."""
    max_epochs: int
    """``train.max_epochs``: passes over the step's rows."""
    temperature: float
    """``rollout.temperature``: log-probs are those of the sampling distribution (logits / temperature)."""
    generate_max_len: int
    """``rollout.generate_max_len``: the divisor of ``algo.loss_agg_mode=seq_mean_token_sum_norm``."""

    @classmethod
    def from_sections(cls, train: TrainConfig, rollout: RolloutConfig, ds: DeepSpeedConfig) -> UpdateSettings:
        return cls(Batching.for_training(train, ds), train.max_epochs, rollout.temperature, rollout.generate_max_len)


def _micro_batches(batching: Batching, attention_mask: torch.Tensor, dp_group: Any) -> list[torch.Tensor]:
    """Row indices (long tensors) of each micro-batch of these (B, T) rows.

    Token-budgeted plans differ between ranks; every rank of ``dp_group`` then splits its plan up to
    the largest count, because ZeRO's collectives run in every forward/backward.
    """
    lengths = attention_mask.sum(dim=1).tolist()
    plan = batching.plan(lengths)
    if batching.token_budgeted and dp_group is not None and dist.get_world_size(dp_group) > 1:
        count = torch.tensor([len(plan)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
        plan = split_to_count(plan, int(count), lengths)
    return [torch.tensor(rows, dtype=torch.long) for rows in plan]


def _per_row_forward(shard: StepBatch, batching: Batching, model: Any,
                     fn: Callable[[StepBatch], torch.Tensor]) -> torch.Tensor:
    """Run ``fn(micro_rows) -> (b, r)`` over micro-batches, each on the model's device; reassemble (B, R) fp32 in
    row order on the host."""
    out = torch.zeros(shard.action_mask.shape, dtype=torch.float32)
    for index in _micro_batches(batching, shard.attention_mask, model.dp_group):
        rows = shard.take_rows(index).trim_padding().to(model.device)
        result = fn(rows).float().cpu()
        out[index, : result.shape[1]] = result
    return out


@torch.no_grad()
def forward_logprobs(model: Any, shard: StepBatch, batching: Batching, temperature: float,
                     sp: SequenceParallel | None = None, replay: bool = False) -> torch.Tensor:
    """Log-probs of the shard's response tokens, micro-batch by micro-batch: (B, R) fp32. ``replay``: route an MoE
    model's tokens to the experts the rollout recorded (the shard's ``routed_experts``)."""
    def logprobs(rows: StepBatch) -> torch.Tensor:
        with forward_scope(model, rows.forward_inputs(), packed=batching.packed, sp=sp, replay=replay) as fwd:
            return fwd.policy_logprobs(temperature)[0]

    return _per_row_forward(shard, batching, model, logprobs)


@torch.no_grad()
def forward_values(model: Any, shard: StepBatch, batching: Batching,
                   sp: SequenceParallel | None = None) -> torch.Tensor:
    """Critic values before each response token: (B, R) fp32."""
    def values(rows: StepBatch) -> torch.Tensor:
        with forward_scope(model, rows.forward_inputs(), packed=batching.packed, sp=sp) as fwd:
            return fwd.critic_values()

    return _per_row_forward(shard, batching, model, values)


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


def _updates(shard: TrainShard, settings: UpdateSettings, engine: Any) -> Iterator[tuple[int, StepBatch, int, bool]]:
    """Yield ``(mini-batch index, micro-batch rows, micro-batches in this update, is it the last)`` for every
    epoch and mini-batch of the shard (``shard.rows_per_minibatch`` rows each: the controller's layout,
    ``train.train_batch_size`` episodes per mini-batch over all replicas, ``row_layout.train_shards``); each
    micro-batch's rows on the engine's device."""
    for _epoch in range(settings.max_epochs):
        for mb_index in range(shard.num_minibatches):
            mb = shard.minibatch(mb_index)
            plan = _micro_batches(settings.batching, shard.rows.attention_mask[mb], engine.dp_group)
            for i, index in enumerate(plan):
                rows = shard.rows.take_rows(index + mb.start).trim_padding().to(engine.device)
                yield mb_index, rows, len(plan), i == len(plan) - 1


def _num_updates(shard: TrainShard, settings: UpdateSettings) -> int:
    return settings.max_epochs * shard.num_minibatches


def _log_entropy(entropy_per_token: torch.Tensor, mask: torch.Tensor, counts: dict[str, Any],
                 stats: dict[str, list[float]]) -> None:
    """Record this micro-batch's share of the mini-batch token-mean entropy of the sampling distribution.

    ``entropy_per_token``, ``mask``: (b, R). Always a token mean, whatever ``algo.loss_agg_mode``: as a
    ``_share`` it sums over the micro-batches of an update and averages over data-parallel ranks into the
    exact token mean of each mini-batch (``_finish_stats``), so the logged ``entropy`` is the mean over
    the step's optimizer updates of the global token mean of their action tokens. Detached: logging it
    must never add to the backward.
    """
    share = aggregate_loss(entropy_per_token.detach(), mask, "token_mean", **counts)
    stats["entropy_share"].append(float(share))


def _moe_terms(engine: Any, fwd: Any, moe: MoESpec, mask: torch.Tensor, counts: dict[str, Any],
               stats: dict[str, list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """An MoE actor's load-balancing loss over this micro-batch and its weight in the step loss; logs the
    routing statistics of the action positions (``hpc_rlhf.algos.moe``), the aux loss and, when the rollout
    recorded routes, how often the trainer's router picks other experts (``moe/route_mismatch``: under routing
    replay, what the current router would pick in each layer given the replayed earlier layers).

    The load-balancing loss is a mean over the micro-batch's tokens, not a sum that ``aggregate_loss`` could
    normalise, so it is weighted by the micro-batch's share of the mini-batch's action tokens (the global count
    the controller computed): the shares then add up over micro-batches and ranks like the other terms, and
    splitting a mini-batch into more micro-batches does not multiply its weight.
    """
    router = fwd.router_logits
    sp_group = fwd.sp.group if fwd.sp is not None else None  # the chunks of one forward: reduced over the group
    aux = load_balancing_loss(engine.module, router, sp_group)
    weight = token_share(mask.sum(), counts["global_num_tokens"], counts["dp_size"])
    stats["aux_loss_share"].append(float(aux.detach() * weight))
    routing = routing_statistics(router, moe.top_k, fwd.recorded_routes, sp_group)
    for k, v in routing.items():
        stats[k].append(v)
    return aux, weight


def _actor_micro_step(engine: Any, fwd: Any, rows: StepBatch, counts: dict[str, Any], kl_coef: float,
                      last: bool, algo: AlgoConfig, temperature: float, stats: dict[str, list[float]],
                      moe: MoESpec | None = None) -> dict[str, Any]:
    """Loss of one micro-batch (``rows``, forwards in ``fwd``), its backward and the engine step.

    ``counts``: the global normalisers of its mini-batch (``aggregate_loss`` keyword arguments). ``moe``: the
    actor's routing when it is a mixture-of-experts model (its router logits are then read, for the routing
    statistics and ``algo.aux_loss_coef``).
    """
    mask = rows.action_mask
    entropy_bonus = algo.entropy_loss_coef != 0.0
    logprobs, entropy_per_token = fwd.policy_logprobs(temperature, with_entropy=True, entropy_grad=entropy_bonus,
                                                      with_router=moe is not None)
    aux, aux_weight = _moe_terms(engine, fwd, moe, mask, counts, stats) if moe else (None, 1.0)
    old = rows.old_logprobs if rows.old_logprobs is not None else logprobs.detach()
    rollout_logprobs = required(rows.rollout_logprobs, "rollout_logprobs")
    is_weights = None
    if algo.is_correction != "none":
        low, high = algo.is_truncation
        is_weights, is_stats = rollout_importance_weights(
            old, rollout_logprobs, mask, algo.is_correction, low, high)
    else:  # the engine-vs-trainer mismatch is logged every step: it is what shows that weight sync is right
        is_stats = rollout_mismatch_kl(old, rollout_logprobs, mask)
    for k, v in is_stats.items():
        stats[f"is/{k}"].append(float(v))
    pg, pg_stats = policy_loss(
        logprobs, old, required(rows.advantages, "advantages"), mask, loss_type=algo.policy_loss_type,
        clip_eps_low=algo.eps_clip_low, clip_eps_high=algo.eps_clip_high,
        dual_clip=algo.dual_clip, importance_weights=is_weights, sapo_tau_pos=algo.sapo_tau_pos,
        sapo_tau_neg=algo.sapo_tau_neg)
    pg_loss = aggregate_loss(pg, mask, algo.agg_mode, **counts)
    kl_loss = None
    if algo.kl.use_loss and rows.ref_logprobs is not None:
        kl = kl_estimate(logprobs, rows.ref_logprobs, mask, algo.kl.estimator)
        kl_loss = aggregate_loss(kl, mask, algo.agg_mode, **counts)
        stats["kl_loss_share"].append(float(kl_loss.detach()))
        if rows.old_logprobs is None:
            # On-policy: no old-logprob forward ran, so the controller could not measure the KL to the
            # reference; these logprobs are the old ones, so its token mean here is that metric exactly.
            kl_mean = aggregate_loss(kl.detach(), mask, "token_mean", **counts)
            stats["kl_share"].append(float(kl_mean))
    _log_entropy(entropy_per_token, mask, counts, stats)
    entropy = aggregate_loss(entropy_per_token, mask, algo.agg_mode, **counts) if entropy_bonus else None
    loss = total_loss(pg_loss, kl_loss=kl_loss, kl_coef=kl_coef, entropy=entropy,
                      entropy_coef=algo.entropy_loss_coef, aux_loss=aux, aux_loss_coef=algo.aux_loss_coef,
                      aux_weight=aux_weight)
    engine.backward(loss * fwd.loss_scale, boundary=last)
    step_info: dict[str, Any] = engine.step()
    stats["policy_loss_share"].append(float(pg_loss.detach()))
    for k, v in pg_stats.items():
        stats[k].append(float(v))
    return step_info


def train_actor(engine: Any, shard: TrainShard, algo: AlgoConfig, settings: UpdateSettings, dp_size: int,
                sp: SequenceParallel | None = None) -> dict[str, float]:
    """PPO-family actor update on this rank's shard; returns mean stats over its micro-batches.

    Shard rows (:data:`TRAIN_FIELDS`): ``sequences`` / ``attention_mask`` (B, P+R); ``action_mask``,
    ``advantages``, ``rollout_logprobs`` and optionally ``old_logprobs`` / ``ref_logprobs`` (B, R).
    ``old_logprobs`` is absent when the update is exactly on-policy (one epoch, one optimizer step per
    rollout), in which case the current logprobs (detached) are the old ones. ``dp_size`` counts model
    replicas; with ``sp`` every rank of a replica's sp group computes the same micro-batch loss from its
    chunk of the sequence.
    """
    stats: dict[str, list[float]] = defaultdict(list)
    engine.train()
    moe = trained_moe_spec(engine.module, algo.aux_loss_coef, "algo.aux_loss_coef")  # None: a dense actor
    replay = moe is not None and algo.routing_replay == "rollout"
    for mb_index, rows, _num_micro, last in _updates(shard, settings, engine):
        counts = {"global_num_tokens": shard.num_tokens[mb_index], "global_num_seqs": shard.num_seqs[mb_index],
                  "dp_size": dp_size, "max_tokens": settings.generate_max_len}
        with forward_scope(engine, rows.forward_inputs(), packed=settings.batching.packed, sp=sp,
                           replay=replay) as fwd:
            step_info = _actor_micro_step(engine, fwd, rows, counts, shard.kl_coef, last, algo,
                                          settings.temperature, stats, moe)
        if last:
            if step_info.get("grad_norm") is not None:
                stats["actor_grad_norm"].append(float(step_info["grad_norm"]))
            stats["actor_lr"].append(float(step_info["lr"]))
    return _finish_stats(stats, _num_updates(shard, settings))


def train_critic(engine: Any, shard: TrainShard, algo: AlgoConfig, settings: UpdateSettings, dp_size: int,
                 sp: SequenceParallel | None = None) -> dict[str, float]:
    """Clipped value regression towards ``returns`` (GAE targets) on this rank's shard (rows: ``values``,
    ``returns``, ``action_mask`` (B, R) besides the forward inputs)."""
    stats: dict[str, list[float]] = defaultdict(list)
    engine.train()
    for mb_index, rows, _num_micro, last in _updates(shard, settings, engine):
        mask = rows.action_mask
        with forward_scope(engine, rows.forward_inputs(), packed=settings.batching.packed, sp=sp) as fwd:
            per_token, v_stats = value_loss(fwd.critic_values(), required(rows.values, "values"),
                                            required(rows.returns, "returns"), mask, algo.value_clip)
            loss = aggregate_loss(per_token, mask, "token_mean", global_num_tokens=shard.num_tokens[mb_index],
                                  dp_size=dp_size)
            engine.backward(loss * fwd.loss_scale, boundary=last)
            step_info = engine.step()
        stats["critic_loss_share"].append(float(loss.detach()))
        for k, v in v_stats.items():
            stats[f"critic/{k}"].append(float(v))
        if last and step_info.get("grad_norm") is not None:
            stats["critic_grad_norm"].append(float(step_info["grad_norm"]))
    return _finish_stats(stats, _num_updates(shard, settings))
