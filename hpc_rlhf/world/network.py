"""Which network interface this rank talks to the other nodes through, and the record of where every rank is.

On a cluster node the node's own name often resolves to ``127.0.1.1`` on the node itself (Debian and Ubuntu images
put ``127.0.1.1 <hostname>`` in ``/etc/hosts``), and gloo, left to itself, binds to the address the host name
resolves to: it then tells the other nodes to connect to ``127.0.1.1`` and the first collective between nodes
hangs until the collective timeout. NCCL's socket bootstrap picks an interface by its own rules (``ib*`` first,
then anything but ``lo`` and ``docker*``), which may be one the other nodes cannot reach.

So, on a job of several nodes where the user has not named one, every rank picks the interface through which its
node routes to the other nodes (to the master address, or to another node of the job when the master address is
this node itself) and exports it as ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``. The NCCL half is a hypothesis
on these CPU machines: only gloo crossed a network between nodes here (see docs/slurm.md, "Several nodes").

After the world is up every rank reports its host, interface and address (``gather_world_peers``); rank 0 logs
them and writes them to ``<output_dir>/world.json`` (``save_world_record``) so that a person or a test can see which
addresses the job's ranks met over.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from hpc_rlhf.world.launch_env import LaunchEnv

log = logging.getLogger(__name__)

WORLD_RECORD_NAME = "world.json"
# Any port does: connecting a UDP socket sends nothing, it only asks the kernel for the route and source address.
_ROUTE_PROBE_PORT = 9


class StoreLike(Protocol):
    """The two calls of a ``torch.distributed.Store`` used here (typed without importing torch)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...


@dataclass(frozen=True)
class SocketInterface:
    """The interface a rank's collectives use and why.

    ``source``: ``"GLOO_SOCKET_IFNAME"`` (set by the user), ``"route to <host>"`` (derived here) or ``"one node"``
    / ``"unknown"`` (nothing set: loopback is enough, or no route was found; gloo then uses the host name's address).
    """

    interface: str | None
    address: str | None
    source: str


@dataclass(frozen=True)
class RankPeer:
    """Where one rank runs, as it reported itself after the world came up."""

    rank: int
    node_rank: int
    local_rank: int
    host: str
    interface: str | None
    address: str | None
    interface_source: str


def _resolve(host: str) -> str | None:
    """``host``'s first IPv4/IPv6 address as this node resolves it, or None."""
    try:
        return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None


def source_address_towards(address: str) -> str | None:
    """The local address the kernel would send from to reach ``address`` (its route's source), or None."""
    family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((address, _ROUTE_PROBE_PORT))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def interface_addresses() -> dict[str, list[str]]:
    """``{interface name: [its IPv4/IPv6 addresses]}`` of this node (psutil reads them from the kernel)."""
    import psutil  # a small compiled package; imported here so that `hpc_rlhf.world` stays cheap to import

    found: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family in (socket.AF_INET, socket.AF_INET6):
                found.setdefault(name, []).append(addr.address.split("%")[0])
    return found


def interface_of(address: str, interfaces: Mapping[str, Sequence[str]]) -> str | None:
    """The name of the interface holding ``address``, or None."""
    for name, addrs in interfaces.items():
        if address in addrs:
            return name
    return None


def _is_local(address: str, interfaces: Mapping[str, Sequence[str]]) -> bool:
    return ipaddress.ip_address(address).is_loopback or interface_of(address, interfaces) is not None


def remote_peer_address(env: LaunchEnv, interfaces: Mapping[str, Sequence[str]]) -> tuple[str, str] | None:
    """``(host, address)`` of a peer on another node that this rank's traffic must reach, or None.

    The master address when it is another node's; on the master's own node (its name may resolve to 127.0.1.1
    here) the first node of the job's node list that is not this one.
    """
    master = _resolve(env.master_addr)
    if master is not None and not _is_local(master, interfaces):
        return env.master_addr, master
    for node_rank, host in enumerate(env.nodes):
        if node_rank == env.node_rank:
            continue
        address = _resolve(host)
        if address is not None and not _is_local(address, interfaces):
            return host, address
    return None


def choose_socket_interface(env: LaunchEnv, environ: Mapping[str, str],
                            interfaces: Mapping[str, Sequence[str]]) -> SocketInterface:
    """The interface this rank's collectives should use (see the module docstring); pure but for name lookups."""
    named = environ.get("GLOO_SOCKET_IFNAME")
    if named:
        first = named.split(",")[0]
        addrs = list(interfaces.get(first, ()))
        return SocketInterface(first, addrs[0] if addrs else None, "GLOO_SOCKET_IFNAME")
    if env.num_nodes <= 1:
        return SocketInterface(None, None, "one node")
    peer = remote_peer_address(env, interfaces)
    if peer is None:
        return SocketInterface(None, None, "unknown")
    host, address = peer
    source = source_address_towards(address)
    name = interface_of(source, interfaces) if source else None
    if name is None or ipaddress.ip_address(source or "127.0.0.1").is_loopback:
        return SocketInterface(None, None, "unknown")
    return SocketInterface(name, source, f"route to {host}")


def configure_socket_interfaces(env: LaunchEnv, environ: MutableMapping[str, str] | None = None) -> SocketInterface:
    """Export ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME``, unless set) for a job of several nodes.

    Call before the first process group is created: gloo reads the variable when it makes a group's device.
    A user's own ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` is kept as it is.
    """
    env_vars = os.environ if environ is None else environ
    choice = choose_socket_interface(env, env_vars, interface_addresses())
    if choice.source.startswith("route to") and choice.interface:
        env_vars["GLOO_SOCKET_IFNAME"] = choice.interface
        env_vars.setdefault("NCCL_SOCKET_IFNAME", choice.interface)  # hypothesis: not exercised on a GPU here
        log.info("rank %d: collectives use interface %s (%s, %s); set GLOO_SOCKET_IFNAME to choose another",
                 env.rank, choice.interface, choice.address, choice.source)
    return choice


def node_address_key(node_rank: int) -> str:
    return f"hpc_rlhf/net/node_address/{node_rank}"


def learn_interface_from_peers(env: LaunchEnv, choice: SocketInterface, store: StoreLike,
                               environ: MutableMapping[str, str] | None = None) -> SocketInterface:
    """Exchange the nodes' addresses over the (sealed) rendezvous store, so that a rank that could not find another
    node by name finds it by the address that node reported. Collective over the nodes' local rank 0s; call after
    ``configure_socket_interfaces`` and before the first process group.

    The case it is for: ``torchrun --nnodes N`` started by hand gives no node list, and on the master's own node the
    master name may resolve to 127.0.1.1; the other nodes know their own address (they route to the master).
    """
    if env.num_nodes <= 1:
        return choice
    if env.local_rank == 0:
        store.set(node_address_key(env.node_rank), choice.address or "")
    if choice.source != "unknown":
        return choice
    other = (env.node_rank + 1) % env.num_nodes
    address = store.get(node_address_key(other)).decode()
    source = source_address_towards(address) if address else None
    name = interface_of(source, interface_addresses()) if source else None
    if name is None or source is None or ipaddress.ip_address(source).is_loopback:
        log.warning("rank %d of a %d-node job: no route from this node to another node of the job (master %s, "
                    "nodes %s, node %d's reported address %r) was found, so gloo binds to the address %s resolves "
                    "to; if the start-up hangs, export GLOO_SOCKET_IFNAME=<the interface the nodes share> "
                    "(docs/troubleshooting.md)", env.rank, env.num_nodes, env.master_addr,
                    ",".join(env.nodes) or "?", other, address, socket.gethostname())
        return choice
    env_vars = os.environ if environ is None else environ
    env_vars["GLOO_SOCKET_IFNAME"] = name
    env_vars.setdefault("NCCL_SOCKET_IFNAME", name)  # hypothesis: not exercised on a GPU here
    learned = SocketInterface(name, source, f"route to node {other} ({address}, from the store)")
    log.info("rank %d: collectives use interface %s (%s, %s)", env.rank, name, source, learned.source)
    return learned


def this_rank_peer(env: LaunchEnv, choice: SocketInterface) -> RankPeer:
    return RankPeer(rank=env.rank, node_rank=env.node_rank, local_rank=env.local_rank, host=socket.gethostname(),
                    interface=choice.interface, address=choice.address, interface_source=choice.source)


def describe_peers(peers: Sequence[RankPeer]) -> str:
    """One line per rank, for rank 0's log."""
    return "\n".join(f"  rank {p.rank}: node {p.node_rank} ({p.host}), local rank {p.local_rank}, "
                     f"{p.interface or 'default interface'} {p.address or ''} [{p.interface_source}]".rstrip()
                     for p in peers)


def save_world_record(peers: Sequence[RankPeer], output_dir: str | Path) -> Path:
    """Write ``<output_dir>/world.json`` (every rank's host, interface and address) atomically; return its path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / WORLD_RECORD_NAME
    tmp = target.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"ranks": [asdict(p) for p in peers]}, indent=1) + "\n")
    os.replace(tmp, target)
    return target
