"""The RL controller: rank 0's story of a run, told as typed commands to the role workers.

    prompts -> StartRollouts / CollectRollouts (rollout engines) -> rewards (ScoreRows: a reward model)
    -> RunForwards (old / ref / teacher log-probs, values) -> advantages (here) -> RunUpdates (critic, actor)
    -> SyncWeights -> metrics

Every command goes to every other rank over the command bus (``command_bus``) before rank 0 runs its own part of
it in place (:meth:`RLController.call`: rank 0's role worker, with the payload only rank 0 holds); the workers serve
them in order (``role_worker``). What the workers need to know about the step (which forwards, which updates, the
policy version, the checkpoint directory) travels in the commands; the data (prompts, rows, results) over the roles'
own channels inside each command's work. Rank 0 computes rewards, advantages and metrics between commands
(``controller_steps``) and owns everything that outlives a step on the data side: the prompt streams, the KL
controller, the reward statistics, the rollout health window (``setup.ControllerState``) and the metrics log.

The forwards of the roles on disjoint ranks run at once inside one :class:`~commands.RunForwards`, and so do the
updates inside one :class:`~commands.RunUpdates` (``concurrent_moves``); each role's seconds are logged as
``timing/experience/<role>`` and ``timing/train/<role>``; a worker's failure reaches rank 0 with its rank, role and
traceback.

Collective order: that of the commands, which is this module's order of calls. RNG: the controller draws none of
its own; the prompt streams are seeded by ``train.seed``, the engines' sampling by ``role_worker.sampling_seed``.

Runs on rank 0 only.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from hpc_rlhf.ckpt.hf_exports import HFExports
from hpc_rlhf.config import RunConfig
from hpc_rlhf.data.prompts import Prompt, source_name
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.checkpoint import Restored
from hpc_rlhf.trainers.rl.command_bus import CommandBus
from hpc_rlhf.trainers.rl.commands import (
    UPDATE_ORDER,
    CloseRollouts,
    CollectRollouts,
    EndPhase,
    ExportModel,
    Restore,
    RunForwards,
    RunUpdates,
    Save,
    SaveHFExport,
    ScoreRows,
    StartRollouts,
    StepCommands,
    Stop,
    SyncWeights,
)
from hpc_rlhf.trainers.rl.concurrent_moves import ExperienceOutputs, forward_commands, update_commands
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers
from hpc_rlhf.trainers.rl.controller_steps import (
    append_groups,
    attach_rewards,
    kept_by_dynamic_filtering,
    make_advantages,
    rollout_metrics,
    select_samples,
)
from hpc_rlhf.trainers.rl.evaluation import eval_metrics, group_by_prompt
from hpc_rlhf.trainers.rl.role_worker import RoleWorker
from hpc_rlhf.trainers.rl.roles import Generated
from hpc_rlhf.trainers.rl.rollout_dump import is_dump_step, rollout_records, write_rollouts
from hpc_rlhf.trainers.rl.rollout_health import AgentFailureLimitError
from hpc_rlhf.trainers.rl.setup import ControllerState
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.trainers.run_skeleton import Row
from hpc_rlhf.utils.metrics import MetricsLogger, PhaseTimer

log = logging.getLogger(__name__)


class RLController:
    """The synchronous trainer's story; rank 0's role worker runs rank 0's part of each command."""

    def __init__(self, cfg: RunConfig, state: ControllerState, worker: RoleWorker, bus: CommandBus,
                 eval_prompts: list[Prompt], metrics: MetricsLogger) -> None:
        self.cfg, self.state, self.worker, self.bus = cfg, state, worker, bus
        self.handles, self.tokenizer = worker.handles, worker.tokenizer
        self.eval_prompts = eval_prompts  # held-out prompts: their own list, so evaluating never moves the stream
        self.metrics = metrics
        self.num_steps = state.num_steps
        self.policy_version = 0  # weight syncs done (every SyncWeights carries the next)
        self.last_row: Row = {}  # the latest step's metrics (ckpt.best_metric reads them)
        # each role's seconds inside its moves this step (timing/experience/<role>, timing/train/<role>)
        self.role_seconds: dict[str, float] = {}
        # False makes each role's forward or update wait for the one before (the baseline of
        # benchmarks/experience_overlap.py); it travels to the training ranks inside the step's commands.
        self.overlap_forwards = True
        self.step_commands: StepCommands | None = None  # decided by make_experience, spent by train

    # ------------------------------------------------------------------ the bus
    def call(self, command: Any, payload: Any = None) -> Any:
        """Send ``command`` to every worker, then run rank 0's part of it (with ``payload``); its reply."""
        self.bus.send(command)
        return self.worker.handle(command, payload)

    def end_phase(self) -> None:
        """The workers go back to the run skeleton (the phase rank 0 was telling is over)."""
        self.bus.send(EndPhase())

    # ------------------------------------------------------------------ the step
    def step(self, step: int, timer: PhaseTimer) -> Row:
        """One synchronous step; its metrics row."""
        prompts = self.state.next_prompts()
        with timer("generation"):
            trajectories = self.generate(prompts, step)
        with timer("reward"):
            trajectories = self.score(trajectories)
        trajectories, refill_rounds = self.refill(trajectories, step, timer)
        with timer("make_experience"):
            batch = self.make_experience(trajectories)
        self.dump_rollouts(step, trajectories)
        with timer("train"):
            train_stats = self.train(batch) if batch is not None else {"skipped_update": 1.0}
        with timer("weight_sync"):
            self.sync_weights()
        self.state.health.observe(trajectories, step)
        row = {**rollout_metrics(trajectories, batch, timer.seconds["generation"]), **train_stats,
               "weight_sync/bytes": float(self.worker.sync_bytes)}
        if self.cfg.algo.dynamic_filtering:
            row["dynamic_filtering/refill_rounds"] = float(refill_rounds)
        return row

    def generate(self, prompts: list[Prompt], step: int) -> list[Trajectory]:
        """The engines generate ``prompts`` (seeded by ``step``); all trajectories in prompt order."""
        self.call(StartRollouts(step), prompts)
        return self.collect_trajectories()[0]

    def collect_trajectories(self) -> tuple[list[Trajectory], float]:
        """The round's trajectories in prompt order, and the slowest engine's seconds."""
        gathered = self.collect_rollouts()
        return [t for part, _ in gathered for t in part], max((seconds for _, seconds in gathered), default=0.0)

    def collect_rollouts(self) -> list[Generated]:
        gathered: list[Generated] | None = self.call(CollectRollouts())
        if gathered is None:
            raise RuntimeError("rank 0 got no rollouts back from the rollout role")
        return gathered

    def refill(self, trajectories: list[Trajectory], step: int, timer: PhaseTimer) -> tuple[list[Trajectory], int]:
        """DAPO refill: with ``algo.dynamic_filtering``, generate and score more prompts while filtering would leave
        fewer than a step's samples, at most ``rollout.dynamic_filtering_max_rounds`` extra rounds; returns the
        trajectories and the rounds."""
        cfg = self.cfg
        if not cfg.algo.dynamic_filtering:
            return trajectories, 0
        target = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        max_rounds = cfg.rollout.dynamic_filtering_max_rounds
        rounds = 0
        while (kept := kept_by_dynamic_filtering(trajectories, cfg)) < target and rounds < max_rounds:
            rounds += 1
            with timer("generation"):
                more = self.generate(self.state.refill_prompts(), step)
            with timer("reward"):
                more = self.score(more)
            trajectories = append_groups(trajectories, more)
        if rounds:
            log.info("step %d: dynamic filtering kept %d of %d samples after %d refill round(s) (target %d, at most "
                     "rollout.dynamic_filtering_max_rounds=%d)", step, min(kept, target), len(trajectories), rounds,
                     target, max_rounds)
        return trajectories, rounds

    def score(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """Rewards from a function, a remote server, a reward-model role, or the agent's environment."""
        model_scores = None
        if self.handles.reward is not None:
            rows = StepBatch.from_trajectories(trajectories, self.tokenizer.pad_token_id, scored=False)
            model_scores = self.call(ScoreRows(), rows)
        return attach_rewards(trajectories, self.state.reward_fn, self.tokenizer, model_scores)

    def make_experience(self, trajectories: list[Trajectory]) -> StepBatch | None:
        """The selected samples as one step batch with the log-probs / values each enabled role computes and the
        advantages; None when dynamic filtering dropped every sample (no update this step). Decides the step's
        forwards and updates (:class:`~commands.StepCommands`, the updates :meth:`train` issues)."""
        batch = self.training_batch(trajectories)
        if batch is None:
            return None
        commands = self.step_commands = self.decide_commands()
        # Old log-probs, the reference's and the distillation teacher's, the critic's values: issued together,
        # so roles on disjoint ranks compute at once (``concurrent_moves``).
        replies = self.call(RunForwards(commands), batch)
        self.role_seconds.update({f"experience/{r.role}": r.compute_seconds for r in replies})
        out = ExperienceOutputs.from_replies(replies)
        batch = replace(batch, old_logprobs=out.old_logprobs, ref_logprobs=out.ref_logprobs,
                        teacher_logprobs=out.teacher_logprobs, values=out.values)
        rewards = self.state.normalized_rewards(batch.scored_rewards)
        return make_advantages(batch, self.cfg, rewards, self.state.kl_controller.value)

    def decide_commands(self) -> StepCommands:
        """The step's forwards and updates (the update makes policy version ``policy_version + 1``)."""
        kl_coef = self.state.kl_controller.value if self.cfg.algo.kl.use_loss else 0.0
        return StepCommands(forward_commands(self.handles, self.worker.roles.need_old_logprobs),
                            update_commands(self.handles, self.policy_version + 1, kl_coef), self.overlap_forwards)

    def training_batch(self, trajectories: list[Trajectory]) -> StepBatch | None:
        """The samples that train (overlong penalty, dynamic filtering) as one step batch; None when dynamic
        filtering dropped every prompt group."""
        selected = select_samples(trajectories, self.cfg)
        if selected:
            return StepBatch.from_trajectories(selected, self.tokenizer.pad_token_id)
        log.warning("dynamic filtering (algo.dynamic_filtering_reward_range=%s) dropped every prompt group of this "
                    "step: all samples of each prompt scored alike; the update is skipped",
                    list(self.cfg.algo.dynamic_filtering_reward_range))
        return None

    def train(self, batch: StepBatch) -> dict[str, float]:
        """The step's updates (critic, then actor, as :meth:`make_experience` decided them; decided here for an update
        outside the step loop), issued together (``concurrent_moves``: on disjoint ranks they train at once). Returns
        the stats averaged over data-parallel ranks."""
        commands = self.step_commands if self.step_commands is not None else self.decide_commands()
        self.step_commands = None  # a step's commands serve one update, then are spent
        replies = {reply.role: reply for reply in self.call(RunUpdates(commands), batch)}
        stats: dict[str, float] = {}
        for role in UPDATE_ORDER:  # the metrics' order in the row, as before
            if role in replies:
                stats.update(replies[role].metrics)
                self.role_seconds[f"train/{role}"] = replies[role].compute_seconds
        return stats

    def sync_weights(self) -> None:
        """Actor -> rollout engines (``role_worker.RoleWorker.sync_weights``): the next policy version."""
        self.policy_version += 1
        self.call(SyncWeights(self.policy_version))

    # ------------------------------------------------------------------ around the steps
    def metrics_row(self, result: Row, eval_row: Row | None, timer: PhaseTimer) -> Row:
        """The step's row plus phase timings, the KL coefficient and the eval metrics; the KL controller learns
        from it."""
        row = {**result, **timer.metrics(), "kl_coef": self.state.kl_controller.value}
        # Roles on disjoint ranks ran at once: timing/make_experience and timing/train are about their busiest rank's.
        row.update({f"timing/{name}": seconds for name, seconds in self.role_seconds.items()})
        self.role_seconds = {}
        if self.worker.restartable_engines:
            row["rollout/engine_restarts"] = float(self.worker.engine_restarts)
        self.state.after_step(row)
        if eval_row is not None:
            row.update(eval_row)
        self.last_row = row  # ckpt.best_metric reads it when the step's HF export is saved
        return row

    def evaluate(self, step: int) -> dict[str, float]:
        """``eval.n_samples_per_prompt`` samples per eval prompt from the rollout engines (the training's agent
        executor, ``eval.temperature``), scored with the training's reward source; the per-source metrics
        (``evaluation.eval_metrics``). Uses no training RNG and no prompt stream."""
        ev = self.cfg.eval
        self.call(StartRollouts(step, evaluation=True), self.eval_prompts)
        per_prompt, trajectories = group_by_prompt(self.handles.rollout.shares(self.eval_prompts),
                                                   self.collect_rollouts())
        self.score(trajectories)  # sets reward/score in place
        samples = [(source_name(p), group) for p, group in zip(self.eval_prompts, per_prompt, strict=True)]
        row = eval_metrics(samples, ev.n_samples_per_prompt, ev.pass_threshold)
        log.info("step %d eval: %s", step, ", ".join(f"{k}={v:.3f}" for k, v in row.items() if "/pass@" in k))
        return row

    def dump_rollouts(self, step: int, trajectories: list[Trajectory]) -> None:
        """Every ``logger.dump_rollouts_every`` steps: the step's scored samples (all of them, also those dynamic
        filtering dropped; rewards include the overlong penalty) to ``rollouts/step_<N>.jsonl``."""
        if is_dump_step(step, self.cfg.logger.dump_rollouts_every):
            write_rollouts(self.cfg.train.output_dir, step, rollout_records(trajectories, self.tokenizer, step))

    def check_health(self) -> None:
        """End the run when the agent failure window is over ``train.max_agent_failure_fraction``: every worker
        raises with rank 0's verdict (cause and sample prompt), and so does rank 0."""
        verdict = self.state.health.verdict() if self.cfg.train.agent_func_path else None
        if verdict is None:
            return
        self.metrics.close()
        self.bus.send(Stop(verdict))
        raise AgentFailureLimitError(verdict)

    def before_steps(self, start: int) -> None:
        """Before the first step (the asynchronous controller fills its rollout queue here)."""

    def after_steps(self) -> None:
        self.call(CloseRollouts())

    def export(self) -> None:
        """The final actor in HF format (safetensors + tokenizer) into the run directory."""
        self.call(ExportModel())

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int) -> None:
        self.call(Save(step), self.state.checkpoint(step, self.checkpoint_buffers()))
        if self.cfg.ckpt.save_hf:
            self.save_hf_export(step)

    def save_hf_export(self, step: int) -> None:
        """The actor (and with ``ckpt.save_critic_hf`` the critic) in HF format to ``hf/step_<N>``, written to a
        temporary directory and renamed once every writer is done; then ``hf/BEST`` moves if ``ckpt.best_metric``
        improved at this step, and old exports are rotated (never the best)."""
        ckpt = self.cfg.ckpt
        exports = HFExports(self.cfg.train.output_dir, ckpt.max_num)
        self.call(SaveHFExport(str(exports.prepare(step))))
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

    def restore_buffers(self, buffers: Buffers | None, same_world: bool = True) -> None:
        """The controller objects of :meth:`checkpoint_buffers`; ``same_world``: the checkpoint was saved by a world
        of this size and layout (else other ranks' per-rank buffers were dropped)."""

    def resume(self) -> int:
        """Restore ``LATEST`` (weights, optimizer, data position, controllers, RNG); returns its step."""
        restored: Restored = self.call(Restore())
        step = restored.step
        # Rows after the checkpoint will be logged again; with nothing to load (step 0) that is all of them, so a
        # fresh start under ckpt.load=true leaves one row per step, as ckpt.load=false does.
        self.metrics.truncate_after(step)
        if restored.controller is not None:  # resuming from a checkpoint
            self.state.restore(restored.controller)
            self.restore_buffers(restored.controller.buffers, same_world=restored.same_world)
        if step:
            self.policy_version = step - 1  # one sync per step; the sync below makes it ``step``
            self.sync_weights()  # the rollout engines start from the restored actor
        return step
