"""Save and restore everything that shapes the rest of a PPO-family run.

A checkpoint ``<ckpt.path>/step_<N>/`` holds the DeepSpeed states of each trained role (weights,
optimizer, LR schedule), the controller state (step, prompt-stream position and order, KL controller,
reward normaliser), the RNG state of every rank and the layout it was saved with (``layout.json``).
``hpc_rlhf.ckpt.CheckpointManager`` makes it atomic.

A run laid out differently (another number of ranks, ZeRO stage or AutoTP size: a requeued job on another
allocation) loads the trained states through DeepSpeed's universal checkpoint (``hpc_rlhf.ckpt.layout``,
``hpc_rlhf.ckpt.universal``); the controller state carries over as it is; what cannot be reproduced is said there.

Runs on every rank: each saves and restores the states of the roles it hosts and its RNG; rank 0 also the
controller's state (``hpc_rlhf.trainers.rl.controller_checkpoint``), the manifest and ``LATEST``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_rlhf.ckpt import CheckpointManager, load_rank_rng, save_rank_rng
from hpc_rlhf.ckpt.layout import CheckpointLayout, compare_layouts, read_layout, write_layout
from hpc_rlhf.ckpt.resume import agreed_checkpoint, warn_if_starting_over
from hpc_rlhf.ckpt.universal import load_resharded
from hpc_rlhf.config import RunConfig
from hpc_rlhf.resilience.fault_injection import fault_point
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers, ControllerCheckpoint
from hpc_rlhf.trainers.rl.setup import Roles
from hpc_rlhf.training.deepspeed_engine import TrainEngine
from hpc_rlhf.world.groups import WorldGroups
from hpc_rlhf.world.placement import TRAINED_ROLES

log = logging.getLogger(__name__)
DS_TAG = "ds"


@dataclass
class Restored:
    """What :func:`restore` gives this rank back besides its engines' and RNG's states."""

    step: int  # the checkpoint's step (0: none found, the run starts fresh)
    controller: ControllerCheckpoint | None  # rank 0: the controller's record; None elsewhere or when fresh
    rank_buffers: Buffers | None  # this rank's own buffers, if it saved some (only when the world is the same)
    same_world: bool  # saved by a world of this size and layout (else other ranks' per-rank buffers were dropped)


def checkpoint_root(cfg: RunConfig) -> Path:
    return Path(cfg.ckpt.path) if cfg.ckpt.path else Path(cfg.train.output_dir) / "ckpt"


def make_manager(cfg: RunConfig) -> CheckpointManager:
    manager = CheckpointManager(checkpoint_root(cfg), max_num=cfg.ckpt.max_num)
    if not cfg.ckpt.load:
        warn_if_starting_over(manager)
    return manager


def save(manager: CheckpointManager, step: int, roles: Roles, world: WorldGroups,
         controller: ControllerCheckpoint | None, rank_buffers: Buffers | None = None,
         layout: CheckpointLayout | None = None) -> None:
    """Collective over the world: every rank calls it at the same step. ``controller`` (rank 0): the controller's
    record. ``layout`` (rank 0): this run's layout, recorded so that a run laid out differently knows how to load it.

    ``rank_buffers`` (any rank): Python objects too rich for JSON that live on that rank (a rollout rank's
    in-flight partial rollouts); pickled with ``torch.save``.
    """
    engines = roles.trained_engines()
    with manager.saving(step) as tmp:
        for role in TRAINED_ROLES:
            if role not in world.roles:
                continue
            engine = engines[role]
            if engine is not None:
                engine.save_checkpoint(str(tmp / role), tag=DS_TAG)
            else:
                TrainEngine.mirror_save_collectives()
        save_rank_rng(tmp, world.rank)
        fault_point("checkpoint_write", step, world.rank)  # the engine states are written, nothing is committed
        if controller is not None:
            controller.write(tmp)
        if layout is not None:
            write_layout(tmp, layout)
        if rank_buffers is not None:
            torch.save(rank_buffers, tmp / f"rank_buffers_{world.rank}.pt")
    log.info("checkpoint step %d saved to %s", step, manager.step_dir(step))


def restore(manager: CheckpointManager, roles: Roles, world: WorldGroups,
            layout: CheckpointLayout) -> Restored:
    """Load ``LATEST`` into this rank's engines and RNG; return the step and what the trainer restores itself.

    ``layout``: this run's. A checkpoint saved with another layout loads through DeepSpeed's universal checkpoint
    (converted once, by rank 0); one of another model or LoRA adapter raises ``CheckpointLayoutError`` on every rank.
    Step 0 means no checkpoint was found and the run starts fresh.
    """
    latest = agreed_checkpoint(manager)  # verified, and the same on every rank
    if latest is None:
        log.warning("ckpt.load=true but no complete checkpoint under %s: starting fresh", manager.root)
        return Restored(step=0, controller=None, rank_buffers=None, same_world=True)
    saved = read_layout(latest)
    # A checkpoint from before layouts were recorded loads as saved (DeepSpeed refuses a mismatch itself).
    change = compare_layouts(saved, layout, latest) if saved is not None else None
    if change is not None and not change.exact and world.rank == 0:
        log.warning("checkpoint %s was saved with another layout: %s", latest, "; ".join(change.notes))
    resharded = change.resharded if change is not None else ()
    engines = roles.trained_engines()
    for role in TRAINED_ROLES:
        engine = engines[role]
        if role in resharded:
            load_resharded(engine, latest, role, latest / role, DS_TAG)
            continue
        if engine is not None:
            engine.load_checkpoint(str(latest / role), tag=DS_TAG)
    same_world = change is None or change.same_world
    if same_world:
        load_rank_rng(latest, world.rank)
    rank_file = latest / f"rank_buffers_{world.rank}.pt"
    # Our own pickle (trajectories), written by this rank of the run being resumed (another world's rank
    # numbering hosts other roles: its in-flight rollouts are dropped, as the layout note says).
    rank_buffers = torch.load(rank_file, weights_only=False) if same_world and rank_file.is_file() else None
    controller = ControllerCheckpoint.read(latest) if world.rank == 0 else None
    step_box = [controller.step if controller is not None else None]
    dist.broadcast_object_list(step_box, src=0)
    log.info("resumed from %s (step %d)", latest, step_box[0])
    return Restored(step=int(step_box[0] or 0), controller=controller, rank_buffers=rank_buffers,
                    same_world=same_world)
