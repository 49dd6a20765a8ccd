"""hpc_rlhf.world.network: the interface a multi-node job's collectives use, chosen from the route to another node,
and the record of where the ranks met. Name lookups and routes are replaced by a table here; tests/slurm/multinode
checks the same on real namespaces."""

import json

import pytest

from hpc_rlhf.world import network
from hpc_rlhf.world.launch_env import LaunchEnv
from hpc_rlhf.world.network import (
    RankPeer,
    SocketInterface,
    choose_socket_interface,
    configure_socket_interfaces,
    save_world_record,
)

# node 1 of a two-node job: its own name resolves to 127.0.1.1 on itself (Debian), the other node's to its address
INTERFACES = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.11"], "ib0": ["192.168.5.11"]}
NAMES = {"node1": "127.0.1.1", "node2": "10.0.0.12", "node3": "192.168.5.13"}
ROUTES = {"10.0.0.12": "10.0.0.11", "192.168.5.13": "192.168.5.11", "127.0.1.1": "127.0.0.1"}


def _env(node_rank: int, nodes: tuple[str, ...] = ("node1", "node2"), master: str = "node1") -> LaunchEnv:
    return LaunchEnv(launcher="slurm", rank=node_rank, world_size=len(nodes), local_rank=0, local_world_size=1,
                     node_rank=node_rank, num_nodes=len(nodes), master_addr=master, master_port=20001, job_id="1",
                     nodes=nodes)


@pytest.fixture(autouse=True)
def fake_network(monkeypatch):
    monkeypatch.setattr(network, "_resolve", NAMES.get)
    monkeypatch.setattr(network, "source_address_towards", ROUTES.get)
    monkeypatch.setattr(network, "interface_addresses", lambda: INTERFACES)


def test_master_node_whose_name_resolves_to_127_0_1_1_routes_to_the_other_node():
    choice = choose_socket_interface(_env(0), {}, INTERFACES)
    assert choice == SocketInterface("eth0", "10.0.0.11", "route to node2")


def test_other_node_routes_to_the_master_address(monkeypatch):
    # on node 2 the master's name resolves to its real address, routed through ib0 here
    monkeypatch.setattr(network, "_resolve", {"node1": "192.168.5.13", "node2": "127.0.1.1"}.get)
    choice = choose_socket_interface(_env(1), {}, INTERFACES)
    assert choice == SocketInterface("ib0", "192.168.5.11", "route to node1")


def test_a_users_interface_is_kept():
    choice = choose_socket_interface(_env(0), {"GLOO_SOCKET_IFNAME": "ib0,ib1"}, INTERFACES)
    assert choice == SocketInterface("ib0", "192.168.5.11", "GLOO_SOCKET_IFNAME")


def test_one_node_sets_nothing():
    environ: dict[str, str] = {}
    choice = configure_socket_interfaces(_env(0, nodes=("node1",)), environ)
    assert choice.source == "one node" and environ == {}


class DictStore:
    def __init__(self, values: dict[str, str] | None = None):
        self.values = dict(values or {})

    def set(self, key: str, value: str) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes:
        return self.values[key].encode()


def test_torchrun_master_node_learns_the_other_nodes_address_from_the_store():
    # torchrun by hand: no node list, and the master's name is 127.0.1.1 on the master's node
    env = _env(0, nodes=())
    env = LaunchEnv(**{**env.__dict__, "num_nodes": 2})
    environ: dict[str, str] = {}
    choice = configure_socket_interfaces(env, environ)
    assert choice.source == "unknown" and environ == {}
    store = DictStore({network.node_address_key(1): "10.0.0.12"})
    learned = network.learn_interface_from_peers(env, choice, store, environ)
    assert learned == SocketInterface("eth0", "10.0.0.11", "route to node 1 (10.0.0.12, from the store)")
    assert environ == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}
    assert store.values[network.node_address_key(0)] == ""  # node 0's leader published what it knew


def test_every_node_leader_publishes_its_address_and_no_route_warns(monkeypatch, caplog):
    store = DictStore()
    network.learn_interface_from_peers(_env(0), choose_socket_interface(_env(0), {}, INTERFACES), store, {})
    assert store.values == {network.node_address_key(0): "10.0.0.11"}
    monkeypatch.setattr(network, "_resolve", {"node1": "127.0.1.1", "node2": "127.0.1.1"}.get)
    environ: dict[str, str] = {}
    choice = configure_socket_interfaces(_env(0), environ)
    learned = network.learn_interface_from_peers(_env(0), choice, DictStore({network.node_address_key(1): ""}),
                                                 environ)
    assert learned.source == "unknown" and "GLOO_SOCKET_IFNAME" not in environ
    assert "export GLOO_SOCKET_IFNAME=" in caplog.text


def test_configure_exports_gloo_and_keeps_a_users_nccl_choice():
    environ = {"NCCL_SOCKET_IFNAME": "ib0"}
    configure_socket_interfaces(_env(0), environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib0"}
    environ = {}
    configure_socket_interfaces(_env(0), environ)
    assert environ == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0"}


def test_real_route_lookup_on_this_machine(monkeypatch):
    monkeypatch.undo()  # the real kernel route and interface table
    assert network.source_address_towards("127.0.0.1") == "127.0.0.1"
    assert network.interface_of("127.0.0.1", network.interface_addresses()) is not None  # lo, whatever its name


def test_world_record_is_written_atomically(tmp_path):
    peers = [RankPeer(0, 0, 0, "node1", "eth0", "10.0.0.11", "route to node2"),
             RankPeer(1, 1, 0, "node2", "eth0", "10.0.0.12", "route to node1")]
    path = save_world_record(peers, tmp_path / "run")
    data = json.loads(path.read_text())
    assert [r["address"] for r in data["ranks"]] == ["10.0.0.11", "10.0.0.12"]
    assert not list((tmp_path / "run").glob("*.tmp"))
