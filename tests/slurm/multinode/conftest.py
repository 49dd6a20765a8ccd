"""The several-node SLURM cluster of ``.ci/setup_multinode.sh``: each node a network namespace with its own
address, host name, /tmp and slurmd. This process is the login node (the root namespace): it submits with
``SLURM_CONF`` pointing at that cluster. The nodes' /tmp is their own, so everything a job and this test both read
lives under a shared directory (``shared_dir``), as on a cluster's shared filesystem."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ..conftest import FINAL, ROOT, read_log

MULTINODE_CONF = "/etc/slurm-multinode/slurm.conf"
NODES = ("hpcmn1", "hpcmn2")
ADDRESSES = {"hpcmn1": "10.77.0.11", "hpcmn2": "10.77.0.12", "hpcmnx": "10.77.0.13"}
OUTSIDER = "hpcmnx"  # a namespace on the same bridge with no slurmd: another user's node
SHARED_ROOT = Path("/var/tmp/hpc-rlhf-multinode")
TWO_NODES = ["-p", "nodes", "-N", "2", "--ntasks-per-node=1"]  # sbatch: one task on each node


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.multinode)


def slurm_env() -> dict[str, str]:
    """This process's environment, talking to the several-node cluster."""
    return {**os.environ, "SLURM_CONF": MULTINODE_CONF}


def slurm(*args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=slurm_env())
    if check:
        assert out.returncode == 0, f"{' '.join(args)}: {out.stderr}"
    return out


def node_states() -> dict[str, str]:
    out = slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False)
    return dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)


def _cluster_problem() -> str | None:
    if os.geteuid() != 0 or not Path(MULTINODE_CONF).exists() or shutil.which("sinfo") is None:
        return "the several-node cluster is not up; run (as root): bash .ci/setup_multinode.sh"
    try:
        states = node_states()
    except subprocess.TimeoutExpired:
        return "its slurmctld did not answer within 30 s"
    for node in NODES:
        if not states.get(node, "").startswith(("idle", "mix", "alloc", "compl")):
            return f"node {node} is {states.get(node)!r}, not usable (sinfo with SLURM_CONF={MULTINODE_CONF})"
    return None


@pytest.fixture(scope="session")
def multinode_cluster() -> None:
    problem = _cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every node and this test see (the nodes' /tmp is their own)."""
    path = SHARED_ROOT / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def sbatch(*args: str) -> str:
    """Submit to the several-node cluster from the repository root; return the job id."""
    out = slurm("sbatch", "--parsable", "--chdir", str(ROOT), *args, timeout=60)
    return out.stdout.strip().split(";")[0]


def job_info(job_id: str) -> dict[str, str]:
    out = slurm("scontrol", "show", "job", "-o", job_id, check=False)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout)) if out.returncode == 0 else {}


def wait_job(job_id: str, timeout_s: float, log: Path | None = None) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in FINAL:
            return info
        time.sleep(0.5)
    slurm("scancel", job_id, check=False)
    tail = log.read_text(errors="replace")[-3000:] if log and log.exists() else "(no log)"
    pytest.fail(f"job {job_id} not finished after {timeout_s:.0f}s (state {info.get('JobState')}); log tail:\n{tail}")


def slurmd_pid(node: str) -> str:
    """The pid of ``node``'s slurmd (its pid file is in the node's own /run; the setup links it here)."""
    return Path(f"/run/slurm/slurmd-multinode-{node}.pid").read_text().strip()


def on_node(node: str) -> list[str]:
    """The command prefix that runs what follows on ``node`` as a user logged in there would: in its slurmd's
    network, host-name and mount namespaces (its /tmp, /run, spool and /etc/hosts)."""
    return ["nsenter", "-t", slurmd_pid(node), "-n", "-u", "-m"]


def in_node(node: str, *command: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run a command on a node (:func:`on_node`) and wait for it."""
    return subprocess.run([*on_node(node), *command], capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def wait_for_steps(job: str, metrics: Path, log: Path, at_least: int, restarts: int, timeout_s: float = 240) -> None:
    """Until the job is RUNNING after ``restarts`` restarts with at least ``at_least`` steps logged."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = job_info(job)
        lines = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if lines >= at_least and info.get("Restarts") == str(restarts) and info.get("JobState") == "RUNNING":
            return
        assert time.monotonic() < deadline, f"no progress to step {at_least}: " + read_log(log)[-3000:]
        assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), read_log(log)[-3000:]
        time.sleep(0.05)


def rank_pids(run: Path) -> list[int]:
    """PIDs of this run's rank processes on every node (no PID namespaces here: all are visible from the root)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        is_python = Path(cmdline[0].decode(errors="replace")).name.startswith("python")  # not srun's own process
        if is_python and b"hpc_rlhf.cli.train_ppo" in cmdline and f"train.output_dir={run}".encode() in cmdline:
            pids.append(int(proc.name))
    return pids


class WatchedJob:
    """A job submitted ahead of the test that checks it, so that it runs beside the tests before. A thread of this
    process keeps its final ``scontrol`` record (slurmctld forgets a finished job after MinJobAge, 300 s here), after
    running ``while_running(job)`` (a check that needs the job's processes) once it has logged its first step to
    ``metrics``."""

    def __init__(self, job: str, log: Path, timeout_s: float, metrics: Path | None = None,
                 while_running: Callable[[WatchedJob], None] | None = None):
        self.job, self.log, self.timeout_s = job, log, timeout_s
        self.metrics, self.while_running = metrics, while_running
        self.seen: dict[str, list[str]] = {}  # what while_running recorded
        self.info: dict[str, str] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        try:
            deadline = time.monotonic() + self.timeout_s
            if self.while_running is not None and self.metrics is not None:
                wait_for_steps(self.job, self.metrics, self.log, at_least=1, restarts=0, timeout_s=self.timeout_s)
                self.while_running(self)
            while time.monotonic() < deadline:
                info = job_info(self.job)
                if info.get("JobState") in FINAL:
                    self.info = info
                    return
                time.sleep(0.5)
        except BaseException as err:  # noqa: BLE001 - result() raises it in the test
            self.error = err

    def result(self) -> dict[str, str]:
        """The job's final record; fails the test when the job did not end in time or the check failed."""
        self.thread.join(self.timeout_s)
        if self.error is not None:
            raise self.error
        if self.info is None:
            slurm("scancel", self.job, check=False)
            pytest.fail(f"job {self.job} not finished after {self.timeout_s:.0f}s; log tail:\n"
                        + read_log(self.log)[-3000:])
        return self.info

    def cancel(self) -> None:
        if job_info(self.job).get("JobState") not in FINAL:
            slurm("scancel", self.job, check=False)
