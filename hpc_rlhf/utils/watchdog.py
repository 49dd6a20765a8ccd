"""Progress watchdog: dump every thread's stack when a rank stops making progress.

    watchdog = Watchdog(cfg.train.watchdog_timeout_s, exit_code=STALL_EXIT_CODE).start()
    for step in ...:
        ...
        watchdog.beat()
    watchdog.stop()

A hung collective looks like silence: every rank waits for one that is stuck somewhere else. With a
watchdog on every rank, each one prints *where* it waits (``[rank N] watchdog: ...`` then the Python
stack of every thread), so the odd rank out is visible in the job log. With ``exit_code`` set the rank
then exits, and ``srun --kill-on-bad-exit=1`` ends the whole job instead of letting it idle to the
time limit (the collective timeout is usually much longer).

Two layers:
- a Python thread (daemon) checks the time since the last ``beat()``; it prints the rank header and the
  stacks (``faulthandler.dump_traceback``) and exits with ``exit_code``;
- ``faulthandler.dump_traceback_later`` as a backstop at ``backstop_factor x timeout_s``: it runs in C
  and fires even when the main thread holds the GIL in a C call (then the Python thread cannot run).
  Only one such timer exists per process, so at most one Watchdog should use it (``backstop=True``).

Which rank stopped: with ``heartbeat_dir`` (on a filesystem every rank sees) each rank's watchdog thread
writes ``rank_<N>`` there about once a second: its beat count and the time. A rank whose process stopped
altogether (frozen node, SIGSTOP, swapped out) stops writing, while ranks merely waiting in a collective keep
writing; so when rank 0's watchdog fires it names the ranks that stopped checking in, and those behind in
beats, instead of leaving the job log to the healthy ranks that exited first.

Imports no torch: the rank comes from the launcher's variables unless given.
"""

from __future__ import annotations

import faulthandler
import io
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TextIO

STALL_EXIT_CODE = 124  # like coreutils `timeout`: "no progress within the limit"


def _rank_from_env() -> int:
    for name in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _has_fileno(stream: TextIO) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation, ValueError):
        return False
    return True


class Watchdog:
    """Call :meth:`beat` after each unit of progress; a silence of ``timeout_s`` dumps the stacks.

    Args:
        timeout_s: seconds without a beat that count as a stall.
        rank: printed in the header; default from RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK.
        exit_code: if set, the process exits with it (``os._exit``) after the dump; otherwise it dumps
            once per stall and waits for the next beat.
        stream: where to write (default ``sys.stderr`` at dump time).
        backstop: arm ``faulthandler.dump_traceback_later`` at ``backstop_factor * timeout_s``.
        heartbeat_dir, world_size: where every rank checks in, and how many ranks (see the module docstring);
            rank 0's dump then names the ranks that stopped checking in.
    """

    HEARTBEAT_INTERVAL_S = 1.0
    STALE_AFTER_S = 5.0  # no heartbeat for this long: the rank's process has stopped

    def __init__(self, timeout_s: float, *, rank: int | None = None, exit_code: int | None = None,
                 stream: TextIO | None = None, backstop: bool = True, backstop_factor: float = 2.0,
                 name: str = "watchdog", heartbeat_dir: str | Path | None = None,
                 world_size: int | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.rank = _rank_from_env() if rank is None else rank
        self.exit_code = exit_code
        self._stream = stream
        self._backstop = backstop
        self._backstop_s = max(self.timeout_s * backstop_factor, self.timeout_s + 1.0)
        self._name = name
        self._last_beat = time.monotonic()
        self._num_beats = 0
        self._stalled = False  # dumped for the current stall; re-armed by the next beat
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_dumps = 0
        self.heartbeat_dir = Path(heartbeat_dir) if heartbeat_dir is not None else None
        self.world_size = world_size
        if self.heartbeat_dir is not None:
            self.heartbeat_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ public
    def start(self) -> Watchdog:
        if self._thread is not None:
            return self
        self._last_beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._arm_backstop()
        return self

    def beat(self) -> None:
        """Record progress (cheap: a time stamp, plus re-arming the C backstop)."""
        self._last_beat = time.monotonic()
        self._num_beats += 1
        self._stalled = False
        self._arm_backstop()

    def stop(self) -> None:
        self._stop.set()
        if self._backstop and self._thread is not None:
            faulthandler.cancel_dump_traceback_later()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _arm_backstop(self) -> None:
        if not self._backstop or self._thread is None or self._stop.is_set():
            return
        stream = self._stream or sys.stderr
        if _has_fileno(stream):
            faulthandler.dump_traceback_later(self._backstop_s, repeat=False, file=stream,
                                              exit=self.exit_code is not None)

    def _check_in(self) -> None:
        if self.heartbeat_dir is None:
            return
        try:  # replace, so a reader never sees a half-written file
            tmp = self.heartbeat_dir / f".rank_{self.rank}.{os.getpid()}"
            tmp.write_text(f"{self._num_beats} {time.time():.3f}\n")
            os.replace(tmp, self.heartbeat_dir / f"rank_{self.rank}")
        except OSError:  # a full or vanished filesystem must not kill the watchdog thread
            pass

    def silent_ranks(self) -> list[str]:
        """From the heartbeat files: one line per rank that stopped checking in or is behind in beats."""
        if self.heartbeat_dir is None or not self.world_size:
            return []
        now, seen = time.time(), {}
        for r in range(self.world_size):
            try:
                beats, stamp = (self.heartbeat_dir / f"rank_{r}").read_text().split()
                seen[r] = (int(beats), float(stamp))
            except (OSError, ValueError):
                seen[r] = None
        most = max((v[0] for v in seen.values() if v), default=0)
        lines = []
        for r, value in seen.items():
            if value is None:
                lines.append(f"rank {r} never checked in")
            elif now - value[1] > self.STALE_AFTER_S:
                lines.append(f"rank {r} stopped checking in {now - value[1]:.0f}s ago (after {value[0]} beats): "
                             "its process is stopped or its node is unresponsive")
            elif value[0] < most:
                lines.append(f"rank {r} is behind: {value[0]} beats, others up to {most}")
        return lines

    def _run(self) -> None:
        next_check_in = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_check_in:
                self._check_in()
                next_check_in = time.monotonic() + self.HEARTBEAT_INTERVAL_S
            idle = time.monotonic() - self._last_beat
            if idle < self.timeout_s or self._stalled:
                wait = min(max(self.timeout_s - idle, 0.05), 1.0) if not self._stalled else 0.5
                self._stop.wait(min(wait, self.HEARTBEAT_INTERVAL_S))
                continue
            self._stalled = True
            self.dump(idle)
            if self.exit_code is not None:
                os._exit(self.exit_code)

    def dump(self, idle_s: float | None = None) -> None:
        """Write the header and every thread's stack to the stream."""
        stream = self._stream or sys.stderr
        idle = time.monotonic() - self._last_beat if idle_s is None else idle_s
        action = f"exiting with code {self.exit_code}" if self.exit_code is not None else "still waiting"
        header = (f"[rank {self.rank}] watchdog: no progress for {idle:.1f}s (limit {self.timeout_s:g}s, "
                  f"{self._num_beats} beats so far, pid {os.getpid()}); stacks of every thread follow; {action}\n")
        if self.rank == 0:
            silent = self.silent_ranks()
            if silent:
                header += "".join(f"[rank {self.rank}] watchdog: {line}\n" for line in silent)
            elif self.heartbeat_dir is not None:
                header += f"[rank {self.rank}] watchdog: every rank is still checking in and none is behind\n"
        self.num_dumps += 1
        try:
            stream.write(header)
            stream.flush()
            if _has_fileno(stream):
                faulthandler.dump_traceback(file=stream, all_threads=True)
            else:  # e.g. a StringIO in tests: the same information from Python
                names = {t.ident: t.name for t in threading.enumerate()}
                for ident, frame in sys._current_frames().items():
                    stream.write(f"Thread {ident:#x} ({names.get(ident, '?')}):\n")
                    stream.write("".join(traceback.format_stack(frame)))
            stream.write(f"[rank {self.rank}] watchdog: end of stacks\n")
            stream.flush()
        except (OSError, ValueError):  # a closed stream must not kill the watchdog thread
            pass
