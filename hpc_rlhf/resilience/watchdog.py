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

Where it goes: with ``hang_dir`` each rank also writes its dump to ``hang_dir/rank<N>.txt`` (plus ``py-spy dump``
of itself when py-spy is installed, which shows C frames Python's own dump cannot), and the first rank to fire
makes the others dump too: each watchdog thread looks for a fresh ``rank<N>.txt`` of another rank about once a
second, so every rank that can still run leaves its stacks before the launcher tears the job down. Rank 0 (or,
if rank 0 is the silent one, the rank that finds it so) writes ``hang_dir/summary.txt``: the phase, its limit
and the ranks that had not checked in. With ``HPC_RLHF_STALL_FILE`` set (``slurm/launch.sh`` does) the firing
rank also touches that file, since srun's exit status is that of the rank it killed last, not 124.

Limits per phase: :meth:`Watchdog.set_limit` changes the timeout and names the phase (see
``hpc_rlhf.resilience.stall_limits``); it counts as a beat.

Imports no torch: the rank comes from the launcher's variables unless given.
"""

from __future__ import annotations

import faulthandler
import io
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NamedTuple, TextIO

STALL_EXIT_CODE = 124  # like coreutils `timeout`: "no progress within the limit"
STALL_FILE_ENV = "HPC_RLHF_STALL_FILE"  # touched when a watchdog fires (slurm/launch.sh requeues on it)
PEER_DUMP_GRACE_S = 5.0  # how long a firing rank waits for the other live ranks' dumps before exiting


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


class _Heartbeat(NamedTuple):
    """One rank's heartbeat file: ``beats time [pid host]``."""

    beats: int
    time: float
    pid: int | None = None
    host: str | None = None

    @classmethod
    def parse(cls, fields: list[str]) -> _Heartbeat:
        if len(fields) >= 4:
            return cls(int(fields[0]), float(fields[1]), int(fields[2]), fields[3])
        return cls(int(fields[0]), float(fields[1]))


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
        hang_dir: where each rank writes ``rank<N>.txt`` when it fires (and rank 0 ``summary.txt``); a fresh
            dump of another rank there makes this rank dump and exit too.
        phase: the name of what the rank is doing, reported in the dump (see :meth:`set_limit`).
    """

    HEARTBEAT_INTERVAL_S = 1.0
    STALE_AFTER_S = 5.0  # no heartbeat for this long: the rank's process has stopped

    def __init__(self, timeout_s: float, *, rank: int | None = None, exit_code: int | None = None,
                 stream: TextIO | None = None, backstop: bool = True, backstop_factor: float = 2.0,
                 name: str = "watchdog", heartbeat_dir: str | Path | None = None,
                 world_size: int | None = None, hang_dir: str | Path | None = None, phase: str = "step") -> None:
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
        self.phase = phase
        self.hang_dir = Path(hang_dir) if hang_dir is not None else None
        self._started_wall = time.time()
        self.heartbeat_dir = Path(heartbeat_dir) if heartbeat_dir is not None else None
        self.world_size = world_size
        if self.heartbeat_dir is not None:
            self.heartbeat_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ public
    def start(self) -> Watchdog:
        if self._thread is not None:
            return self
        self._last_beat = time.monotonic()
        self._started_wall = time.time()
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

    def set_limit(self, timeout_s: float, phase: str) -> None:
        """Enter ``phase`` with its own limit (counts as progress: the clock restarts)."""
        if timeout_s <= 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self._backstop_s = max(2 * self.timeout_s, self.timeout_s + 1.0)
        self.phase = phase
        self.beat()

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
            tmp.write_text(f"{self._num_beats} {time.time():.3f} {os.getpid()} {socket.gethostname()}\n")
            os.replace(tmp, self.heartbeat_dir / f"rank_{self.rank}")
        except OSError:  # a full or vanished filesystem must not kill the watchdog thread
            pass

    def silent_ranks(self) -> list[str]:
        """From the heartbeat files: one line per rank that stopped checking in or is behind in beats."""
        if self.heartbeat_dir is None or not self.world_size:
            return []
        now = time.time()
        seen: dict[int, _Heartbeat | None] = {}
        for r in range(self.world_size):
            try:
                fields = (self.heartbeat_dir / f"rank_{r}").read_text().split()
                seen[r] = _Heartbeat.parse(fields)
            except (OSError, ValueError, IndexError):
                seen[r] = None
        most = max((v.beats for v in seen.values() if v), default=0)
        lines = []
        for r, value in seen.items():
            if value is None:
                lines.append(f"rank {r} never checked in")
            elif value.pid is not None and value.host == socket.gethostname() and not _pid_alive(value.pid):
                lines.append(f"rank {r} is dead: its process (pid {value.pid} on {value.host}) no longer exists")
            elif now - value.time > self.STALE_AFTER_S:
                lines.append(f"rank {r} stopped checking in {now - value.time:.0f}s ago (after {value.beats} beats): "
                             "its process is stopped or its node is unresponsive")
            elif value.beats < most:
                lines.append(f"rank {r} is behind: {value.beats} beats, others up to {most}")
        return lines

    def _run(self) -> None:
        next_check_in = 0.0
        while not self._stop.is_set():
            if time.monotonic() >= next_check_in:
                self._check_in()
                next_check_in = time.monotonic() + self.HEARTBEAT_INTERVAL_S
                fired = None if self._stalled else self._peer_that_fired()
                if fired is not None:
                    self._fire(f"rank {fired}'s watchdog fired")
                    continue
            idle = time.monotonic() - self._last_beat
            if idle < self.timeout_s or self._stalled:
                wait = min(max(self.timeout_s - idle, 0.05), 1.0) if not self._stalled else 0.5
                self._stop.wait(min(wait, self.HEARTBEAT_INTERVAL_S))
                continue
            self._fire(None, idle)

    def _fire(self, cause: str | None, idle: float | None = None) -> None:
        """Dump (to the stream and ``hang_dir``), then exit with ``exit_code`` once the live peers dumped too."""
        self._stalled = True
        self.dump(idle, cause=cause)
        if self.exit_code is None:
            return
        stall_file = os.environ.get(STALL_FILE_ENV)
        if stall_file:
            try:
                Path(stall_file).parent.mkdir(parents=True, exist_ok=True)
                Path(stall_file).write_text(f"rank {self.rank} phase {self.phase} at {time.time():.0f}\n")
            except OSError:
                pass
        self._wait_for_peer_dumps()
        os._exit(self.exit_code)

    def _fresh_dumps(self) -> set[int]:
        """Ranks with a ``rank<N>.txt`` in ``hang_dir`` written since this watchdog started."""
        if self.hang_dir is None or not self.hang_dir.is_dir():
            return set()
        found = set()
        for path in self.hang_dir.glob("rank*.txt"):
            try:
                if path.stat().st_mtime >= self._started_wall and path.stem[4:].isdigit():
                    found.add(int(path.stem[4:]))
            except OSError:
                continue
        return found

    def _peer_that_fired(self) -> int | None:
        others = self._fresh_dumps() - {self.rank}
        return min(others) if others else None

    def _wait_for_peer_dumps(self) -> None:
        """Give ranks that still check in a moment to write their stacks before this exit ends the job."""
        if self.hang_dir is None or self.heartbeat_dir is None or not self.world_size:
            return
        deadline = time.monotonic() + PEER_DUMP_GRACE_S
        silent = {int(line.split()[1]) for line in self.silent_ranks() if "behind" not in line}
        while time.monotonic() < deadline:
            if set(range(self.world_size)) - silent <= self._fresh_dumps():
                return
            time.sleep(0.2)

    def dump(self, idle_s: float | None = None, cause: str | None = None) -> None:
        """Write the header and every thread's stack to the stream (and to ``hang_dir/rank<N>.txt``)."""
        idle = time.monotonic() - self._last_beat if idle_s is None else idle_s
        action = f"exiting with code {self.exit_code}" if self.exit_code is not None else "still waiting"
        reason = cause or f"no progress for {idle:.1f}s (limit {self.timeout_s:g}s)"
        header = (f"[rank {self.rank}] watchdog: {reason} in phase {self.phase!r} ({self._num_beats} beats so far, "
                  f"pid {os.getpid()}); stacks of every thread follow; {action}\n")
        silent = self.silent_ranks()
        if self.rank == 0:
            if silent:
                header += "".join(f"[rank {self.rank}] watchdog: {line}\n" for line in silent)
            elif self.heartbeat_dir is not None:
                header += f"[rank {self.rank}] watchdog: every rank is still checking in and none is behind\n"
        self.num_dumps += 1
        self._write_dump(self._stream or sys.stderr, header)
        if self.hang_dir is None:
            return
        try:
            self.hang_dir.mkdir(parents=True, exist_ok=True)
            if self.rank == 0 or any(line.startswith("rank 0 ") for line in silent):
                summary = self.hang_dir / "summary.txt"
                if not summary.exists() or summary.stat().st_mtime < self._started_wall:
                    summary.write_text(f"watchdog fired on rank {self.rank}: {reason}\nphase: {self.phase}\n"
                                       f"ranks that had not checked in or were behind:\n"
                                       + ("".join(f"  {line}\n" for line in silent) or "  none\n"))
            with open(self.hang_dir / f".rank{self.rank}.txt.tmp", "w") as f:
                self._write_dump(f, header)
                f.write(_py_spy_dump())
            os.replace(self.hang_dir / f".rank{self.rank}.txt.tmp", self.hang_dir / f"rank{self.rank}.txt")
        except OSError:  # a full or vanished filesystem must not keep the rank from exiting
            pass

    def _write_dump(self, stream: TextIO, header: str) -> None:
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _py_spy_dump() -> str:
    """``py-spy dump`` of this process (Python and native frames of every thread) if py-spy is installed."""
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        proc = subprocess.run([exe, "dump", "--native", "--pid", str(os.getpid())], capture_output=True, text=True,
                              check=False, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"\npy-spy dump failed: {exc}\n"
    return f"\npy-spy dump --native (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}"
