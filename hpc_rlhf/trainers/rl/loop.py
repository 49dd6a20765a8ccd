"""Online RL (PPO, REINFORCE++, GRPO, RLOO, ...) in one torch.distributed world: one controller, many role workers.

:class:`PPOTrainer` is what a rank runs. Every rank builds its role worker (``role_worker``: the engines of the
roles it hosts, and its part of every command); rank 0 also builds the controller (``controller``: the prompt
streams, the step's story, the metrics), which tells the run as typed commands (``commands``) sent over the command
bus (``command_bus``). The run skeleton (``hpc_rlhf.trainers.run_skeleton``: the schedules of steps, evals and
saves, the preemption agreement, the stall guard) runs on every rank, because a signal and a hang belong to each
process; each of its phases that moves the roles is one phase of commands here: on rank 0 the controller tells it
and then ends it (:class:`~commands.EndPhase`), on every other rank the worker serves the commands until that end.

    skeleton phase      rank 0 (controller)                      other ranks (worker)
    resume              Restore, SyncWeights                     serve until EndPhase
    step                StartRollouts ... SyncWeights, metrics    serve until EndPhase
    eval, save, export  StartRollouts / Save / ExportModel ...   serve until EndPhase

The phase methods below (``generate``, ``score``, ``make_experience``, ``train``, ``evaluate``) are the same phases
one at a time, for scripts that drive a trainer by hand: every rank calls them in the same order; rank 0 passes
its inputs and gets the results, every other rank passes None and gets None.

Colocated runs time-share each rank: wake rollout -> generate -> sleep -> reload training states -> train -> offload
training states -> wake rollout weights -> sync -> offload actor weights -> wake KV cache
(``hpc_rlhf.weight_sync.colocated``).

Runs on every rank; the one place that asks which rank it is on is :meth:`PPOTrainer._phase`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from hpc_rlhf.config import RunConfig, save_resolved_config
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.loading import load_tokenizer
from hpc_rlhf.resilience.stall_guard import StallGuard
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers import run_skeleton
from hpc_rlhf.trainers.rl import setup as rl_setup
from hpc_rlhf.trainers.rl.command_bus import CommandBus
from hpc_rlhf.trainers.rl.controller import RLController
from hpc_rlhf.trainers.rl.evaluation import load_eval_prompts
from hpc_rlhf.trainers.rl.role_worker import RoleWorker, sampling_seed
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.trainers.run_skeleton import Row, RunHooks
from hpc_rlhf.utils.metrics import MetricsLogger, PhaseTimer
from hpc_rlhf.utils.seeding import seed_rank
from hpc_rlhf.world.groups import WorldGroups, world_peers
from hpc_rlhf.world.network import save_world_record

log = logging.getLogger(__name__)
T = TypeVar("T")
__all__ = ["PPOTrainer", "sampling_seed"]


class PPOTrainer(RunHooks):
    """The synchronous trainer on one rank; it is its own set of run-skeleton hooks."""

    worker_class: type[RoleWorker] = RoleWorker
    controller_class: type[RLController] = RLController

    def __init__(self, cfg: RunConfig, world: WorldGroups) -> None:
        self.cfg, self.world = cfg, world
        self.rank = world.rank
        rl_setup.check_supported(cfg)
        rl_setup.check_model_paths(cfg)
        seed_rank(cfg.train.seed, self.rank)
        self.tokenizer = load_tokenizer(cfg.actor.pretrain, key="actor.pretrain")
        rl_setup.check_teacher_tokenizer(cfg, self.tokenizer)
        rl_setup.check_agent_loads(cfg, self.tokenizer, self.rank)
        # Rank 0 alone reads the data; every rank needs the step count for its LR schedule.
        self.data = rl_setup.ControllerState(cfg, self.tokenizer) if world.is_controller else None
        eval_prompts = load_eval_prompts(cfg, self.tokenizer) if self.data is not None and cfg.eval.data else []
        box = [self.data.num_steps if self.data else None]
        dist.broadcast_object_list(box, src=0)
        self.num_steps: int = int(box[0] or 0)
        self.worker = self.worker_class(cfg, world, self.tokenizer, self.num_steps)
        self.roles, self.handles, self.adapter_sync = self.worker.roles, self.worker.handles, self.worker.adapter_sync
        self.bus = CommandBus(world)
        self.rl_controller: RLController | None = None  # rank 0's
        self.metrics: MetricsLogger | None = None  # rank 0's metrics.jsonl (the skeleton writes it)
        if self.data is not None:
            save_resolved_config(cfg, cfg.train.output_dir)
            save_world_record(world_peers(), cfg.train.output_dir)  # where the ranks met (world.json)
            self.metrics = MetricsLogger(cfg.train.output_dir, cfg.logger, cfg.model_dump(mode="json"),
                                         resume=cfg.ckpt.load)
            self.rl_controller = self.controller_class(cfg, self.data, self.worker, self.bus, eval_prompts,
                                                       self.metrics)
        self.stopped_by_signal = False
        self.requeued = False  # with stopped_by_signal: SLURM restarts the job (cli exit status, preemption.py)

    @property
    def controller(self) -> rl_setup.ControllerState:
        """Rank 0's state: prompt streams, reward function, KL controller, reward statistics, rollout health."""
        if self.data is None:
            raise RuntimeError(f"rank {self.rank} used the controller state, which only rank 0 holds")
        return self.data

    @property
    def overlap_forwards(self) -> bool:
        """Rank 0's: False makes each role's forward or update wait for the one before (the baseline of
        ``benchmarks/experience_overlap.py``); it travels to the other ranks inside the step's commands."""
        return self.rl_controller.overlap_forwards if self.rl_controller is not None else True

    @overlap_forwards.setter
    def overlap_forwards(self, value: bool) -> None:
        if self.rl_controller is not None:
            self.rl_controller.overlap_forwards = value

    @property
    def policy_version(self) -> int:
        """Weight syncs done (this rank's engines generate as this version)."""
        return self.worker.policy_version

    def _phase(self, tell: Callable[[RLController], T]) -> T | None:
        """One phase of commands: rank 0's controller tells it (``tell``) and ends it; every other rank's worker
        serves it. ``tell``'s result on rank 0, None elsewhere. Rank 0 ends no phase that raised: the workers then
        wait in their next receive until the launcher stops them (or the collective timeout)."""
        if self.rl_controller is None:
            self.worker.serve_phase(self.bus)
            return None
        result = tell(self.rl_controller)
        self.rl_controller.end_phase()
        return result

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

    def resume(self) -> int:
        """Restore ``LATEST`` (weights, optimizer, data position, controllers, RNG); returns its step on every
        rank."""
        step = self._phase(lambda c: c.resume())
        return self.worker.restored_step if step is None else step

    def before_steps(self, start: int) -> None:
        self._phase(lambda c: c.before_steps(start))

    def run_step(self, step: int, timer: PhaseTimer) -> Row | None:
        return self._phase(lambda c: c.step(step, timer))

    def run_eval(self, step: int) -> Row | None:
        return self.evaluate(step)

    def metrics_row(self, step: int, result: Row | None, eval_row: Row | None, timer: PhaseTimer) -> Row | None:
        if self.rl_controller is None or result is None:  # rows live on the controller
            return None
        return self.rl_controller.metrics_row(result, eval_row, timer)

    def history_row(self, step: int, row: Row) -> Row | None:
        return row if step > 0 else None  # the eval at start is in metrics.jsonl only

    def progress_postfix(self, row: Row) -> dict[str, str]:
        return {"reward": f"{row['reward']:.3f}"}

    def check_health(self, step: int) -> None:
        if self.cfg.train.agent_func_path:  # only agent episodes fail; every rank reads the same config
            self._phase(lambda c: c.check_health())

    def save_checkpoint(self, step: int) -> None:
        self._phase(lambda c: c.save_checkpoint(step))

    def after_steps(self) -> None:
        self._phase(lambda c: c.after_steps())

    def export(self) -> None:
        """Write the final actor in HF format (safetensors + tokenizer) into the run directory."""
        self._phase(lambda c: c.export())

    def finish(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.rl_controller is not None:
            self.bus.flush()  # every command was received: nothing in flight when the process group goes away

    def close(self) -> None:
        """Stop this rank's rollout engine: the last call of a run on this rank."""
        self.worker.close()

    # ------------------------------------------------------------------ phases one at a time
    def generate(self, prompts: list[Prompt] | None, step: int) -> list[Trajectory] | None:
        """The engines generate rank 0's ``prompts``; the trajectories on rank 0."""
        return self._phase(lambda c: c.generate(_given(prompts, "prompts"), step))

    def score(self, trajectories: list[Trajectory] | None) -> list[Trajectory] | None:
        """Rewards of rank 0's ``trajectories`` (set in place and returned on rank 0)."""
        return self._phase(lambda c: c.score(_given(trajectories, "trajectories")))

    def make_experience(self, trajectories: list[Trajectory] | None) -> tuple[bool, StepBatch | None]:
        """``(trains, batch)``: whether an update follows (every rank learns it), and rank 0's step batch with its
        log-probs, values and advantages."""
        batch = self._phase(lambda c: c.make_experience(_given(trajectories, "trajectories")))
        return (batch is not None if self.rl_controller is not None else self.worker.step_trains), batch

    def train(self, batch: StepBatch | None) -> dict[str, float]:
        """The updates over rank 0's ``batch``; the stats on rank 0 (empty elsewhere)."""
        return self._phase(lambda c: c.train(_given(batch, "batch"))) or {}

    def evaluate(self, step: int) -> dict[str, float] | None:
        """The eval metrics on rank 0 (``RLController.evaluate``)."""
        return self._phase(lambda c: c.evaluate(step))

    def sync_weights(self) -> None:
        self._phase(lambda c: c.sync_weights())

    def _training_batch(self, trajectories: list[Trajectory] | None) -> StepBatch | None:
        """Rank 0: the step batch of ``trajectories`` (no command)."""
        if self.rl_controller is None or trajectories is None:
            return None
        return self.rl_controller.training_batch(trajectories)


def _given(value: T | None, name: str) -> T:
    if value is None:
        raise ValueError(f"rank 0 must pass the {name}")
    return value
