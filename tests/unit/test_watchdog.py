"""Watchdog: stack dumps with the rank id on a stall, optional exit, C backstop when the GIL is held."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_rlhf.resilience.watchdog import STALL_EXIT_CODE, Watchdog

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: float = 30, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_stall_dumps_all_threads_with_rank_and_exits():
    start = time.monotonic()
    proc = _run("""
        import threading, time
        from hpc_rlhf.resilience.watchdog import Watchdog
        def helper_waits_here():
            time.sleep(60)
        threading.Thread(target=helper_waits_here, name="helper", daemon=True).start()
        wd = Watchdog(0.5, exit_code=7).start()
        for _ in range(3):
            time.sleep(0.1)
            wd.beat()
        def main_is_stuck_here():
            time.sleep(60)
        main_is_stuck_here()
    """, env={"SLURM_PROCID": "3"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 7, proc.stderr
    assert elapsed < 20
    err = proc.stderr
    assert "[rank 3] watchdog: no progress for" in err and "3 beats so far" in err
    assert "main_is_stuck_here" in err and "helper_waits_here" in err  # every thread's stack
    assert "[rank 3] watchdog: end of stacks" in err


def test_beats_keep_it_quiet_and_stop_is_clean():
    proc = _run("""
        import time
        from hpc_rlhf.resilience.watchdog import Watchdog
        with Watchdog(0.4, rank=1, exit_code=9) as wd:
            for _ in range(12):
                time.sleep(0.1)
                wd.beat()
        time.sleep(1.0)  # stopped: a long pause after stop() must not fire
        print("done")
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "done"
    assert "watchdog" not in proc.stderr


def test_without_exit_code_dumps_once_per_stall_and_recovers():
    buf = io.StringIO()
    wd = Watchdog(0.2, rank=5, stream=buf, backstop=False).start()
    try:
        time.sleep(0.7)  # one stall -> exactly one dump
        assert wd.num_dumps == 1
        wd.beat()
        time.sleep(0.5)  # a second stall after the beat -> a second dump
        assert wd.num_dumps == 2
    finally:
        wd.stop()
    text = buf.getvalue()
    assert text.count("[rank 5] watchdog: no progress") == 2
    assert "test_without_exit_code_dumps_once_per_stall_and_recovers" in text


def test_backstop_fires_when_the_gil_is_held():
    # A pathological regex runs in C without releasing the GIL: the Python thread cannot run, the
    # faulthandler timer (C thread) still dumps and exits.
    start = time.monotonic()
    proc = _run("""
        import re
        from hpc_rlhf.resilience.watchdog import Watchdog
        Watchdog(0.3, exit_code=5, backstop_factor=2.0).start()
        re.match(r"(a+)+$", "a" * 40 + "b")
    """)
    assert time.monotonic() - start < 20
    assert proc.returncode == 1, proc.stderr  # faulthandler's exit code
    # backstop at max(2 x 0.3, 0.3 + 1) = 1.3 s; the stack shows where the main thread is stuck
    assert "Timeout (0:00:01.3" in proc.stderr and " in match" in proc.stderr


def test_rejects_non_positive_timeout():
    with pytest.raises(ValueError, match="> 0"):
        Watchdog(0)
    assert STALL_EXIT_CODE == 124


RANK_1 = """
import sys, time
from hpc_rlhf.resilience.watchdog import Watchdog
wd = Watchdog(60, rank=1, backstop=False, heartbeat_dir=sys.argv[1], world_size=2).start()
while True:
    wd.beat()
    time.sleep(0.1)
"""


def test_rank_0_names_the_rank_that_stopped_checking_in(tmp_path):
    beats = tmp_path / "heartbeats"
    other = subprocess.Popen([sys.executable, "-c", RANK_1, str(beats)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 30
        while not (beats / "rank_1").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(other.pid, signal.SIGSTOP)  # a hung node: alive, silent
        buf = io.StringIO()
        wd = Watchdog(3.0, rank=0, stream=buf, backstop=False, heartbeat_dir=beats, world_size=2)
        wd.STALE_AFTER_S = 2.0
        wd.start()
        deadline = time.monotonic() + 30
        while wd.num_dumps == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        wd.stop()
    finally:
        other.kill()
        other.wait()
    text = buf.getvalue()
    assert "[rank 0] watchdog: rank 1 stopped checking in" in text, text[:2000]
    assert "rank 0 stopped" not in text


def test_a_firing_rank_makes_its_peer_dump_and_names_the_stopped_rank(tmp_path):
    """Rank 1 fires (its limit is short); rank 0, still beating, sees the fresh dump and dumps too, into hang/."""
    code = """
        import sys, time
        from hpc_rlhf.resilience.watchdog import Watchdog
        rank, limit = int(sys.argv[1]), float(sys.argv[2])
        wd = Watchdog(limit, rank=rank, exit_code=124, heartbeat_dir=sys.argv[3] + "/hb", world_size=3,
                      hang_dir=sys.argv[3] + "/hang", phase="train").start()
        for _ in range(600):
            time.sleep(0.1)
            if rank == 0:
                wd.beat()
    """
    def start(rank, limit):
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(rank), str(limit), str(tmp_path)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # rank 2 checked in once, long ago: a stopped process
    (tmp_path / "hb").mkdir()
    (tmp_path / "hb" / "rank_2").write_text(f"3 {time.time() - 60:.3f} 1 elsewhere\n")
    procs = [start(0, 600), start(1, 3)]
    for proc in procs:
        proc.wait(timeout=60)
    assert [p.returncode for p in procs] == [STALL_EXIT_CODE, STALL_EXIT_CODE]
    dump0 = (tmp_path / "hang" / "rank0.txt").read_text()
    assert "rank 1's watchdog fired in phase 'train'" in dump0 and "end of stacks" in dump0
    assert "no progress for" in (tmp_path / "hang" / "rank1.txt").read_text()
    summary = (tmp_path / "hang" / "summary.txt").read_text()
    assert "phase: train" in summary and "rank 2 stopped checking in" in summary
    assert not (tmp_path / "hang" / "rank2.txt").exists()
