"""Checkpoints: atomic step directories, the LATEST pointer, rotation, per-rank RNG state.

``hpc_rlhf.ckpt`` imports no torch; the RNG helpers (which need torch) load on first use.
"""

from __future__ import annotations

from typing import Any

from hpc_rlhf.ckpt.atomic import (
    COMPLETE_NAME,
    LATEST_NAME,
    CheckpointManager,
    CheckpointSpaceError,
    atomic_write_bytes,
    atomic_write_text,
    is_complete,
    load_json,
    read_manifest,
    save_json_atomic,
    verify_checkpoint,
)

_RNG_NAMES = ("capture_rng_state", "restore_rng_state", "save_rank_rng", "load_rank_rng")

__all__ = [
    "COMPLETE_NAME", "LATEST_NAME", "CheckpointManager", "CheckpointSpaceError", "atomic_write_bytes",
    "atomic_write_text", "is_complete", "load_json", "read_manifest", "save_json_atomic", "verify_checkpoint",
    *_RNG_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _RNG_NAMES:
        from hpc_rlhf.ckpt import rng  # torch: loaded on first use (see the module docstring)

        return getattr(rng, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
