"""Read rank, world size and rendezvous address from whichever launcher started us.

One table maps each launcher's variables to the same fields (submitit's
``JobEnvironment`` does the same). The master port is derived from the job id
so every rank computes the same value without talking to the others, and it is kept out of the node's
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), from which the kernel hands out the local
ports of outgoing connections: a port in it may be taken by any process's connection at any moment.

Precedence: torchrun (also when torchrun runs inside an srun step), then a SLURM
step started by ``srun``, then OpenMPI, then a plain single process.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import hostlist

# Derived master ports lie in [PORT_FLOOR, PORT_CEILING] minus the node's ephemeral range. The floor keeps
# them above the ports services commonly listen on (web UIs, databases, Jupyter: mostly below 20000).
PORT_FLOOR = 20000
PORT_CEILING = 65535
# Fewer candidate ports than this (an ephemeral range covering nearly all of them) makes job collisions likely.
MIN_JOB_PORTS = 1000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LINUX_DEFAULT_EPHEMERAL_RANGE = (32768, 60999)


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
    # Where master_port came from, for the error when it is in use: "MASTER_PORT", "job id <id>" or "a free port".
    master_port_from: str = "MASTER_PORT"
    # Which start of the job this is: "<SLURM_RESTART_COUNT>.<TORCHELASTIC_RESTART_COUNT>" ("0.0" the first time;
    # a requeued job or torchrun's restarted workers count up). The same on every rank of one start.
    launch_round: str = "0.0"

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


def ephemeral_port_range(path: str | Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The node's ephemeral port range ``(first, last)``, both included; Linux's default where the file is
    missing or unreadable (not Linux, a restricted container)."""
    try:
        first, last = (int(field) for field in Path(path).read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL_RANGE
    if not 0 < first <= last <= PORT_CEILING:
        return LINUX_DEFAULT_EPHEMERAL_RANGE
    return first, last


def job_ports(ephemeral: tuple[int, int]) -> tuple[range, range]:
    """The ports a job id may map to: ``[PORT_FLOOR, first)`` and ``(last, PORT_CEILING]`` around the ephemeral
    range ``(first, last)`` (either may be empty)."""
    first, last = ephemeral
    below = range(PORT_FLOOR, max(PORT_FLOOR, min(first, PORT_CEILING + 1)))
    above = range(max(PORT_FLOOR, last + 1), PORT_CEILING + 1)
    return below, above


def port_from_job_id(job_id: str, ephemeral: tuple[int, int] | None = None) -> int:
    """A port every rank of the job derives identically, outside the ephemeral range (default: this node's).

    With Linux's default range that is one of the 17304 ports in [20000, 32768) and [61000, 65535]. The nodes of
    one job must share the ephemeral range (a uniformly configured cluster does); else set MASTER_PORT.
    """
    digits = "".join(ch for ch in job_id if ch.isdigit())
    if not digits:
        raise LaunchEnvError(f"job id {job_id!r} has no digits to derive a port from; set MASTER_PORT")
    first, last = ephemeral or ephemeral_port_range()
    below, above = job_ports((first, last))
    count = len(below) + len(above)
    if count < MIN_JOB_PORTS:
        raise LaunchEnvError(f"this node's ephemeral port range {first}-{last} ({EPHEMERAL_RANGE_FILE}) leaves only "
                             f"{count} ports in [{PORT_FLOOR}, {PORT_CEILING}] for master ports; set MASTER_PORT "
                             "to a port outside it")
    index = int(digits) % count
    return below[index] if index < len(below) else above[index - len(below)]


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
    port_from = "MASTER_PORT"
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    elif job_id:
        port, port_from = port_from_job_id(job_id), f"job id {job_id}"
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
        master_port_from=port_from,
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
    if "MASTER_PORT" in env:
        port, port_from = _int(env, "MASTER_PORT"), "MASTER_PORT"
    elif job_id:
        port, port_from = port_from_job_id(job_id), f"job id {job_id}"
    else:
        port, port_from = 29500, "torch's default port 29500"
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
        master_port_from=port_from,
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MasterPortInUseError(LaunchEnvError):
    """Rank 0 cannot listen on the master port: another process holds it."""


def _loopback_address(host: str, port: int) -> tuple[socket.AddressFamily, str] | None:
    """``host``'s address when it resolves to a loopback address (every rank is on this node), else None."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError):
        return None
    address = str(sockaddr[0])
    return (socket.AddressFamily(family), address) if ipaddress.ip_address(address).is_loopback else None


def listen_on_master_port(env: LaunchEnv) -> socket.socket:
    """Rank 0's listening socket for the rendezvous store on ``env.master_port``.

    A job on one node whose master address resolves to a loopback address listens on that address alone, so that
    other machines cannot reach the store at all; otherwise every interface is, as torch does (the address other
    nodes use to reach this one is not known here, and a node name may resolve to 127.0.1.1 on the node itself).

    Raises:
        MasterPortInUseError: the port is taken, naming it, where it came from and how to choose another.
    """
    loopback = _loopback_address(env.master_addr, env.master_port) if env.num_nodes == 1 else None
    try:
        if loopback is not None:
            return socket.create_server((loopback[1], env.master_port), family=loopback[0])
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", env.master_port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", env.master_port))
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        first, last = ephemeral_port_range()
        raise MasterPortInUseError(
            f"master port {env.master_port} (from {env.master_port_from}) is already in use on {socket.gethostname()},"
            f" so rank 0 cannot host the job's rendezvous there (EADDRINUSE; `ss -ltnp 'sport = :{env.master_port}'`"
            f" shows who holds it). Way out: export MASTER_PORT=<a free port in [{PORT_FLOOR}, {first}) or "
            f"({last}, {PORT_CEILING}], outside this node's ephemeral range {first}-{last}> before sbatch, srun or "
            "torchrun (every rank must see the same value)") from None


def host_address() -> str:
    """This node's name, for a rendezvous other nodes connect to (cluster node names resolve on its network)."""
    return socket.gethostname()


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Map the current process environment to a :class:`LaunchEnv`.

    Raises:
        LaunchEnvError: a launcher's variables are incomplete or inconsistent.
    """
    env = os.environ if environ is None else environ
    return dataclasses.replace(_launcher_env(env), launch_round=launch_round(env))


def launch_round(env: Mapping[str, str]) -> str:
    """Which start of the job this is (``LaunchEnv.launch_round``): SLURM's requeue count, then torchrun's restarts."""
    counts = []
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        value = env.get(name, "0").strip() or "0"
        if not value.isdigit():
            raise LaunchEnvError(f"{name}={value!r} is not a count")
        counts.append(str(int(value)))
    return ".".join(counts)


def _launcher_env(env: Mapping[str, str]) -> LaunchEnv:
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
        master_port_from="MASTER_PORT" if "MASTER_PORT" in env else "a free port",
    )
