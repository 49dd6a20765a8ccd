"""The role worker: what this rank does for each of rank 0's commands (``commands``), with the engines it hosts.

Every rank has one, rank 0 included. A worker rank serves the commands as they come over the command bus
(:meth:`RoleWorker.serve_phase`, one phase of the run skeleton at a time); rank 0 runs its own part of each command
in place, right after sending it (``controller.RLController.call``), with the payload only it holds (the prompts,
the step batch, the controller's checkpoint record). So in this module ``None`` for a payload means "not rank 0": a
worker's part of a move is to take its shard from rank 0 and send its result back, and the replies (trajectories,
scores, forward outputs, metrics) are rank 0's alone (None elsewhere).

What a rank does for a command depends on the roles it hosts, never on the run's state: rank 0 decided that. The
moves inside a command are collective over the roles they touch (``roles``, ``concurrent_moves``), in the order
the command's handler makes them, the same on every rank.

Runs on every rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from hpc_rlhf.agents.executor import GenerateFn
from hpc_rlhf.ckpt.layout import rl_layout
from hpc_rlhf.config import RunConfig
from hpc_rlhf.config.rollout import rollout_engine_kind
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.resilience.fault_injection import fault_point
from hpc_rlhf.rollout.base import SamplingParams
from hpc_rlhf.rollout.vllm_server import VllmServerEngine
from hpc_rlhf.trainers.rl import checkpoint as rl_checkpoint
from hpc_rlhf.trainers.rl import setup as rl_setup
from hpc_rlhf.trainers.rl.checkpoint import Restored
from hpc_rlhf.trainers.rl.command_bus import CommandBus
from hpc_rlhf.trainers.rl.commands import (
    CloseRollouts,
    CollectRollouts,
    EndPhase,
    ExportModel,
    ForwardReply,
    GeneratedSoFar,
    Restore,
    RunForwards,
    RunUpdates,
    Save,
    SaveHFExport,
    ScoreRows,
    StartRollouts,
    Stop,
    SyncWeights,
    UpdateReply,
)
from hpc_rlhf.trainers.rl.concurrent_moves import run_forwards, run_updates
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers, ControllerCheckpoint
from hpc_rlhf.trainers.rl.evaluation import eval_sampling
from hpc_rlhf.trainers.rl.roles import Generated, RoleHandles, RolloutResult
from hpc_rlhf.trainers.rl.rollout_health import AgentFailureLimitError
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.weight_sync.adapter import AdapterCollector, AdapterWeights
from hpc_rlhf.weight_sync.colocated import colocated_weight_sync
from hpc_rlhf.weight_sync.sharded import EngineChannelWeightSync, ShardedWeightSync, WeightSync
from hpc_rlhf.world.groups import WorldGroups

log = logging.getLogger(__name__)


def sampling_seed(train_seed: int, step: int, engine_index: int) -> int:
    """The training rollouts' sampling seed: one per (step, engine) keeps sampling reproducible and different
    across engines (``engine_index``: the engine's data-parallel rank in the rollout role)."""
    return train_seed * 100_003 + step * 1_009 + engine_index


class RoleWorker:
    """This rank's engines and its part of every command. Built on every rank, in the same order (engine set-up is
    collective)."""

    def __init__(self, cfg: RunConfig, world: WorldGroups, tokenizer: PreTrainedTokenizerBase, num_steps: int) -> None:
        self.cfg, self.world, self.rank, self.tokenizer = cfg, world, world.rank, tokenizer
        # ds.lora.sync resolved: whether each sync sends the LoRA adapter alone (decided before any engine loads).
        self.adapter_sync = rl_setup.lora_sync_mode(cfg, announce=world.is_controller) == "adapter"
        # Collective (it creates groups), so built by every rank before any role's engine.
        self.weight_sync = rl_setup.weight_sync(cfg, world)
        self.roles = rl_setup.build_roles(cfg, world, tokenizer, num_steps)  # this rank's engines
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
        self.ckpt = rl_checkpoint.make_manager(cfg)
        # recorded in checkpoints; compared on resume
        self.layout = rl_layout(cfg, world.placement, torch.cuda.is_available())
        self.policy_version = 0  # weight syncs done; the rollout side stamps it on every sample
        self.sync_bytes = 0  # payload bytes this rank sent (colocated: loaded into its engine) in the last sync
        self.step_trains = False  # whether the latest RunForwards of this phase decided an update
        self.restored_step = 0  # the step the latest Restore loaded (0: none)
        self._round: RolloutResult | None = None  # this rank's generation round, between Start and CollectRollouts
        self._round_is_eval = False
        self._handlers: dict[type, Callable[[Any, Any], Any]] = {
            StartRollouts: self.start_rollouts, CollectRollouts: self.collect_rollouts, ScoreRows: self.score_rows,
            RunForwards: self.run_forwards, RunUpdates: self.run_updates, SyncWeights: self.sync_weights,
            Save: self.save, SaveHFExport: self.save_hf_export, Restore: self.restore, ExportModel: self.export,
            CloseRollouts: self.close_rollouts, GeneratedSoFar: self.generated_so_far, Stop: self.stop,
        }

    # ------------------------------------------------------------------ serving
    def handle(self, command: Any, payload: Any = None) -> Any:
        """This rank's part of ``command``; ``payload``: rank 0's input to it (None on every other rank). Returns the
        command's reply on rank 0."""
        handler = self._handlers.get(type(command))
        if handler is None:
            raise TypeError(f"rank {self.rank}: no handler for command {command!r}")
        return handler(command, payload)

    def serve_phase(self, bus: CommandBus) -> None:
        """A worker rank: serve rank 0's commands until it ends the phase (:class:`~commands.EndPhase`)."""
        self.step_trains = False
        while not isinstance(command := bus.receive(), EndPhase):
            self.handle(command)

    # ------------------------------------------------------------------ generation
    def start_rollouts(self, command: StartRollouts, prompts: list[Prompt] | None) -> None:
        """Rank 0's prompts -> each engine's share; this rank's engine generates (a failure is kept for the collect,
        ``RolloutRole.serve``). Collective over the rollout role's controller ranks (the scatter)."""
        rollout = self.handles.rollout
        mine = rollout.dispatch(prompts)
        self._round, self._round_is_eval = None, command.evaluation
        if rollout.side is None:
            return
        if command.evaluation:
            sampling = eval_sampling(self.cfg, rollout.side.stop_token_ids, rollout.engine_index)
            self._round = rollout.serve(lambda: self._run_executor(mine, command.seed_step, sampling,
                                                                   self.cfg.eval.n_samples_per_prompt))
        else:
            self._round = rollout.serve(lambda: self.run_rollouts(mine, command.seed_step))

    def run_rollouts(self, prompts: list[Prompt] | None, step: int) -> Generated:
        """A training round on this rollout rank: the agent executor over this engine's prompts."""
        side = self.handles.rollout.require_side()
        sampling = side.sampling(sampling_seed(self.cfg.train.seed, step, self.handles.rollout.engine_index))
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
        """The engine's ``generate`` as the agent executor calls it (the asynchronous worker times it)."""
        return generate

    def collect_rollouts(self, command: CollectRollouts, _: None = None) -> list[Generated] | None:
        """Each engine's round -> rank 0, in engine order, after the engines' service point: with ``server_process``
        engines, an engine restarted during this round gets its weights there from its sender
        (``EngineChannelWeightSync.serve``; none under adapter sync), and rank 0 learns the restart count."""
        result, self._round = self._round, None
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

    def generated_so_far(self, command: GeneratedSoFar, _: None = None) -> None:
        """Only the asynchronous worker counts generated batches."""

    # ------------------------------------------------------------------ scoring, experience, updates
    def score_rows(self, command: ScoreRows, rows: StepBatch | None) -> torch.Tensor | None:
        """The reward model's (B,) scores of rank 0's ``rows``."""
        if self.handles.reward is None:
            raise RuntimeError(f"rank {self.rank}: {command} but the placement has no reward role")
        return self.handles.reward.scores(rows)

    def run_forwards(self, command: RunForwards, batch: StepBatch | None) -> list[ForwardReply]:
        self.step_trains = command.commands.trains
        return run_forwards(self.handles, command.commands, batch)

    def run_updates(self, command: RunUpdates, batch: StepBatch | None) -> list[UpdateReply]:
        return run_updates(self.handles, command.commands, batch)

    # ------------------------------------------------------------------ weights
    def sync_weights(self, command: SyncWeights, _: None = None) -> None:
        """Actor -> rollout engines: in-process when colocated; otherwise (``weight_sync``) buckets leave from the
        actor ranks that hold them, all senders at once, not through rank 0: over the main world to in-process
        engines, over each engine's own NCCL channel to vLLM in processes of its own. Under ``ds.lora.sync=adapter``
        the same paths carry the LoRA adapter alone (``hpc_rlhf.weight_sync.adapter``). ``sync_bytes``: the payload
        this rank sent (colocated: into its engine)."""
        actor, rollout = self.handles.actor, self.handles.rollout
        fault_point("weight_sync", command.version, self.rank)
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
        self.policy_version = command.version

    def _weight_sync(self) -> WeightSync:
        if self.weight_sync is None:
            raise RuntimeError("colocated runs load weights in-process; there is no weight sync between ranks")
        return self.weight_sync

    # ------------------------------------------------------------------ checkpoints and exports
    def save(self, command: Save, controller: ControllerCheckpoint | None) -> None:
        """This rank's engines' states and RNG (rank 0: with the controller's ``record``) into the checkpoint of
        ``command.step``. Collective over the world."""
        rl_checkpoint.save(self.ckpt, command.step, self.roles, self.world, controller, self.checkpoint_rank_buffers(),
                           layout=self.layout)

    def restore(self, command: Restore, _: None = None) -> Restored:
        """``LATEST`` into this rank's engines, RNG and own buffers; the controller's record comes back on rank 0."""
        restored = rl_checkpoint.restore(self.ckpt, self.roles, self.world, self.layout)
        if restored.rank_buffers is not None:
            self.restore_rank_buffers(restored.rank_buffers)
        self.restored_step = restored.step
        return restored

    def checkpoint_rank_buffers(self) -> Buffers | None:
        """This rank's objects to keep across a restart (none when synchronous)."""
        return None

    def restore_rank_buffers(self, buffers: Buffers) -> None:
        """This rank's objects of :meth:`checkpoint_rank_buffers`."""

    def save_hf_export(self, command: SaveHFExport, _: None = None) -> None:
        """The actor (and with ``ckpt.save_critic_hf`` the critic) in HF format into ``command.directory``; returns
        once every writer is done (a barrier over the world)."""
        actor, critic = self.handles.actor, self.handles.critic
        if actor.hosts:
            actor.require_engine().save_hf(command.directory, tokenizer=self.tokenizer)
        if self.cfg.ckpt.save_critic_hf and critic is not None and critic.hosts:
            critic.require_engine().save_hf(str(Path(command.directory) / "critic"), tokenizer=self.tokenizer)
        dist.barrier()

    def export(self, command: ExportModel, _: None = None) -> None:
        """The final actor in HF format (safetensors + tokenizer) into the run directory."""
        actor = self.handles.actor
        if actor.hosts:
            actor.require_engine().save_hf(str(Path(self.cfg.train.output_dir) / "model"), tokenizer=self.tokenizer)
        dist.barrier()

    # ------------------------------------------------------------------ the end
    def close_rollouts(self, command: CloseRollouts, _: None = None) -> None:
        if self.roles.rollout is not None:  # e.g. the OpenAI-agent endpoint stops serving when training ends
            self.roles.rollout.executor.close()

    def stop(self, command: Stop, _: None = None) -> None:
        """Rank 0 ended the run (its agent-failure verdict): this rank raises with rank 0's reason, so whichever
        rank's error the launcher reports first, it says why."""
        raise AgentFailureLimitError(f"rank {self.rank}: stopping with rank 0: {command.reason}")

    def close(self) -> None:
        """Stop the rollout engine (vLLM's processes, or its in-process executor, which in the external launcher's
        mode tears the torch.distributed world down with it): the last call of a run on this rank."""
        if self.roles.rollout is not None:
            self.roles.rollout.engine.close()
