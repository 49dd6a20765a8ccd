"""Read rank, world size and rendezvous address from whichever launcher started us.

One table maps each launcher's variables to the same fields (submitit's
``JobEnvironment`` does the same). The master port is derived from the job id
so every rank computes the same value without talking to the others.

Precedence: torchrun (also when torchrun runs inside an srun step), then a SLURM
step started by ``srun``, then OpenMPI, then a plain single process.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

PORT_BASE = 20000
PORT_SPAN = 20000


class LaunchEnvError(RuntimeError):
    """The launch environment is missing a variable or contradicts itself."""


@dataclass(frozen=True)
class LaunchEnv:
    launcher: str  # "torchrun" | "slurm" | "mpi" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str | None = None
    nodes: tuple[str, ...] = ()

    def export(self, environ: dict[str, str] | None = None) -> None:
        """Set the torch.distributed ``env://`` variables (MASTER_ADDR, RANK, ...)."""
        env = os.environ if environ is None else environ
        env.update(
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.local_rank),
            LOCAL_WORLD_SIZE=str(self.local_world_size),
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """``"gpu[01-03,07]"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07"]`` (SLURM hostlist syntax)."""
    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as err:
        raise LaunchEnvError(f"cannot parse SLURM node list {nodelist!r}: {err}") from err
    if not hosts:
        raise LaunchEnvError(f"SLURM node list {nodelist!r} names no host")
    return hosts


def port_from_job_id(job_id: str) -> int:
    """A port in [20000, 40000) that every rank of the job derives identically."""
    digits = "".join(ch for ch in job_id if ch.isdigit())
    if not digits:
        raise LaunchEnvError(f"job id {job_id!r} has no digits to derive a port from; set MASTER_PORT")
    return PORT_BASE + int(digits) % PORT_SPAN


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise LaunchEnvError(f"launch variable {name} is not set")
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"launch variable {name}={value!r} is not an integer") from None


def _check_rank(launcher: str, rank: int, world_size: int, local_rank: int, local_world_size: int) -> None:
    if world_size < 1:
        raise LaunchEnvError(f"{launcher}: world size {world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise LaunchEnvError(f"{launcher}: rank {rank} is outside [0, {world_size})")
    if not 0 <= local_rank < local_world_size:
        raise LaunchEnvError(f"{launcher}: local rank {local_rank} is outside [0, {local_world_size})")


def _tasks_on_this_node(tasks_per_node: str, node_id: int) -> int:
    """This node's entry of SLURM's ``SLURM_STEP_TASKS_PER_NODE`` compressed form, e.g. ``"4(x2),3"``."""
    try:
        counts = hostlist.parse_slurm_tasks_per_node(tasks_per_node)
    except hostlist.BadHostlist as err:
        raise LaunchEnvError(f"cannot parse SLURM tasks-per-node {tasks_per_node!r}: {err}") from err
    if node_id >= len(counts):
        raise LaunchEnvError(f"SLURM node id {node_id} has no entry in tasks-per-node {tasks_per_node!r}")
    return counts[node_id]


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    _check_rank("torchrun", rank, world, local_rank, local_world)
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise LaunchEnvError("RANK/WORLD_SIZE are set but MASTER_ADDR or MASTER_PORT is not")
    node_rank = int(env.get("GROUP_RANK", rank // local_world))
    return LaunchEnv(
        launcher="torchrun",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=max(1, world // local_world),
        master_addr=env["MASTER_ADDR"],
        master_port=_int(env, "MASTER_PORT"),
        job_id=env.get("TORCHELASTIC_RUN_ID"),
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    # Inside an srun step SLURM_STEP_* describe the step; SLURM_NTASKS may describe the allocation.
    world = _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else _int(env, "SLURM_NTASKS")
    rank = _int(env, "SLURM_PROCID")
    local_rank = _int(env, "SLURM_LOCALID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LaunchEnvError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not")
    nodes = expand_nodelist(nodelist)
    node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = _tasks_on_this_node(per_node, node_id) if per_node else world // len(nodes)
    _check_rank("slurm", rank, world, local_rank, max(local_world, 1))
    if node_id >= len(nodes):
        raise LaunchEnvError(f"SLURM_NODEID={node_id} but the node list {nodelist!r} has {len(nodes)} hosts")
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    elif job_id:
        port = port_from_job_id(job_id)
    else:
        raise LaunchEnvError("SLURM_JOB_ID is not set, so no master port can be derived; set MASTER_PORT")
    return LaunchEnv(
        launcher="slurm",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=max(local_world, 1),
        node_rank=node_id,
        num_nodes=len(nodes),
        master_addr=env.get("MASTER_ADDR", nodes[0]),
        master_port=port,
        job_id=job_id,
        nodes=tuple(nodes),
    )


def _from_mpi(env: Mapping[str, str]) -> LaunchEnv:
    rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") if "OMPI_COMM_WORLD_LOCAL_SIZE" in env else world
    _check_rank("mpi", rank, world, local_rank, local_world)
    if "MASTER_ADDR" in env:
        master = env["MASTER_ADDR"]
    elif world == local_world:
        master = "127.0.0.1"
    else:
        raise LaunchEnvError("mpirun over several nodes: export MASTER_ADDR=<first host> (e.g. with mpirun -x)")
    job_id = env.get("OMPI_MCA_ess_base_jobid") or env.get("SLURM_JOB_ID")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else (port_from_job_id(job_id) if job_id else 29500)
    return LaunchEnv(
        launcher="mpi",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=int(env.get("OMPI_COMM_WORLD_NODE_RANK", rank // local_world)),
        num_nodes=max(1, world // local_world),
        master_addr=master,
        master_port=port,
        job_id=job_id,
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def host_address() -> str:
    """This node's name, for a rendezvous other nodes connect to (cluster node names resolve on its network)."""
    return socket.gethostname()


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Map the current process environment to a :class:`LaunchEnv`.

    Raises:
        LaunchEnvError: a launcher's variables are incomplete or inconsistent.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_torchrun(env)
    # SLURM_STEP_ID marks an srun step; a batch script itself has SLURM_PROCID=0 but is one process.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        return _from_slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_mpi(env)
    return LaunchEnv(
        launcher="single",
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else free_port(),
    )
