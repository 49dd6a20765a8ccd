"""Resource limits for one execution of untrusted code, applied as rlimits in the child before ``exec``.

The limits bound what one sample can take from the node: CPU seconds, address space, bytes written to any
file (stdout and stderr are files too, so this also caps output), open files and processes. The wall-clock
limit is enforced by the parent (it kills the whole process group); it is here so one object describes a run.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

# Unprivileged user and group the code runs as when the trainer is root (CI runs as root; an rlimit on
# processes does not bind root, so root must not run model-written code). 65534 is "nobody" on Linux.
NOBODY_ID = 65534


@dataclass(frozen=True)
class SandboxLimits:
    """Per-execution limits. Every field must be positive."""

    wall_time_s: float = 10.0  # wall clock; the whole process group is killed after it
    cpu_time_s: int = 10  # RLIMIT_CPU: SIGXCPU, then SIGKILL
    memory_mb: int = 1024  # RLIMIT_AS (address space, so a bit above the resident size a program needs)
    output_bytes: int = 1 << 20  # stdout and stderr each; also RLIMIT_FSIZE, the largest file it may write
    open_files: int = 64  # RLIMIT_NOFILE
    processes: int = 32  # RLIMIT_NPROC inside the sandbox's own user namespace (bwrap level only)

    def __post_init__(self) -> None:
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "output_bytes", "open_files", "processes"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")


def rlimit_setter(limits: SandboxLimits, run_as_id: int | None) -> Callable[[], None]:
    """A ``preexec_fn`` that applies ``limits`` (all but the process count) and drops to ``run_as_id`` if set.

    It runs in the forked child before ``exec``: the limits are inherited by everything the code starts.
    RLIMIT_NPROC is not set here: outside a user namespace it counts every process and thread of the user (the
    trainer's included, and every concurrent sample's), so a small limit would fail at random. Since Linux
    5.14 the count is kept per user namespace, so the bwrap level sets it inside the sandbox (``prlimit``), where
    it counts the sample's own processes only.
    """

    def apply() -> None:
        memory = limits.memory_mb * (1 << 20)
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_time_s, limits.cpu_time_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_bytes, limits.output_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if run_as_id is not None:
            os.setgroups([])
            os.setgid(run_as_id)
            os.setuid(run_as_id)

    return apply
