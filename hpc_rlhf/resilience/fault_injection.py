"""Named points where a test can stop a rank to inject a fault (tests/faults/); free when unused.

    fault_point("generation", step, rank)

does nothing unless ``HPC_RLHF_FAULT_DIR`` is set (one environment lookup per call). With it set, and
``HPC_RLHF_FAULT_AT`` naming this point as ``<phase>:<step>:<rank>`` (or as one of several, comma-separated: a run
that is to take more than one fault, each at its own point), the rank:

1. writes ``<dir>/at_<phase>_<step>_<rank>`` (its pid and the time) -- the driver waits for this file;
2. waits until the driver removes that file (or ``HPC_RLHF_FAULT_WAIT_S`` passes), so the driver's signal
   arrives while the rank is exactly here: inside generation, training, the weight sync or a checkpoint
   write, not at a guessed moment;
3. with ``HPC_RLHF_FAULT_ACTION=enospc`` raises ``OSError(ENOSPC)`` instead of waiting: a full disk at
   that point (used inside checkpoint writes; an injected error, not a real full filesystem).

A point fires once per fault directory (the marker ``done_<phase>_<step>_<rank>`` remembers it), so a resumed
run that passes the same point again does not stop there a second time. Every rank also records its pid in
``<dir>/pid_<rank>`` at its first call, so the driver can signal all ranks.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

DIR_ENV = "HPC_RLHF_FAULT_DIR"
AT_ENV = "HPC_RLHF_FAULT_AT"
ACTION_ENV = "HPC_RLHF_FAULT_ACTION"
WAIT_ENV = "HPC_RLHF_FAULT_WAIT_S"

_registered: set[int] = set()


def armed_points(value: str | None) -> set[str]:
    """The points ``HPC_RLHF_FAULT_AT`` names: ``<phase>:<step>:<rank>``, comma-separated."""
    return {point.strip() for point in (value or "").split(",") if point.strip()}


def fault_armed(phase: str, step: int, rank: int) -> bool:
    """Whether :func:`fault_point` would stop at this point (a caller may prepare for it, e.g. hold an engine's
    generation so that the fault lands while requests are in flight)."""
    root = os.environ.get(DIR_ENV)
    if not root or f"{phase}:{step}:{rank}" not in armed_points(os.environ.get(AT_ENV)):
        return False
    return not (Path(root) / f"done_{phase}_{step}_{rank}").exists()


def fault_point(phase: str, step: int, rank: int) -> None:
    """Stop here for the fault driver if the environment names this point (see the module docstring)."""
    root = os.environ.get(DIR_ENV)
    if not root:
        return
    root_dir = Path(root)
    if rank not in _registered:
        _registered.add(rank)
        (root_dir / f"pid_{rank}").write_text(f"{os.getpid()}\n")
    if f"{phase}:{step}:{rank}" not in armed_points(os.environ.get(AT_ENV)):
        return
    name = f"{phase}_{step}_{rank}"
    done = root_dir / f"done_{name}"
    if done.exists():
        return
    done.write_text(f"{time.time():.3f}\n")
    if os.environ.get(ACTION_ENV) == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected at {phase} step {step} rank {rank})")
    marker = root_dir / f"at_{name}"
    marker.write_text(f"{os.getpid()} {time.time():.3f}\n")
    deadline = time.monotonic() + float(os.environ.get(WAIT_ENV, "120"))
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
