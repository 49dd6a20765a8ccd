"""A real local SLURM (``bash .ci/setup_slurm.sh``): helpers to submit and wait; skip when absent."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.slurm)


def _controller_problem() -> str | None:
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "SLURM is not installed (no sinfo/sbatch); run: sudo bash .ci/setup_slurm.sh"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s (slurmctld not responding)"
    if out.returncode != 0:
        return f"slurmctld is not responding ({out.stderr.strip()}); run: sudo bash .ci/setup_slurm.sh"
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    if "debug*" not in states and "debug" not in states:
        return f"no partition 'debug' (sinfo: {out.stdout.strip()!r}); run: sudo bash .ci/setup_slurm.sh"
    state = states.get("debug*", states.get("debug", ""))
    if not state.startswith(("idle", "mix", "alloc", "compl")):
        return f"partition debug's node is {state!r}, not usable"
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    problem = _controller_problem()
    if problem:
        pytest.skip(problem)


def sbatch(*args: str) -> str:
    """Submit; return the job id. Every job runs in the repository root."""
    out = subprocess.run(["sbatch", "--parsable", "--chdir", str(ROOT), *args], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"sbatch failed: {out.stderr}"
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show job`` as a dict ({} once the controller forgot the job). No sacct here."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


def wait_job(job_id: str, timeout_s: float, log: Path | None = None) -> dict[str, str]:
    """Poll until the job reaches a final state; cancel it and fail if it takes longer than timeout_s."""
    deadline = time.monotonic() + timeout_s
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in FINAL:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], check=False)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else "(no log)"
    pytest.fail(f"job {job_id} not finished after {timeout_s:.0f}s (state {info.get('JobState')}); log tail:\n{tail}")


def read_log(log: Path) -> str:
    """A job's log so far ('' before it exists); progress bars of two ranks interleave mid-character in it."""
    return log.read_text(errors="replace") if log.exists() else ""


def wait_for_state(job_info: Callable[[str], dict[str, str]], job_id: str, state: str, log: Path,
                   timeout_s: float) -> dict[str, str]:
    """Poll ``job_info`` (the cluster's ``scontrol show job``) until the job is in ``state``; fail with its state,
    reason and log tail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(job_id)
        if info.get("JobState") == state:
            return info
        assert time.monotonic() < deadline, (f"job {job_id} not {state} after {timeout_s:.0f}s "
                                             f"({info.get('JobState')}, {info.get('Reason')}): "
                                             + read_log(log)[-3000:])
        time.sleep(0.2)


# A time limit of one minute whose warning comes at least 15 s after the start (--signal=USR1@45): by then every
# task has set its trap. With @55 it came as early as 5 s in, and once reached a Python task of a loaded machine
# before the task had installed its handler.
TIME_LIMIT_OPTIONS = ("#SBATCH --time=1", "#SBATCH --signal=USR1@45")
# One task of the time-limit job: its trap is the first thing it runs. `sleep` gets the step's USR1 too and dies;
# the loop goes on until bash runs the trap.
TIME_LIMIT_TASK = """#!/bin/bash
trap 'echo "task $SLURM_PROCID on $(hostname) got USR1"; exit 0' USR1
while [ "$SECONDS" -lt 58 ]; do sleep 0.2; done
echo "no signal"
exit 3
"""


def write_time_limit_job(folder: Path, *options: str) -> Path:
    """A batch script (more ``#SBATCH`` ``options``) whose srun tasks wait for the scheduler's time-limit signal
    with nothing to compute. Without ``B:`` the signal goes to the step's tasks, not the batch shell: each task
    prints ``task N on HOST got USR1``, the shell ``batch done`` (and ``batch shell got USR1`` if it were
    signalled)."""
    task = folder / "probe.sh"
    task.write_text(TIME_LIMIT_TASK)
    task.chmod(0o755)
    script = folder / "sig.sbatch"
    script.write_text("\n".join(["#!/bin/bash", *TIME_LIMIT_OPTIONS, *options,
                                 "trap 'echo batch shell got USR1' USR1",
                                 f"srun --kill-on-bad-exit=1 {task}", "echo batch done", ""]))
    return script
