"""One object that bounds every phase of a trainer's run: the watchdog and the collective timeouts together.

    guard = StallGuard.from_config(cfg.train, rank, world_size)   # None-safe: a disabled guard does nothing
    guard.start()                                      # the first step's allowance
    with guard.phase("checkpoint"):                    # a save or load: its own allowance
        ...
    guard.step_done(seconds)                           # the next step: max(floor, k x slowest step)
    guard.stop()

Each phase's limit (``hpc_rlhf.resilience.stall_limits``) is both the watchdog's timeout (a rank silent for that long
dumps its stacks to ``<output_dir>/hang/`` and the job exits with 124) and, plus a margin, the collective
timeout of every process group (``hpc_rlhf.world.groups.set_collective_timeouts``): the watchdog fires first
with a diagnosis, and a collective can never outwait its phase by much even where the watchdog thread cannot
run. Start-up keeps ``train.collective_timeout_s``.

:meth:`StallGuard.explain_failure` names the peers that died or went silent when a collective fails, so a
survivor's error says which rank to look at instead of "connection reset by peer".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpc_rlhf.resilience.stall_limits import StallLimits
from hpc_rlhf.resilience.watchdog import STALL_EXIT_CODE, Watchdog
from hpc_rlhf.world.groups import set_collective_timeouts

log = logging.getLogger(__name__)
COLLECTIVE_MARGIN_S = 30.0  # the watchdog (which dumps stacks) fires before a collective times out
HANG_DIR = "hang"
HEARTBEAT_DIR = ".watchdog"


class StallGuard:
    def __init__(self, limits: StallLimits | None, output_dir: str | Path, rank: int, world_size: int) -> None:
        self.limits, self.rank = limits, rank
        output_dir = Path(output_dir)
        self.watchdog = None if limits is None else Watchdog(
            limits.first_step_s, rank=rank, exit_code=STALL_EXIT_CODE, heartbeat_dir=output_dir / HEARTBEAT_DIR,
            world_size=world_size, hang_dir=output_dir / HANG_DIR, phase="first_step")

    @classmethod
    def from_config(cls, train: Any, rank: int, world_size: int) -> StallGuard:
        """From a train section with the ``StallLimits`` fields (RL or offline); ``watchdog_timeout_s`` 0/null: off."""
        limits = None
        if train.watchdog_timeout_s:
            limits = StallLimits(floor_s=train.watchdog_timeout_s, step_factor=train.watchdog_step_factor,
                                 first_step_s=train.watchdog_first_step_s, checkpoint_s=train.watchdog_checkpoint_s,
                                 startup_s=train.collective_timeout_s)
        return cls(limits, train.output_dir, rank, world_size)

    def start(self) -> StallGuard:
        if self.watchdog is not None:
            self.watchdog.start()
            self._enter("first_step")
        return self

    def step_done(self, seconds: float) -> None:
        """A step completed in ``seconds`` (checkpoint saves excluded): the next one gets the adapted limit."""
        if self.limits is not None:
            self.limits.observe_step(seconds)
            self._enter("step")

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run the block under ``name``'s limit, then return to the step limit."""
        if self.limits is None or self.watchdog is None:
            yield
            return
        previous = self.watchdog.phase
        self._enter(name)
        yield
        self._enter("step" if previous != "first_step" else "first_step")

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def explain_failure(self, exc: BaseException, wait_s: float = 6.0) -> None:
        """After a collective failed (:func:`may_be_a_peers_failure`), log which peers are dead or silent. A peer on
        this host whose process is gone is named at once; one on another host once its heartbeat is older than the
        watchdog's staleness limit, so this waits up to ``wait_s`` for one to show. Other errors are this rank's own
        and need no peer to explain them: the rank exits at once."""
        if self.watchdog is None or not may_be_a_peers_failure(exc):
            return
        deadline = time.monotonic() + wait_s
        while True:
            # "behind in beats" is no verdict here: heartbeats are written once a second, so counts lag.
            peers = [line for line in self.watchdog.silent_ranks() if " is behind" not in line]
            if peers or time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        if peers:
            log.error("rank %d stops after %s: %s; the first error is in that rank's output (or it was killed)",
                      self.rank, type(exc).__name__, "; ".join(peers))

    def _enter(self, phase: str) -> None:
        if self.limits is None or self.watchdog is None:  # both or neither: no watchdog configured
            return
        limit = self.limits.for_phase(phase)
        self.watchdog.set_limit(limit, phase)
        set_collective_timeouts(limit + COLLECTIVE_MARGIN_S)


def may_be_a_peers_failure(exc: BaseException) -> bool:
    """Whether ``exc`` may be a collective that failed because a peer died or stopped: torch.distributed's own errors
    (``DistError``: backend, network, store) and gloo's, which are plain RuntimeError instances ("Connection closed
    by peer", "Timed out waiting"). This project's errors derived from RuntimeError (a reward function that raised, an
    engine past its restart bound, a worker's reported failure) already name their cause: waiting seconds for a peer
    to explain them only delays the job's end."""
    return isinstance(exc, dist.DistError) or type(exc) is RuntimeError
