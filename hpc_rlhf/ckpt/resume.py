"""Which checkpoint a resuming job loads: decided once, on rank 0, and broadcast so every rank loads the same one.

Each rank verifying on its own could disagree (a file still being repaired, a flaky network filesystem), and
ranks restoring different steps would train on silently mixed state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from hpc_rlhf.ckpt.atomic import CheckpointManager

log = logging.getLogger(__name__)


def agreed_checkpoint(manager: CheckpointManager) -> Path | None:
    """The newest checkpoint under ``manager.root`` that verifies (None: nothing to load); collective over the
    world. Rank 0's error (no checkpoint verifies) is raised on every rank, so no rank waits for the others."""
    box: list[str | None] = [None, None]  # (path, error)
    if dist.get_rank() == 0:
        try:
            chosen = manager.latest_verified()
            box[0] = None if chosen is None else str(chosen)
        except RuntimeError as err:
            box[1] = str(err)
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise RuntimeError(box[1])
    return None if box[0] is None else Path(box[0])


def warn_if_starting_over(manager: CheckpointManager) -> None:
    """For ``ckpt.load=false``: rank 0 warns when ``manager.root`` already holds checkpoints, since this run starts
    from scratch and its checkpoints will share the directory with them (LATEST moves to this run's)."""
    complete = manager.list_complete() if manager.rank == 0 else []
    if complete:
        log.warning("ckpt.load=false, but %s holds %d checkpoint(s) of an earlier run (newest %s): this run starts "
                    "from scratch and saves next to them, and LATEST will name this run's. Set ckpt.load=true to "
                    "resume that run, or point ckpt.path elsewhere", manager.root, len(complete), complete[-1][1].name)
