"""The several-node SLURM cluster of ``.ci/setup_multinode.sh``: each node a network namespace with its own
address, host name, /tmp and slurmd. This process is the login node (the root namespace): it submits with
``SLURM_CONF`` pointing at that cluster. The nodes' /tmp is their own, so everything a job and this test both read
lives under a shared directory (``shared_dir``), as on a cluster's shared filesystem."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import FINAL, ROOT

MULTINODE_CONF = "/etc/slurm-multinode/slurm.conf"
NODES = ("hpcmn1", "hpcmn2")
ADDRESSES = {"hpcmn1": "10.77.0.11", "hpcmn2": "10.77.0.12", "hpcmnx": "10.77.0.13"}
OUTSIDER = "hpcmnx"  # a namespace on the same bridge with no slurmd: another user's node
SHARED_ROOT = Path("/var/tmp/hpc-rlhf-multinode")


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


def in_node(node: str, *command: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run a command on a node as a user logged in there would: in its slurmd's network, host-name and mount
    namespaces (its /tmp, its /etc/hosts)."""
    pid = Path(f"/run/slurm/slurmd-multinode-{node}.pid").read_text().strip()
    return subprocess.run(["nsenter", "-t", pid, "-n", "-u", "-m", *command], capture_output=True, text=True,
                          timeout=timeout, **kwargs)
