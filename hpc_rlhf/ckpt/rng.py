"""Capture and restore every RNG that shapes the future of a rank: python, numpy, torch CPU, torch CUDA.

Each rank saves its own ``rng_rank<k>.pt`` into the checkpoint directory, so a resumed run draws the same
numbers on every rank (dropout masks, sampling, shuffles) as the uninterrupted run would have.

The saved state holds only types the ``torch.load(weights_only=True)`` unpickler accepts (tensors, ints,
floats, strings, tuples, lists, dicts, None): numpy's key array is stored as a tensor. So loading needs no
``weights_only=False``, and a tampered file cannot execute code on load.
"""

from __future__ import annotations

import logging
import os
import random
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture_rng_state() -> dict[str, Any]:
    """The current state of python ``random``, numpy's global RNG, torch CPU and (if present) all CUDA devices."""
    np_state = np.random.get_state(legacy=True)
    if isinstance(np_state, dict):  # the legacy tuple exists for an MT19937 global generator only
        raise RuntimeError(f"numpy's global RNG uses {np_state.get('bit_generator')}, not MT19937: its state cannot "
                           "be checkpointed")
    np_kind, np_keys, np_pos, np_has_gauss, np_cached = np_state
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(np_kind), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_cached)},
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`. CUDA states are restored for as many devices as both sides have."""
    py = state["python"]
    # torch.load may hand tuples back as lists; random.setstate needs the exact nested tuple shape.
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    cuda_states = state.get("torch_cuda")
    if cuda_states:
        if not torch.cuda.is_available():
            log.warning("checkpoint has CUDA RNG state for %d devices but CUDA is not available; not restored",
                        len(cuda_states))
            return
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            log.warning("checkpoint has CUDA RNG state for %d devices, this process sees %d; restoring %d",
                        len(cuda_states), count, min(count, len(cuda_states)))
        for device, device_state in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(device_state, device)


def rng_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rng_rank{rank}.pt"


def save_rank_rng(directory: str | Path, rank: int) -> Path:
    """Write this rank's RNG state to ``<directory>/rng_rank<rank>.pt`` (temp file + rename)."""
    path = rng_file(directory, rank)
    tmp = path.with_name(f".tmp_{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    try:
        torch.save(capture_rng_state(), tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_rank_rng(directory: str | Path, rank: int, restore: bool = True) -> dict[str, Any]:
    """Read ``<directory>/rng_rank<rank>.pt`` (restoring it into this process unless ``restore=False``).

    A resume with a different number of ranks has no file for new ranks: that raises FileNotFoundError naming
    the file, and the caller decides whether seeding afresh is acceptable.
    """
    path = rng_file(directory, rank)
    if not path.is_file():
        raise FileNotFoundError(f"no RNG state for rank {rank}: {path} does not exist (was the checkpoint written "
                                f"with fewer ranks?)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if restore:
        restore_rng_state(state)
    return state
