"""Bring up the one torch.distributed world and the process groups in it: one set per role of the RL
placement (``build_world_groups``), or the tp / dp grid over the whole world of the offline trainers
(``tensor_data_parallel_groups``). Both cut groups from the same ``RoleGrid``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hpc_rlhf.world.job_secret import job_secret
from hpc_rlhf.world.launch_env import LaunchEnv, detect_launch_env, listen_on_master_port
from hpc_rlhf.world.network import (
    RankPeer,
    configure_socket_interfaces,
    describe_peers,
    learn_interface_from_peers,
    this_rank_peer,
)
from hpc_rlhf.world.placement import Placement, RoleGrid
from hpc_rlhf.world.sealed_store import sealed_tcp_store

log = logging.getLogger(__name__)

# The world's collective timeout (``train.collective_timeout_s``), kept for the groups made after init_world:
# torch gives every ``dist.new_group`` its own 30-minute default instead of the default group's timeout, so a
# hang on any other group would outlive the configured limit.
_collective_timeout: datetime.timedelta | None = None
# The world's sealed store, referenced here for the life of the process: torch holds it only through C++ (a Python
# subclass of dist.Store), and on rank 0 it owns the store's server.
_world_store: dist.Store | None = None
# Every rank's host, interface and address, as the ranks reported them after init_world (rank order).
_world_peers: tuple[RankPeer, ...] = ()
# A rank's report travels as JSON in a fixed-size byte tensor (no pickle of what the wire carries).
_PEER_RECORD_BYTES = 1024


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_world(timeout_s: int = 1800, env: LaunchEnv | None = None, backend: str | None = None) -> LaunchEnv:
    """Initialise torch.distributed from the launcher's variables (idempotent).

    NCCL with one GPU per rank (``cuda:local_rank``) when CUDA is present, gloo otherwise. The rendezvous store is
    sealed with the job's secret (``hpc_rlhf.world.job_secret``, ``hpc_rlhf.world.sealed_store``): another user who
    reaches the master port can neither read nor change what the ranks exchange there, nor join the job's groups.
    Rank 0 hosts the store (under torchrun with ``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's agent does).

    Raises:
        MasterPortInUseError: rank 0 cannot listen on the master port (naming it and how to choose another).
        JobSecretError: no usable secret, or the ranks do not agree on it.
    """
    global _collective_timeout, _world_store, _world_peers
    env = env or detect_launch_env()
    if dist.is_initialized():
        return env
    _collective_timeout = datetime.timedelta(seconds=timeout_s)
    env.export()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    # Before any group exists: gloo reads GLOO_SOCKET_IFNAME when it makes a group's device (hpc_rlhf.world.network).
    interface = configure_socket_interfaces(env)
    secret = job_secret(env)  # taken out of the environment; this process holds it (hpc_rlhf.world.job_secret)
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosts = env.rank == 0 and not agent_hosts
    # Rank 0 binds the port itself: a port in use is then named with the way out, and a one-node job listens on
    # loopback alone (listen_on_master_port). The store's server takes the socket over.
    listen_fd = listen_on_master_port(env).detach() if hosts else None
    _world_store = sealed_tcp_store(env.master_addr, env.master_port, rank=env.rank, world_size=env.world_size,
                                    secret=secret, namespace=world_store_namespace(env),
                                    timeout=_collective_timeout, is_master=hosts,
                                    listen_fd=listen_fd)
    interface = learn_interface_from_peers(env, interface, _world_store)
    dist.init_process_group(
        backend=backend,
        store=_world_store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=_collective_timeout,
    )
    log.info("rank %d/%d up (%s, %s, master %s:%d, sealed store)", env.rank, env.world_size, env.launcher,
             backend, env.master_addr, env.master_port)
    _world_peers = _gather_peers(this_rank_peer(env, interface), env.world_size, backend)
    return env


def world_store_namespace(env: LaunchEnv) -> str:
    """The namespace the world's store is sealed under: bound to this start of the job (``launch_round``). A
    requeued job reuses its job id, often its port and, when the secret is derived from the user's key, its secret:
    without the round, a value another client recorded from the store of an earlier start would open in this one."""
    return f"world/{env.job_id or ''}/{env.launch_round}"


def _gather_peers(mine: RankPeer, world_size: int, backend: str) -> tuple[RankPeer, ...]:
    """Every rank's ``RankPeer``, in rank order (a collective over the world)."""
    raw = json.dumps(dataclasses.asdict(mine)).encode()[:_PEER_RECORD_BYTES]
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    buf = torch.zeros(_PEER_RECORD_BYTES, dtype=torch.uint8, device=device)
    buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    gathered = [torch.empty_like(buf) for _ in range(world_size)]
    dist.all_gather(gathered, buf)
    peers = []
    for tensor in gathered:
        data = bytes(tensor.cpu().tolist()).rstrip(b"\0")
        peers.append(RankPeer(**json.loads(data)))
    return tuple(peers)


def log_world_peers(env: LaunchEnv) -> None:
    """Rank 0 logs where every rank is (host, interface, address); call once logging is set up."""
    if env.rank == 0 and _world_peers:
        log.info("world of %d ranks on %d nodes:\n%s", env.world_size, env.num_nodes, describe_peers(_world_peers))


def world_peers() -> tuple[RankPeer, ...]:
    """Every rank's host, interface and address as reported at init_world (empty before, or if the world was
    initialised elsewhere)."""
    return _world_peers


def collective_timeout() -> datetime.timedelta | None:
    """The timeout given to init_world (None if the world was initialised elsewhere: torch's default)."""
    return _collective_timeout


def new_group(ranks, *, use_local_synchronization: bool = False,
              backend: str | None = None) -> dist.ProcessGroup | None:
    """``dist.new_group`` with the world's collective timeout; use it for every group (see _collective_timeout).
    ``backend``: the group's own (default: the world's).

    Collective like ``dist.new_group``: every rank calls it in the same order, unless use_local_synchronization.
    """
    return dist.new_group(list(ranks), timeout=_collective_timeout,
                          use_local_synchronization=use_local_synchronization, backend=backend)


def set_collective_timeouts(timeout_s: float) -> bool:
    """Give every process group this rank belongs to a new collective timeout (for the collectives issued next).

    torch fixes a group's timeout when it is created; ``distributed_c10d._set_pg_timeout`` (private, present since
    torch 2.3, gloo and NCCL) changes it afterwards, which is what lets a step's collectives be bounded by the
    step's limit while start-up and checkpoint loads keep a long one (``hpc_rlhf.resilience.stall_guard``).
    Returns False, changing nothing, where torch lacks it; the watchdog still bounds every phase then. gloo's
    point-to-point ``recv`` (the command bus's) keeps the timeout its group was created with (torch 2.13: a recv
    on a group set to 3 s here waited until its peer exited 8 s later, while an all_reduce failed after 3 s); the
    watchdog bounds it.
    """
    setter, registry = getattr(c10d, "_set_pg_timeout", None), getattr(c10d, "_world", None)
    if setter is None or registry is None or not dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(registry.pg_map):
        if group is not dist.GroupMember.NON_GROUP_MEMBER and dist.get_rank(group) >= 0:
            setter(timeout, group)
    return True


def comm_device() -> torch.device:
    """Where tensors must live for collectives on the default backend."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class RoleGroups:
    """This rank's process groups for one role. ``None`` for groups this rank is not in."""

    role: str
    ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    controller_group: dist.ProcessGroup | None  # role ranks plus rank 0, for controller traffic
    controller_ranks: tuple[int, ...]
    dp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    sp_group: dist.ProcessGroup | None = None
    dp_sp_group: dist.ProcessGroup | None = None  # ZeRO's group: dp x sp ranks with this rank's tp index
    replica_group: dist.ProcessGroup | None = None  # tp x sp ranks of this rank's dp replica (its leader first)
    dp_leaders: tuple[int, ...] = ()
    dp_rank_of: dict[int, int] = field(default_factory=dict)  # global rank -> dp rank in this role


@dataclass
class WorldGroups:
    placement: Placement
    rank: int
    roles: dict[str, RoleGroups] = field(default_factory=dict)
    # Every rank, on gloo whatever the world's backend: rank 0's commands to the other ranks travel over it
    # (``hpc_rlhf.trainers.rl.command_bus``), point to point, apart from every role's traffic.
    command_group: dist.ProcessGroup | None = None

    def has_role(self, role: str) -> bool:
        return role in self.roles and self.rank in self.roles[role].ranks

    @property
    def is_controller(self) -> bool:
        return self.rank == self.placement.controller_rank


def _new_group(ranks: tuple[int, ...], rank: int, cache: dict) -> dist.ProcessGroup | None:
    """Create (or reuse) a group; every rank must call this in the same order for every group."""
    key = tuple(sorted(ranks))
    if key not in cache:
        cache[key] = new_group(key)
    return cache[key] if rank in key else None


def replica_groups(grid: RoleGrid) -> list[tuple[int, ...]]:
    """The ranks of each data-parallel replica (tp x sp of them), where the controller channel broadcasts a shard
    from the replica's leader. Where sp or tp is 1 they are the tp or sp groups (the same process groups:
    ``_new_group`` makes one per set of ranks), so only layouts with both create new ones."""
    by_dp: dict[int, list[int]] = {}
    for rank in grid.ranks:
        by_dp.setdefault(grid.dp_rank(rank), []).append(rank)
    return [tuple(by_dp[dp]) for dp in sorted(by_dp)]


def _grid_subgroups(grid: RoleGrid, rank: int, cache: dict) -> dict[str, dist.ProcessGroup]:
    """This rank's dp / tp / sp / dp x sp / replica groups of ``grid`` (collective: every rank creates every group)."""
    mine = {}
    for attr, subgroups in (("dp_group", grid.dp_groups), ("tp_group", grid.tp_groups),
                            ("sp_group", grid.sp_groups), ("dp_sp_group", grid.dp_sp_groups),
                            ("replica_group", replica_groups(grid))):
        for members in subgroups:
            handle = _new_group(members, rank, cache)
            if handle is not None:
                mine[attr] = handle
    return mine


def tensor_data_parallel_groups(tp_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(tp_group, dp_group) of this rank when the whole world trains one model, tp innermost as in the RL
    placement. ``(None, None)`` without tensor parallelism: data parallel over the whole world."""
    if tp_size == 1:
        return None, None
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp_size:
        raise ValueError(f"ds.tensor_parallel_size={tp_size} does not divide the {world} ranks of the job")
    mine = _grid_subgroups(RoleGrid("model", tuple(range(world)), tp_size=tp_size), rank, {})
    return mine["tp_group"], mine["dp_group"]


def build_world_groups(placement: Placement) -> WorldGroups:
    """Create every role's groups collectively. All ranks must call this with the same placement."""
    rank = dist.get_rank()
    if dist.get_world_size() != placement.world_size:
        raise RuntimeError(
            f"placement is for {placement.world_size} ranks but the world has {dist.get_world_size()}"
        )
    cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
    out = WorldGroups(placement=placement, rank=rank)
    for name, grid in placement.roles.items():
        controller_ranks = tuple(sorted({placement.controller_rank, *grid.ranks}))
        groups = RoleGroups(
            role=name,
            ranks=grid.ranks,
            group=_new_group(grid.ranks, rank, cache),
            controller_group=_new_group(controller_ranks, rank, cache),
            controller_ranks=controller_ranks,
            dp_leaders=grid.dp_leaders(),
            dp_rank_of={r: grid.dp_rank(r) for r in grid.ranks},
        )
        for attr, handle in _grid_subgroups(grid, rank, cache).items():
            setattr(groups, attr, handle)
        out.roles[name] = groups
    out.command_group = new_group(range(placement.world_size), backend="gloo")
    if rank == placement.controller_rank:
        for row in placement.describe():
            log.info("role %(role)s on ranks %(ranks)s (dp %(dp)s, tp %(tp)s)", row)
    return out
