"""Online RL (PPO, REINFORCE++, GRPO, RLOO, ...) in one torch.distributed world.

Every rank runs :meth:`PPOTrainer.fit`; each phase is collective only over the ranks of the roles it
touches (plus rank 0, the controller), so the same script reads as one story on every rank:

    prompts -> generate (rollout ranks) -> rewards -> ref / teacher / critic / old logprobs (role ranks)
    -> advantages (controller) -> train critic + actor (role ranks) -> weight sync -> metrics

The step's data: trajectories become one :class:`StepBatch` on rank 0 (``step_batch``); each role is a typed
handle (``roles``) whose moves deal the batch's rows to the role's data-parallel replicas (``row_layout``), run
the role's work there (``workers``) and bring the results back to rank 0. The training ranks' part of a step is
rank 0's decision, sent as typed commands (``commands``: ``Forward(role)``, ``Update(role)``) once per step; every
training rank serves them (the make-experience forwards are issued together and waited on after, and so are the
critic's and actor's updates, ``concurrent_moves``: roles on disjoint ranks compute at once; each role's seconds
are logged as ``timing/experience/<role>`` and ``timing/train/<role>``; a worker's failure reaches rank 0 with its
rank, role and traceback); ``controller_steps`` computes rewards,
advantages and metrics on rank 0. Values only rank 0 holds (the trajectories, the batch, the rows) are ``None``
on every other rank.

Colocated runs time-share each rank: wake rollout -> generate -> sleep -> reload training states ->
train -> offload training states -> wake rollout weights -> sync -> offload actor weights -> wake KV cache
(``hpc_rlhf.weight_sync.colocated``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_rlhf.agents.executor import GenerateFn
from hpc_rlhf.ckpt.hf_exports import HFExports
from hpc_rlhf.ckpt.layout import rl_layout
from hpc_rlhf.config import RunConfig, save_resolved_config
from hpc_rlhf.config.rollout import rollout_engine_kind
from hpc_rlhf.data.prompts import Prompt, source_name
from hpc_rlhf.models.loading import load_tokenizer
from hpc_rlhf.resilience.fault_injection import fault_point
from hpc_rlhf.resilience.stall_guard import StallGuard
from hpc_rlhf.rollout.base import SamplingParams, Trajectory
from hpc_rlhf.rollout.vllm_server import VllmServerEngine
from hpc_rlhf.trainers import run_skeleton
from hpc_rlhf.trainers.rl import checkpoint as rl_checkpoint
from hpc_rlhf.trainers.rl import setup as rl_setup
from hpc_rlhf.trainers.rl.commands import UPDATE_ORDER, StepCommands
from hpc_rlhf.trainers.rl.concurrent_moves import (
    ExperienceOutputs,
    exchange_commands,
    forward_commands,
    run_forwards,
    run_updates,
    update_commands,
)
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers
from hpc_rlhf.trainers.rl.controller_steps import (
    append_groups,
    attach_rewards,
    kept_by_dynamic_filtering,
    make_advantages,
    rollout_metrics,
    select_samples,
)
from hpc_rlhf.trainers.rl.evaluation import eval_metrics, eval_sampling, group_by_prompt, load_eval_prompts
from hpc_rlhf.trainers.rl.roles import Generated, RoleHandles, RolloutResult
from hpc_rlhf.trainers.rl.rollout_dump import is_dump_step, rollout_records, write_rollouts
from hpc_rlhf.trainers.rl.rollout_health import AgentFailureLimitError
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.trainers.run_skeleton import Row, RunHooks
from hpc_rlhf.utils.metrics import MetricsLogger, PhaseTimer
from hpc_rlhf.utils.seeding import seed_rank
from hpc_rlhf.weight_sync.adapter import AdapterCollector, AdapterWeights
from hpc_rlhf.weight_sync.colocated import colocated_weight_sync
from hpc_rlhf.weight_sync.sharded import EngineChannelWeightSync, ShardedWeightSync, WeightSync
from hpc_rlhf.world.groups import WorldGroups, world_peers
from hpc_rlhf.world.network import save_world_record

log = logging.getLogger(__name__)


def sampling_seed(train_seed: int, step: int, engine_index: int) -> int:
    """The training rollouts' sampling seed: one per (step, engine) keeps sampling reproducible and different
    across engines (``engine_index``: the engine's data-parallel rank in the rollout role)."""
    return train_seed * 100_003 + step * 1_009 + engine_index


def _generated(result: Generated | None) -> Generated:
    if result is None:
        raise RuntimeError("a rollout rank's generation round returned nothing")
    return result


class PPOTrainer(RunHooks):
    """The synchronous trainer; it is its own set of run-skeleton hooks (``hpc_rlhf.trainers.run_skeleton``)."""

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
        self.num_steps: int = int(box[0] or 0)
        # ds.lora.sync resolved: whether each sync sends the LoRA adapter alone (decided before any engine loads).
        self.adapter_sync = rl_setup.lora_sync_mode(cfg, announce=world.is_controller) == "adapter"
        # Collective (it creates groups), so built by every rank before any role's engine.
        self.weight_sync = rl_setup.weight_sync(cfg, world)
        self.roles = rl_setup.build_roles(cfg, world, self.tokenizer, self.num_steps)  # this rank's engines
        self.handles = RoleHandles.build(cfg, world, self.roles)  # every role, and the moves over it
        # server_process engines: a restarted engine gets its weights again over its channel (engine_restart)
        self.engine_channels = self.weight_sync if isinstance(self.weight_sync, EngineChannelWeightSync) else None
        engine = self.roles.rollout.engine if self.roles.rollout is not None else None
        if self.engine_channels is not None and isinstance(engine, VllmServerEngine):
            engine.rejoin = self.engine_channels
        # Engines that restart in place (rollout/engine_restarts): with the channels above, and under
        # ds.lora.sync=adapter without them (a restarted engine loads its adapter again by itself). The same on
        # every rank: the count is collected collectively.
        self.restartable_engines = rollout_engine_kind(cfg.rollout, cfg.train.colocate_all) == "vllm_server_process"
        self.engine_restarts = 0  # rank 0: restarts of every rollout engine so far (rollout/engine_restarts)
        if world.is_controller:
            save_resolved_config(cfg, cfg.train.output_dir)
            save_world_record(world_peers(), cfg.train.output_dir)  # where the ranks met (world.json)
        self.metrics = MetricsLogger(cfg.train.output_dir, cfg.logger, cfg.model_dump(mode="json"),
                                     resume=cfg.ckpt.load) if world.is_controller else None
        self.ckpt = rl_checkpoint.make_manager(cfg)
        # recorded in checkpoints; compared on resume
        self.layout = rl_layout(cfg, world.placement, torch.cuda.is_available())
        self.stopped_by_signal = False
        self.requeued = False  # with stopped_by_signal: SLURM restarts the job (cli exit status, preemption.py)
        self.last_row: Row = {}  # rank 0: the latest step's metrics (ckpt.best_metric reads them)
        self.policy_version = 0  # weight syncs done; the rollout side stamps it on every sample
        self.sync_bytes = 0  # payload bytes this rank sent (colocated: loaded into its engine) in the last sync
        self.train_ranks = set(world.train_ranks)  # decisions about the training batch go only to these
        self.train_group = world.train_group
        # rank 0: each role's seconds inside its moves this step (timing/experience/<role>, timing/train/<role>)
        self.role_seconds: dict[str, float] = {}
        # Rank 0's: False makes each role's forward or update wait for the one before (the baseline of
        # benchmarks/experience_overlap.py); it travels to the training ranks inside the step's commands.
        self.overlap_forwards = True
        # Training ranks: the step's commands from rank 0 (make_experience receives them, train serves the updates
        # and spends them; None: none decided for the next update).
        self.step_commands: StepCommands | None = None

    @property
    def controller(self) -> rl_setup.ControllerState:
        """Rank 0's state: prompt streams, reward function, KL controller, reward statistics, rollout health."""
        if self.data is None:
            raise RuntimeError(f"rank {self.rank} used the controller state, which only rank 0 holds")
        return self.data

    # ------------------------------------------------------------------ the run
    def fit(self) -> list[Row]:
        """Run the remaining steps; returns the metrics rows (rank 0). Stops early on SLURM's signals.

        The shared run skeleton (``hpc_rlhf.trainers.run_skeleton``) schedules the steps, evals, checkpoints and
        the export, every phase bounded (``StallGuard``): a hang ends the job with status 124 and stack dumps in
        ``<output_dir>/hang/``; a collective that fails because a peer died names that peer before raising."""
        guard = StallGuard.from_config(self.cfg.train, self.rank, dist.get_world_size())
        plan = rl_setup.run_plan(self.cfg, self.num_steps, self.rank, self.world.is_controller)
        outcome = run_skeleton.run(self, plan, guard)
        self.stopped_by_signal, self.requeued = outcome.stopped_by_signal, outcome.requeued
        return outcome.history

    def before_steps(self, start: int) -> None:
        """Hook before the first step (the asynchronous trainer fills its rollout queue here)."""

    def run_step(self, step: int, timer: PhaseTimer) -> Row | None:
        return self.step(step, timer)

    def run_eval(self, step: int) -> Row | None:
        return self.evaluate(step)

    def metrics_row(self, step: int, result: Row | None, eval_row: Row | None, timer: PhaseTimer) -> Row | None:
        """Rank 0: the step's row plus phase timings, the KL coefficient and the eval metrics; the controller's
        KL controller learns from it."""
        if result is None:  # rows live on the controller
            return None
        row = {**result, **timer.metrics(), "kl_coef": self.controller.kl_controller.value}
        # Roles on disjoint ranks ran at once: timing/make_experience and timing/train are about their busiest rank's.
        row.update({f"timing/{name}": seconds for name, seconds in self.role_seconds.items()})
        self.role_seconds = {}
        if self.restartable_engines:
            row["rollout/engine_restarts"] = float(self.engine_restarts)
        self.controller.after_step(row)
        if eval_row is not None:
            row.update(eval_row)
        self.last_row = row  # ckpt.best_metric reads it when the step's HF export is saved
        return row

    def history_row(self, step: int, row: Row) -> Row | None:
        return row if step > 0 else None  # the eval at start is in metrics.jsonl only

    def progress_postfix(self, row: Row) -> dict[str, str]:
        return {"reward": f"{row['reward']:.3f}"}

    def check_health(self, step: int) -> None:
        self.stop_on_agent_failures()

    def after_steps(self) -> None:
        if self.roles.rollout is not None:  # e.g. the OpenAI-agent endpoint stops serving when training ends
            self.roles.rollout.executor.close()

    def finish(self) -> None:
        if self.metrics:
            self.metrics.close()

    # ------------------------------------------------------------------ the step
    def step(self, step: int, timer: PhaseTimer) -> Row | None:
        """One synchronous step; returns the metrics row on rank 0."""
        prompts = self.controller.next_prompts() if self.world.is_controller else None
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
        if trajectories is None:  # not the controller
            return None
        self.controller.health.observe(trajectories, step)
        row = {**rollout_metrics(trajectories, batch, timer.seconds["generation"]), **train_stats,
               "weight_sync/bytes": float(self.sync_bytes)}
        if self.cfg.algo.dynamic_filtering:
            row["dynamic_filtering/refill_rounds"] = float(refill_rounds)
        return row

    def refill(self, trajectories: list[Trajectory] | None, step: int,
               timer: PhaseTimer) -> tuple[list[Trajectory] | None, int]:
        """DAPO refill: with ``algo.dynamic_filtering``, generate and score more prompts while filtering would
        leave fewer than a step's samples, at most ``rollout.dynamic_filtering_max_rounds`` extra rounds.
        Collective (every rank takes part in each round's generation); returns the trajectories and rounds."""
        cfg = self.cfg
        if not cfg.algo.dynamic_filtering:
            return trajectories, 0
        target = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        max_rounds = cfg.rollout.dynamic_filtering_max_rounds
        rounds = kept = 0
        while True:
            kept = kept_by_dynamic_filtering(trajectories, cfg) if trajectories is not None else 0
            if not self._broadcast_flag(trajectories is not None and kept < target and rounds < max_rounds):
                break
            rounds += 1
            prompts = self.controller.refill_prompts() if self.world.is_controller else None
            with timer("generation"):
                more = self.generate(prompts, step)
            with timer("reward"):
                more = self.score(more)
            if trajectories is not None and more is not None:
                trajectories = append_groups(trajectories, more)
        if trajectories is not None and rounds:
            log.info("step %d: dynamic filtering kept %d of %d samples after %d refill round(s) (target %d, at most "
                     "rollout.dynamic_filtering_max_rounds=%d)", step, min(kept, target), len(trajectories), rounds,
                     target, max_rounds)
        return trajectories, rounds

    def make_experience(self, trajectories: list[Trajectory] | None) -> tuple[bool, StepBatch | None]:
        """Selected samples as one step batch, plus the logprobs/values each enabled role computes and the
        advantages. Rank 0 decides the step's commands (``commands.StepCommands``: the forwards, and the updates
        :meth:`train` issues) and tells the training ranks, which serve them. Returns ``(trains, batch)``: whether
        this rank takes part in this step's update (a training rank and a step whose samples were not all filtered
        away) and, on rank 0, the batch."""
        if self.rank not in self.train_ranks:
            return False, None
        batch = self._training_batch(trajectories)
        commands = exchange_commands(self._decide_commands(batch), self.train_group)
        if not commands.trains:
            return False, None  # dynamic filtering removed every group: skip the update this step
        self.step_commands = commands  # train() serves its updates
        # Old log-probs, the reference's and the distillation teacher's, the critic's values: issued together,
        # so roles on disjoint ranks compute at once (``concurrent_moves``).
        replies = run_forwards(self.handles, commands, batch)
        self.role_seconds.update({f"experience/{r.role}": r.compute_seconds for r in replies})
        if batch is None:  # not the controller
            return True, None
        out = ExperienceOutputs.from_replies(replies)
        batch = replace(batch, old_logprobs=out.old_logprobs, ref_logprobs=out.ref_logprobs,
                        teacher_logprobs=out.teacher_logprobs, values=out.values)
        rewards = self.controller.normalized_rewards(batch.scored_rewards)
        return True, make_advantages(batch, self.cfg, rewards, self.controller.kl_controller.value)

    def _decide_commands(self, batch: StepBatch | None) -> StepCommands | None:
        """Rank 0: the step's forwards and updates over ``batch`` (none when it is None: every group was filtered
        away); None on every other rank, which receives rank 0's."""
        if not self.world.is_controller:
            return None
        if batch is None:
            return StepCommands(overlap=self.overlap_forwards)
        kl_coef = self.controller.kl_controller.value if self.cfg.algo.kl.use_loss else 0.0
        return StepCommands(forward_commands(self.handles, self.roles.need_old_logprobs),
                            update_commands(self.handles, self.policy_version + 1, kl_coef), self.overlap_forwards)

    def _training_batch(self, trajectories: list[Trajectory] | None) -> StepBatch | None:
        """Rank 0: the samples that train (overlong penalty, dynamic filtering) as one step batch; None when
        dynamic filtering dropped every prompt group (and on every other rank)."""
        if trajectories is None:
            return None
        selected = select_samples(trajectories, self.cfg)
        if selected:
            return StepBatch.from_trajectories(selected, self.tokenizer.pad_token_id)
        log.warning("dynamic filtering (algo.dynamic_filtering_reward_range=%s) dropped every prompt group of this "
                    "step: all samples of each prompt scored alike; the update is skipped",
                    list(self.cfg.algo.dynamic_filtering_reward_range))
        return None

    def train(self, batch: StepBatch | None) -> dict[str, float]:
        """The step's updates (critic, then actor; rank 0 decided them in :meth:`make_experience`), issued together
        (``concurrent_moves``: on disjoint ranks they train at once); every training rank calls it; ``batch``: rank
        0's step batch. Returns stats averaged over dp ranks (rank 0)."""
        if self.step_commands is None:
            # an update outside the step loop (no make_experience decided one for this batch, e.g. after a resume):
            # rank 0 decides it now; every training rank is here, so the exchange is the same collective as the step's
            self.step_commands = exchange_commands(self._decide_commands(batch), self.train_group)
        commands, self.step_commands = self.step_commands, None  # a step's commands serve one update, then are spent
        replies = {reply.role: reply for reply in run_updates(self.handles, commands, batch)}
        stats: dict[str, float] = {}
        for role in UPDATE_ORDER:  # the metrics' order in the row, as before
            if role in replies:
                stats.update(replies[role].metrics)
                self.role_seconds[f"train/{role}"] = replies[role].compute_seconds
        return stats

    def sync_weights(self) -> None:
        """Actor -> rollout engines: in-process when colocated; otherwise (``weight_sync``) buckets leave from the
        actor ranks that hold them, all senders at once, not through rank 0: over the main world to in-process
        engines, over each engine's own NCCL channel to vLLM in processes of its own. The asynchronous trainer
        syncs through here too. Under ``ds.lora.sync=adapter`` the same paths carry the LoRA adapter alone
        (``hpc_rlhf.weight_sync.adapter``). ``sync_bytes``: the payload this rank sent (colocated: into its engine)."""
        actor, rollout = self.handles.actor, self.handles.rollout
        fault_point("weight_sync", self.policy_version + 1, self.rank)
        self.sync_bytes = 0
        if self.cfg.train.colocate_all:
            others = [engine for engine in (self.roles.critic, self.roles.ref, self.roles.teacher)
                      if engine is not None]
            self.sync_bytes = colocated_weight_sync(rollout.require_side().engine, actor.require_engine(), others,
                                                    adapter=self.adapter_sync)
        elif actor.hosts:
            sync, before = self._weight_sync(), self._weight_sync().bytes_sent
            source = actor.require_engine()
            sync.send(AdapterWeights(source) if self.adapter_sync else source)  # each replica sends its share
            self.sync_bytes = sync.bytes_sent - before
        elif rollout.hosts:
            engine = rollout.require_side().engine
            sync = self._weight_sync()
            if self.adapter_sync:
                if not isinstance(sync, ShardedWeightSync):  # build_weight_sync picks it for adapters
                    raise RuntimeError(f"rank {self.rank}: adapter sync over {type(sync).__name__}")
                collector = AdapterCollector()
                sync.receive(collector)
                engine.update_adapter(collector.tensors)
            else:
                sync.receive(engine)
            engine.reset_prefix_cache()
        self.policy_version += 1

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: list[Prompt] | None, step: int) -> list[Trajectory] | None:
        """Scatter prompts over the rollout engines; each runs the agent executor; gather trajectories."""
        mine = self.dispatch_prompts(prompts)
        return self.collect_trajectories(self.serve_rollouts(lambda: self.run_rollouts(mine, step)))[0]

    def serve_rollouts(self, run: Callable[[], Generated | None]) -> RolloutResult | None:
        """This rank's generation round ``run`` (None where the rank hosts no engine); an engine rank's failure
        travels to rank 0 with the collect (``RolloutRole.serve``)."""
        if self.handles.rollout.side is None:
            return run()
        return self.handles.rollout.serve(lambda: _generated(run()))

    def dispatch_prompts(self, prompts: list[Prompt] | None) -> list[Prompt] | None:
        """Rank 0 -> rollout ranks: each engine's share of the step's prompts."""
        return self.handles.rollout.dispatch(prompts)

    def run_rollouts(self, prompts: list[Prompt] | None, step: int) -> Generated | None:
        """On rollout ranks: the agent executor over this engine's prompts -> (trajectories, seconds)."""
        rollout = self.handles.rollout
        if rollout.side is None:
            return None
        sampling = rollout.side.sampling(sampling_seed(self.cfg.train.seed, step, rollout.engine_index))
        return self._run_executor(prompts, step, sampling, self.cfg.rollout.n_samples_per_prompt)

    def _run_executor(self, prompts: list[Prompt] | None, step: int, sampling: SamplingParams, n: int) -> Generated:
        """This rank's engine generates ``n`` samples of each of ``prompts`` through the agent executor."""
        start = time.perf_counter()
        side = self.handles.rollout.require_side()
        if prompts is None:
            raise RuntimeError(f"rank {self.rank}: a rollout engine got no prompts from rank 0")
        side.engine.wake_up()
        fault_point("generation", step, self.rank)
        trajectories = side.executor.run(prompts, self.engine_generate(side.engine.generate), sampling, n)
        for t in trajectories:
            t.policy_version = self.policy_version
        if self.cfg.train.colocate_all:
            side.engine.sleep()
        return trajectories, time.perf_counter() - start

    def engine_generate(self, generate: GenerateFn) -> GenerateFn:
        """The engine's ``generate`` as the agent executor calls it (the asynchronous trainer times it)."""
        return generate

    def collect_trajectories(self, result: RolloutResult | None) -> tuple[list[Trajectory] | None, float]:
        """Rollout ranks -> rank 0: all trajectories in prompt order, and the slowest engine's seconds."""
        gathered = self.collect_rollouts(result)
        if gathered is None:
            return None, 0.0
        return [t for part, _ in gathered for t in part], max(seconds for _, seconds in gathered)

    def collect_rollouts(self, result: RolloutResult | None) -> list[Generated] | None:
        """The rollout role's collect, after the engines' service point: with ``server_process`` engines, an engine
        restarted during this generation gets its weights there from its sender (``EngineChannelWeightSync.serve``;
        none under adapter sync), and rank 0 learns the restart count. Collective (every rank)."""
        channels, rollout = self.engine_channels, self.handles.rollout
        if not self.restartable_engines:
            return rollout.collect(result)
        if channels is not None and self.handles.actor.hosts:
            channels.serve(self.handles.actor.require_engine())
        elif channels is not None and rollout.side is not None:
            channels.checkpoint_engine(rollout.side.engine)
        gathered = rollout.collect(result)
        engine = rollout.side.engine if rollout.side is not None else None
        counts = rollout.collect(([], float(engine.restarts)) if isinstance(engine, VllmServerEngine) else None)
        if counts is not None:
            self.engine_restarts = int(sum(count for _, count in counts))
        return gathered

    def score(self, trajectories: list[Trajectory] | None) -> list[Trajectory] | None:
        """Rewards from a function, a remote server, a reward-model role, or the agent's environment."""
        model_scores = None
        if self.handles.reward is not None:
            rows = None if trajectories is None else \
                StepBatch.from_trajectories(trajectories, self.tokenizer.pad_token_id, scored=False)
            model_scores = self.handles.reward.scores(rows)
        if trajectories is None:
            return None
        return attach_rewards(trajectories, self.controller.reward_fn, self.tokenizer, model_scores)

    def evaluate(self, step: int) -> dict[str, float] | None:
        """Collective: generate ``eval.n_samples_per_prompt`` samples per eval prompt on the rollout engines (the
        training's agent executor, ``eval.temperature``), score them with the training's reward source, and return
        the per-source metrics on rank 0 (``evaluation.eval_metrics``). Uses no training RNG and no prompt stream."""
        ev, rollout = self.cfg.eval, self.handles.rollout
        mine = rollout.dispatch(self.eval_prompts if self.world.is_controller else None)
        result = None
        if rollout.side is not None:
            sampling = eval_sampling(self.cfg, rollout.side.stop_token_ids, rollout.engine_index)
            result = rollout.serve(lambda: self._run_executor(mine, step, sampling, ev.n_samples_per_prompt))
        gathered = self.collect_rollouts(result)
        per_prompt, trajectories = group_by_prompt(rollout.shares(self.eval_prompts), gathered) \
            if gathered is not None else ([], None)
        self.score(trajectories)  # collective over a reward-model role; sets reward/score in place on rank 0
        if gathered is None:
            return None
        samples = [(source_name(p), group) for p, group in zip(self.eval_prompts, per_prompt, strict=True)]
        row = eval_metrics(samples, ev.n_samples_per_prompt, ev.pass_threshold)
        log.info("step %d eval: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in row.items() if "/pass@" in k))
        return row

    def dump_rollouts(self, step: int, trajectories: list[Trajectory] | None) -> None:
        """Rank 0, every ``logger.dump_rollouts_every`` steps: the step's scored samples (all of them, also those
        dynamic filtering dropped; rewards include the overlong penalty) to ``rollouts/step_<N>.jsonl``."""
        if trajectories is not None and is_dump_step(step, self.cfg.logger.dump_rollouts_every):
            write_rollouts(self.cfg.train.output_dir, step, rollout_records(trajectories, self.tokenizer, step))

    def stop_on_agent_failures(self) -> None:
        """Collective: every rank raises when rank 0's failure window is over ``train.max_agent_failure_fraction``,
        all with rank 0's verdict (cause and sample prompt): whichever rank's error the launcher reports first,
        it says why."""
        if not self.cfg.train.agent_func_path:
            return  # only agent episodes fail; every rank reads the same config, so all skip the collective
        box = [self.controller.health.verdict() if self.world.is_controller else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return
        if self.metrics:
            self.metrics.close()
        if self.world.is_controller:
            raise AgentFailureLimitError(box[0])
        raise AgentFailureLimitError(f"rank {self.rank}: stopping with rank 0: {box[0]}")

    def export(self) -> None:
        """Write the final actor in HF format (safetensors + tokenizer) into the run directory."""
        actor = self.handles.actor
        if actor.hosts:
            actor.require_engine().save_hf(str(Path(self.cfg.train.output_dir) / "model"), tokenizer=self.tokenizer)
        dist.barrier()

    def close(self) -> None:
        """Stop the rollout engine (vLLM's processes, or its in-process executor, which in the external launcher's
        mode tears the torch.distributed world down with it): the last call of a run on this rank."""
        if self.roles.rollout is not None:
            self.roles.rollout.engine.close()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> None:
        saved = self.controller.checkpoint(step, self.checkpoint_buffers()) if self.world.is_controller else None
        rl_checkpoint.save(self.ckpt, step, self.roles, self.world, saved, self.checkpoint_rank_buffers(),
                           layout=self.layout)
        if self.cfg.ckpt.save_hf:
            self.save_hf_export(step)

    def save_hf_export(self, step: int) -> None:
        """Collective: the actor (and with ``ckpt.save_critic_hf`` the critic) in HF format to ``hf/step_<N>``,
        written to a temporary directory and renamed; then rank 0 moves ``hf/BEST`` if ``ckpt.best_metric``
        improved at this step and rotates old exports (never the best)."""
        ckpt, actor, critic = self.cfg.ckpt, self.handles.actor, self.handles.critic
        exports = HFExports(self.cfg.train.output_dir, ckpt.max_num)
        box = [str(exports.prepare(step)) if self.world.is_controller else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(str(box[0]))
        if actor.hosts:
            actor.require_engine().save_hf(str(tmp), tokenizer=self.tokenizer)
        if ckpt.save_critic_hf and critic is not None and critic.hosts:
            critic.require_engine().save_hf(str(tmp / "critic"), tokenizer=self.tokenizer)
        dist.barrier()  # every writer is done before the rename
        if self.world.is_controller:
            self._publish_hf_export(exports, step)

    def _publish_hf_export(self, exports: HFExports, step: int) -> None:
        """Rank 0, once every writer is done: rename the export into place, move ``hf/BEST`` if
        ``ckpt.best_metric`` improved at this step, rotate old exports (never the best)."""
        ckpt = self.cfg.ckpt
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

    def checkpoint_buffers(self) -> Buffers | None:
        """Controller objects to keep across a restart beyond the JSON state (none when synchronous)."""
        return None

    def checkpoint_rank_buffers(self) -> Buffers | None:
        """This rank's objects to keep across a restart (none when synchronous)."""
        return None

    def restore_buffers(self, buffers: Buffers | None, same_world: bool = True) -> None:
        """Rank 0: the controller objects of :meth:`checkpoint_buffers`; ``same_world``: the checkpoint was saved
        by a world of this size and layout (else other ranks' per-rank buffers were dropped)."""

    def restore_rank_buffers(self, buffers: Buffers) -> None:
        """This rank's objects of :meth:`checkpoint_rank_buffers`."""

    def resume(self) -> int:
        """Restore ``LATEST`` (weights, optimizer, data position, controllers, RNG); returns its step."""
        restored = rl_checkpoint.restore(self.ckpt, self.roles, self.world, self.layout)
        step = restored.step
        if self.metrics is not None:
            # Rows after the checkpoint will be logged again; with nothing to load (step 0) that is all of them,
            # so a fresh start under ckpt.load=true leaves one row per step, as ckpt.load=false does.
            self.metrics.truncate_after(step)
        if restored.rank_buffers is not None:
            self.restore_rank_buffers(restored.rank_buffers)
        if restored.controller is not None:  # rank 0, resuming from a checkpoint
            self.controller.restore(restored.controller)
            self.restore_buffers(restored.controller.buffers, same_world=restored.same_world)
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

    def _weight_sync(self) -> WeightSync:
        if self.weight_sync is None:
            raise RuntimeError("colocated runs load weights in-process; there is no weight sync between ranks")
        return self.weight_sync
