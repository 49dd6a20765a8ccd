"""Online RL (PPO, REINFORCE++, GRPO, RLOO, ...) in one torch.distributed world.

Every rank runs :meth:`PPOTrainer.fit`; each phase is collective only over the ranks of the roles it
touches (plus rank 0, the controller), so the same script reads as one story on every rank:

    prompts -> generate (rollout ranks) -> rewards -> ref / teacher / critic / old logprobs (role ranks)
    -> advantages (controller) -> train critic + actor (role ranks) -> weight sync -> metrics

The step's data: trajectories become one :class:`StepBatch` on rank 0 (``step_batch``); ``row_layout`` deals its
rows to a role's data-parallel replicas (:meth:`PPOTrainer._role_forward` for the experience forwards,
``row_layout.train_shards`` for the updates); :meth:`PPOTrainer._on_role` moves the shards out and the results
back; ``workers`` run on the role's ranks; ``controller_steps`` computes advantages and metrics on rank 0.

Colocated runs time-share each rank: wake rollout -> generate -> sleep -> reload training states ->
train -> offload training states -> wake rollout weights -> sync -> offload actor weights -> wake KV cache
(``hpc_rlhf.weight_sync.colocated``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hpc_rlhf.ckpt.hf_exports import HFExports
from hpc_rlhf.ckpt.layout import rl_layout
from hpc_rlhf.config import RunConfig, save_resolved_config
from hpc_rlhf.models.loading import load_tokenizer
from hpc_rlhf.models.micro_forward import SequenceParallel
from hpc_rlhf.resilience.fault_injection import fault_point
from hpc_rlhf.resilience.stall_guard import StallGuard
from hpc_rlhf.rollout.base import SamplingParams
from hpc_rlhf.trainers import run_skeleton
from hpc_rlhf.trainers.rl import checkpoint as rl_checkpoint
from hpc_rlhf.trainers.rl import setup as rl_setup
from hpc_rlhf.trainers.rl.controller_steps import (
    append_groups,
    attach_rewards,
    kept_by_dynamic_filtering,
    make_advantages,
    rollout_metrics,
    select_samples,
)
from hpc_rlhf.trainers.rl.evaluation import (
    eval_metrics,
    eval_sampling,
    load_eval_prompts,
    source_name,
)
from hpc_rlhf.trainers.rl.rollout_dump import (
    is_dump_step,
    rollout_records,
    write_rollouts,
)
from hpc_rlhf.trainers.rl.rollout_health import AgentFailureLimitError, RolloutHealth
from hpc_rlhf.trainers.rl.row_layout import Batching, forward_shards, in_batch_order, train_shards
from hpc_rlhf.trainers.rl.run_hooks import RLRunHooks, rl_run_plan
from hpc_rlhf.trainers.rl.step_batch import StepBatch, TrainShard
from hpc_rlhf.trainers.rl.workers import (
    TRAIN_FIELDS,
    UpdateSettings,
    forward_logprobs,
    forward_values,
    train_actor,
    train_critic,
)
from hpc_rlhf.utils.metrics import MetricsLogger, PhaseTimer
from hpc_rlhf.utils.seeding import seed_rank
from hpc_rlhf.weight_sync.colocated import colocated_weight_sync
from hpc_rlhf.world.channel import gather_from_role, scatter_to_role
from hpc_rlhf.world.groups import WorldGroups
from hpc_rlhf.world.placement import FROZEN_POLICY_ROLES

log = logging.getLogger(__name__)


def _split_even(items: list[Any], parts: int) -> list[list[Any]]:
    """Split a list into ``parts`` contiguous chunks whose sizes differ by at most one."""
    bounds = np.linspace(0, len(items), parts + 1).round().astype(int)
    return [items[bounds[i] : bounds[i + 1]] for i in range(parts)]


def sampling_seed(train_seed: int, step: int, engine_index: int) -> int:
    """The training rollouts' sampling seed: one per (step, engine) keeps sampling reproducible and different
    across engines (``engine_index``: the engine's data-parallel rank in the rollout role)."""
    return train_seed * 100_003 + step * 1_009 + engine_index


class PPOTrainer:
    def __init__(self, cfg: RunConfig, world: WorldGroups) -> None:
        self.cfg, self.world = cfg, world
        self.rank = world.rank
        rl_setup.check_supported(cfg)
        rl_setup.check_model_paths(cfg)
        seed_rank(cfg.train.seed, self.rank)
        self.tokenizer = load_tokenizer(cfg.actor.pretrain, key="actor.pretrain")
        rl_setup.check_teacher_tokenizer(cfg, self.tokenizer)
        rl_setup.check_agent_loads(cfg, self.tokenizer, self.rank)
        # The controller alone reads the data; every rank needs the step count for its LR schedule.
        self.data = rl_setup.ControllerState(cfg, self.tokenizer) if world.is_controller else None
        # Held-out prompts: their own list, so evaluating never moves the training prompt stream.
        self.eval_prompts = load_eval_prompts(cfg, self.tokenizer) if world.is_controller and cfg.eval.data else []
        box = [self.data.num_steps if self.data else None]
        dist.broadcast_object_list(box, src=0)
        self.num_steps: int = box[0]
        # Collective (it creates groups), so built by every rank before any role's engine.
        self.weight_sync = rl_setup.weight_sync(cfg, world)
        self.roles = rl_setup.build_roles(cfg, world, self.tokenizer, self.num_steps)
        if world.is_controller:
            save_resolved_config(cfg, cfg.train.output_dir)
        self.metrics = MetricsLogger(cfg.train.output_dir, cfg.logger, cfg.model_dump(mode="json"),
                                     resume=cfg.ckpt.load) if world.is_controller else None
        self.ckpt = rl_checkpoint.make_manager(cfg)
        self.layout = rl_layout(cfg, world.placement)  # recorded in checkpoints; compared on resume
        self.stopped_by_signal = False
        self.health = RolloutHealth(cfg.train.max_agent_failure_fraction, cfg.train.agent_failure_window_steps,
                                    cfg.data.max_len) if world.is_controller else None
        self.requeued = False  # with stopped_by_signal: SLURM restarts the job (cli exit status, preemption.py)
        self.last_row: dict[str, Any] = {}  # rank 0: the latest step's metrics (ckpt.best_metric reads them)
        self.policy_version = 0  # weight syncs done; the rollout side stamps it on every sample
        self.train_ranks = set(world.train_ranks)  # decisions about the training batch go only to these
        self.train_group = world.train_group

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, Any]]:
        """Run the remaining steps; returns the metrics rows (rank 0). Stops early on SLURM's signals.

        The shared run skeleton (``hpc_rlhf.trainers.run_skeleton``) schedules the steps, evals, checkpoints and
        the export, every phase bounded (``StallGuard``): a hang ends the job with status 124 and stack dumps in
        ``<output_dir>/hang/``; a collective that fails because a peer died names that peer before raising."""
        guard = StallGuard.from_config(self.cfg.train, self.rank, dist.get_world_size())
        outcome = run_skeleton.run(RLRunHooks(self), rl_run_plan(self), guard)
        self.stopped_by_signal, self.requeued = outcome.stopped_by_signal, outcome.requeued
        return outcome.history

    def before_steps(self, start: int) -> None:
        """Hook before the first step (the asynchronous trainer fills its rollout queue here)."""

    def step(self, step: int, timer: PhaseTimer) -> dict[str, Any] | None:
        """One synchronous step; returns the metrics row on rank 0."""
        prompts = self.data.next_prompts() if self.world.is_controller else None
        with timer("generation"):
            trajectories = self.generate(prompts, step)
        with timer("reward"):
            trajectories = self.score(trajectories)
        trajectories, refill_rounds = self.refill(trajectories, step, timer)
        with timer("make_experience"):
            trains, batch = self.make_experience(trajectories)
        self.dump_rollouts(step, trajectories)
        with timer("train"):
            train_stats = self.train(batch) if trains else {"skipped_update": 1.0}
        with timer("weight_sync"):
            self.sync_weights()
        if not self.world.is_controller:
            return None
        self.health.observe(trajectories, step)
        row = {**rollout_metrics(trajectories, batch, timer.seconds["generation"]), **train_stats}
        if self.cfg.algo.dynamic_filtering:
            row["dynamic_filtering/refill_rounds"] = float(refill_rounds)
        return row

    def refill(self, trajectories: list | None, step: int, timer: PhaseTimer) -> tuple[list | None, int]:
        """DAPO refill: with ``algo.dynamic_filtering``, generate and score more prompts while filtering would
        leave fewer than a step's samples, at most ``rollout.dynamic_filtering_max_rounds`` extra rounds.
        Collective (every rank takes part in each round's generation); returns the trajectories and rounds."""
        cfg = self.cfg
        if not cfg.algo.dynamic_filtering:
            return trajectories, 0
        target = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        rounds = 0
        while True:
            kept = kept_by_dynamic_filtering(trajectories, cfg) if self.rank == 0 else 0
            wanted = self.rank == 0 and kept < target and rounds < cfg.rollout.dynamic_filtering_max_rounds
            if not self._broadcast_flag(wanted):
                break
            rounds += 1
            prompts = self.data.refill_prompts() if self.rank == 0 else None
            with timer("generation"):
                more = self.generate(prompts, step)
            with timer("reward"):
                more = self.score(more)
            if self.rank == 0:
                trajectories = append_groups(trajectories, more)
        if self.rank == 0 and rounds:
            log.info("step %d: dynamic filtering kept %d of %d samples after %d refill round(s) (target %d, at most "
                     "rollout.dynamic_filtering_max_rounds=%d)", step, min(kept, target), len(trajectories), rounds,
                     target, cfg.rollout.dynamic_filtering_max_rounds)
        return trajectories, rounds

    def dump_rollouts(self, step: int, trajectories: list | None) -> None:
        """Rank 0, every ``logger.dump_rollouts_every`` steps: the step's scored samples (all of them, also those
        dynamic filtering dropped; rewards include the overlong penalty) to ``rollouts/step_<N>.jsonl``."""
        if self.rank == 0 and is_dump_step(step, self.cfg.logger.dump_rollouts_every):
            write_rollouts(self.cfg.train.output_dir, step, rollout_records(trajectories, self.tokenizer, step))

    def stop_on_agent_failures(self) -> None:
        """Collective: every rank raises when rank 0's failure window is over ``train.max_agent_failure_fraction``,
        all with rank 0's verdict (cause and sample prompt): whichever rank's error the launcher reports first,
        it says why."""
        if not self.cfg.train.agent_func_path:
            return  # only agent episodes fail; every rank reads the same config, so all skip the collective
        box = [self.health.verdict() if self.world.is_controller else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        if self.metrics:
            self.metrics.close()
        if self.world.is_controller:
            raise AgentFailureLimitError(box[0])
        raise AgentFailureLimitError(f"rank {self.rank}: stopping with rank 0: {box[0]}")

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: list | None, step: int) -> list | None:
        """Scatter prompts over the rollout engines; each runs the agent executor; gather trajectories."""
        mine = self.dispatch_prompts(prompts)
        return self.collect_trajectories(self.run_rollouts(mine, step))[0]

    def dispatch_prompts(self, prompts: list | None) -> list | None:
        """Rank 0 -> rollout ranks: each engine's share of the step's prompts."""
        groups = self.world.roles["rollout"]
        if self.rank not in groups.controller_ranks:
            return None
        shards = _split_even(prompts, len(groups.dp_leaders)) if self.rank == 0 else None
        return scatter_to_role(shards, groups)

    def run_rollouts(self, prompts: list | None, step: int, sampling: SamplingParams | None = None,
                     n: int | None = None) -> tuple[list, float] | None:
        """On rollout ranks: the agent executor over this engine's prompts -> (trajectories, seconds).
        ``sampling`` / ``n`` (evaluation) replace the training's sampling parameters and samples per prompt."""
        if self.roles.rollout is None:
            return None
        start = time.perf_counter()
        rollout, groups = self.roles.rollout, self.world.roles["rollout"]
        rollout.engine.wake_up()
        fault_point("generation", step, self.rank)
        seed = sampling_seed(self.cfg.train.seed, step, groups.dp_rank_of[self.rank])
        trajectories = rollout.executor.run(prompts, rollout.engine.generate, sampling or rollout.sampling(seed),
                                            n or self.cfg.rollout.n_samples_per_prompt)
        for t in trajectories:
            t.policy_version = self.policy_version
        if self.cfg.train.colocate_all:
            rollout.engine.sleep()
        return trajectories, time.perf_counter() - start

    def collect_trajectories(self, result: tuple[list, float] | None) -> tuple[list | None, float]:
        """Rollout ranks -> rank 0: all trajectories in prompt order, and the slowest engine's seconds."""
        groups = self.world.roles["rollout"]
        if self.rank not in groups.controller_ranks:
            return None, 0.0
        gathered = gather_from_role(result, groups)
        if self.rank != 0:
            return None, 0.0
        return [t for part, _ in gathered for t in part], max(seconds for _, seconds in gathered)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """Collective: generate ``eval.n_samples_per_prompt`` samples per eval prompt on the rollout engines (the
        training's agent executor, ``eval.temperature``), score them with the training's reward source, and return
        the per-source metrics on rank 0 (``evaluation.eval_metrics``). Uses no training RNG and no prompt stream."""
        ev, groups = self.cfg.eval, self.world.roles["rollout"]
        shards = _split_even(self.eval_prompts, len(groups.dp_leaders)) if self.rank == 0 else None
        mine = scatter_to_role(shards, groups) if self.rank in groups.controller_ranks else None
        result = None
        if self.roles.rollout is not None:
            sampling = eval_sampling(self.cfg, self.roles.rollout.stop_token_ids, groups.dp_rank_of[self.rank])
            # The base class's generation: an asynchronous trainer's own run_rollouts feeds its training queue.
            result = PPOTrainer.run_rollouts(self, mine, step, sampling, ev.n_samples_per_prompt)
        gathered = gather_from_role(result, groups) if self.rank in groups.controller_ranks else None
        trajectories = None
        if self.rank == 0:
            # Executors number a shard's prompts from 0 (group_index): map each sample back to its prompt.
            per_prompt = [[] for _ in self.eval_prompts]
            trajectories, offset = [], 0
            for shard, (part, _) in zip(shards, gathered, strict=True):
                for t in part:
                    if t.branch_index == 0:  # pass@k counts episodes; an episode's rows share its reward
                        per_prompt[offset + t.group_index].append(t)
                trajectories.extend(part)
                offset += len(shard)
        self.score(trajectories)  # collective over a reward-model role; sets reward/score in place on rank 0
        if self.rank != 0:
            return None
        samples = [(source_name(p), group) for p, group in zip(self.eval_prompts, per_prompt, strict=True)]
        row = eval_metrics(samples, ev.n_samples_per_prompt, ev.pass_threshold)
        log.info("step %d eval: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in row.items() if "/pass@" in k))
        return row

    def score(self, trajectories: list | None) -> list | None:
        """Rewards from a function, a remote server, a reward-model role, or the agent's environment."""
        reward_groups = self.world.roles.get("reward")
        model_scores = None
        if reward_groups is not None and self.rank in reward_groups.controller_ranks:
            batch = StepBatch.from_trajectories(trajectories, self.tokenizer.pad_token_id, scored=False) \
                if self.rank == 0 else None
            sp = self._sp("reward")
            model_scores = self._role_forward("reward", batch, lambda m, rows: m.scores(rows.forward_inputs(), sp))
        if self.rank != 0:
            return None
        return attach_rewards(trajectories, self.data.reward_fn, self.tokenizer, model_scores)

    def make_experience(self, trajectories: list | None) -> tuple[bool, StepBatch | None]:
        """Selected samples as one step batch, plus the logprobs/values each enabled role computes and the
        advantages. Returns ``(trains, batch)``: whether this rank takes part in this step's update (a training rank
        and a step whose samples were not all filtered away) and, on rank 0, the batch."""
        cfg = self.cfg
        if self.rank not in self.train_ranks:
            return False, None
        batch = None
        if self.rank == 0:
            trajectories = select_samples(trajectories, cfg)  # overlong penalty, dynamic filtering
        if self.rank == 0 and trajectories:
            batch = StepBatch.from_trajectories(trajectories, self.tokenizer.pad_token_id)
        if self.rank == 0 and batch is None:
            log.warning("dynamic filtering (algo.dynamic_filtering_reward_range=%s) dropped every prompt group of "
                        "this step: all samples of each prompt scored alike; the update is skipped",
                        list(cfg.algo.dynamic_filtering_reward_range))
        if not self._broadcast_flag(batch is not None, self.train_group):
            return False, None  # dynamic filtering removed every group: skip the update this step
        temperature = cfg.rollout.temperature
        batching = Batching.for_experience(cfg.train, cfg.rollout, cfg.ds)
        if self.roles.need_old_logprobs:
            sp = self._sp("actor")
            replay = cfg.algo.routing_replay == "rollout"  # the experts the rollout recorded, in the actor's forward
            old = self._role_forward("actor", batch, lambda m, rows: forward_logprobs(m, rows, batching, temperature,
                                                                                      sp, replay),
                                     fields=("routed_experts",) if replay else ())
            if self.rank == 0:
                batch.old_logprobs = old
        for role in FROZEN_POLICY_ROLES:  # the reference and the distillation teacher score the sampled tokens
            if role in self.world.roles:
                sp = self._sp(role)
                scores = self._role_forward(role, batch, lambda m, rows, sp=sp: forward_logprobs(
                    m, rows, batching, temperature, sp))
                if self.rank == 0:
                    setattr(batch, f"{role}_logprobs", scores)
        if "critic" in self.world.roles:
            sp = self._sp("critic")
            values = self._role_forward("critic", batch, lambda m, rows: forward_values(m, rows, batching, sp))
            if self.rank == 0:
                batch.values = values
        if self.rank == 0:
            rewards = self.data.normalized_rewards(batch.rewards)
            batch = make_advantages(batch, cfg, rewards, self.data.kl_controller.value)
        return True, batch

    def train(self, batch: StepBatch | None) -> dict[str, float]:
        """Critic then actor updates on their ranks (every training rank calls it; ``batch``: rank 0's step batch);
        returns stats averaged over dp ranks (rank 0)."""
        cfg = self.cfg
        settings = UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds)
        stats: dict[str, float] = {}
        for role, update in (("critic", train_critic), ("actor", train_actor)):
            if role not in self.world.roles:
                continue
            groups = self.world.roles[role]
            if self.rank not in groups.controller_ranks:
                continue
            dp = len(groups.dp_leaders)
            shards = None
            if self.rank == 0:
                kl_coef = self.data.kl_controller.value if role == "actor" and cfg.algo.kl.use_loss else 0.0
                # train.train_batch_size counts episodes; a branching agent's episode brings all its rows.
                shards = train_shards(batch.select(*TRAIN_FIELDS[role]), batch.episode_index,
                                      cfg.train.train_batch_size, dp, cfg.train.use_dynamic_batch, kl_coef)
            sp = self._sp(role)

            def run(engine: Any, shard: TrainShard, update=update, sp=sp) -> dict[str, float]:
                fault_point("train", self.policy_version + 1, self.rank)
                return update(engine, shard, cfg.algo, settings, dp, sp)

            # Colocated: the states are offloaded after the weight sync instead.
            gathered = self._on_role(role, shards, TrainShard, run, offload=not cfg.train.colocate_all)
            if self.rank == 0:
                for k in gathered[0]:
                    stats[k] = float(np.mean([g[k] for g in gathered]))
        return stats

    def sync_weights(self) -> None:
        """Actor -> rollout engines: in-process when colocated; otherwise (``weight_sync``) buckets leave from the
        actor ranks that hold them, all senders at once, not through rank 0: over the main world to in-process
        engines, over each engine's own NCCL channel to vLLM in processes of its own. The asynchronous trainer
        syncs through here too."""
        actor, rollout = self.world.roles["actor"], self.world.roles["rollout"]
        fault_point("weight_sync", self.policy_version + 1, self.rank)
        if self.cfg.train.colocate_all:
            others = [engine for engine in (self.roles.critic, self.roles.ref, self.roles.teacher)
                      if engine is not None]
            colocated_weight_sync(self.roles.rollout.engine, self.roles.actor, others)
            self.policy_version += 1
            return
        if self.rank in actor.ranks:
            self.weight_sync.send(self.roles.actor)  # each replica sends its share of the buckets
        elif self.rank in rollout.ranks:
            self.weight_sync.receive(self.roles.rollout.engine)
            self.roles.rollout.engine.reset_prefix_cache()
        self.policy_version += 1

    def export(self) -> None:
        """Write the final actor in HF format (safetensors + tokenizer) into the run directory."""
        if self.rank in self.world.roles["actor"].ranks:
            self.roles.actor.save_hf(str(Path(self.cfg.train.output_dir) / "model"), tokenizer=self.tokenizer)
        dist.barrier()

    def close(self) -> None:
        """Stop the rollout engine (vLLM's processes, or its in-process executor, which in the external launcher's
        mode tears the torch.distributed world down with it): the last call of a run on this rank."""
        if self.roles.rollout is not None:
            self.roles.rollout.engine.close()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> None:
        state = None
        if self.world.is_controller:
            state = {"stream": self.data.stream.state_dict(), "kl": self.data.kl_controller.state_dict(),
                     "reward_norm": self.data.reward_normalizer.state_dict(),
                     "refill_stream": self.data.refill_stream.state_dict()}
        rl_checkpoint.save(self.ckpt, step, self.roles, self.world, state,
                            self.checkpoint_buffers() if self.world.is_controller else None,
                            self.checkpoint_rank_buffers(), layout=self.layout)
        if self.cfg.ckpt.save_hf:
            self.save_hf_export(step)

    def save_hf_export(self, step: int) -> None:
        """Collective: the actor (and with ``ckpt.save_critic_hf`` the critic) in HF format to ``hf/step_<N>``,
        written to a temporary directory and renamed; then rank 0 moves ``hf/BEST`` if ``ckpt.best_metric``
        improved at this step and rotates old exports (never the best)."""
        ckpt = self.cfg.ckpt
        exports = HFExports(self.cfg.train.output_dir, ckpt.max_num)
        box = [str(exports.prepare(step)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        if self.rank in self.world.roles["actor"].ranks:
            self.roles.actor.save_hf(str(tmp), tokenizer=self.tokenizer)
        if ckpt.save_critic_hf and self.rank in self.world.roles["critic"].ranks:
            self.roles.critic.save_hf(str(tmp / "critic"), tokenizer=self.tokenizer)
        dist.barrier()  # every writer is done before the rename
        if self.rank != 0:
            return
        exports.commit(step)
        if ckpt.best_metric:
            value = self.last_row.get(ckpt.best_metric)
            if isinstance(value, (int, float)):
                exports.update_best(step, ckpt.best_metric, float(value), ckpt.best_mode)
            else:
                log.warning("ckpt.best_metric=%s is not among step %d's metrics, so hf/BEST cannot move here; "
                            "evaluate at checkpoint steps (eval.steps dividing ckpt.save_steps)", ckpt.best_metric,
                            step)
        exports.rotate()

    def checkpoint_buffers(self) -> Any:
        """Controller objects to keep across a restart beyond the JSON state (none when synchronous)."""
        return None

    def checkpoint_rank_buffers(self) -> Any:
        """This rank's objects to keep across a restart (none when synchronous)."""
        return None

    def restore_buffers(self, buffers: Any, same_world: bool = True) -> None:
        """Rank 0: the controller objects of :meth:`checkpoint_buffers`; ``same_world``: the checkpoint was saved
        by a world of this size and layout (else other ranks' per-rank buffers were dropped)."""

    def restore_rank_buffers(self, buffers: Any) -> None:
        pass

    def resume(self) -> int:
        """Restore ``LATEST`` (weights, optimizer, data position, controllers, RNG); returns its step."""
        step, state = rl_checkpoint.restore(self.ckpt, self.roles, self.world, self.layout)
        if self.metrics is not None:
            # Rows after the checkpoint will be logged again; with nothing to load (step 0) that is all of them,
            # so a fresh start under ckpt.load=true leaves one row per step, as ckpt.load=false does.
            self.metrics.truncate_after(step)
        if state is not None and "rank_buffers" in state:
            self.restore_rank_buffers(state.pop("rank_buffers"))
        if state is not None and self.world.is_controller:
            self.data.stream.load_state_dict(state["stream"])
            self.data.kl_controller.load_state_dict(state["kl"])
            self.data.reward_normalizer.load_state_dict(state["reward_norm"])
            if "refill_stream" in state:  # checkpoints written before refill existed lack it
                self.data.refill_stream.load_state_dict(state["refill_stream"])
            self.restore_buffers(state.get("buffers"), same_world=state["same_world"])
        if step:
            self.policy_version = step - 1  # one sync per step; the sync below makes it ``step``
            self.sync_weights()  # the rollout engines start from the restored actor
        return step

    # ------------------------------------------------------------------ plumbing
    def _broadcast_flag(self, value: bool, group: dist.ProcessGroup | None = None) -> bool:
        """Rank 0's ``value`` on every rank of ``group`` (default: the world)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return bool(box[0])

    def _on_role(self, role: str, shards: list | None, shard_type: type[StepBatch] | type[TrainShard],
                 fn: Callable[[Any, Any], Any], *, reload: bool = True, offload: bool = False) -> list | None:
        """Rank 0's ``shards`` (one per data-parallel replica of ``role``) to the role's ranks, which reload their
        training states (``reload``), run ``fn(engine, shard)`` and offload them again (``offload``); the results
        come back to rank 0 in replica order (None elsewhere). Collective over the role's controller ranks."""
        groups = self.world.roles[role]
        wire = scatter_to_role(None if shards is None else [s.to_wire() for s in shards], groups)
        result = None
        if self.rank in groups.ranks:
            engine = getattr(self.roles, role)
            if reload:
                engine.reload_states()
            result = fn(engine, shard_type.from_wire(wire))
            if offload:
                engine.offload_states()
        gathered = gather_from_role(result, groups)
        return gathered if self.rank == 0 else None

    def _role_forward(self, role: str, batch: StepBatch | None, fn: Callable[[Any, StepBatch], torch.Tensor],
                      fields: tuple[str, ...] = ()) -> torch.Tensor | None:
        """The batch's forward inputs (and ``fields``) over the role's dp replicas (``row_layout.forward_shards``),
        ``fn(engine, rows) -> (b, ...)`` on each, and the outputs back on rank 0 as (B, ...) in the batch's row
        order."""
        groups = self.world.roles[role]
        if self.rank not in groups.controller_ranks:
            return None
        shards = layout = None
        if self.rank == 0:
            shards, layout = forward_shards(batch, len(groups.dp_leaders), self.cfg.train.use_dynamic_batch, fields)
        # Colocated: the states left the device for the weight sync; the reward model keeps none to reload.
        outputs = self._on_role(role, shards, StepBatch, fn, reload=role != "reward")
        return None if self.rank != 0 else in_batch_order(outputs, layout, batch.num_rows)

    def _sp(self, role: str) -> SequenceParallel | None:
        """This rank's sequence-parallel peers in ``role`` (``ds.ring_attn_size`` > 1), else None."""
        if self.cfg.ds.ring_attn_size == 1 or not self.world.has_role(role):
            return None
        group = self.world.roles[role].sp_group
        return SequenceParallel(group, dist.get_rank(group), self.cfg.ds.ring_attn_size, self.cfg.ds.ring_head_stride)
