"""The NCCL weight channel of ``server_process`` engines against another user on the node.

vLLM's TCP-store rendezvous for that channel (``trainer_init`` on the sender, ``master_address`` / ``master_port`` on
the workers) makes every worker ``pickle.loads`` the NCCL id it reads from a plain ``TCPStore``: whoever reaches the
port runs code in vLLM's workers. The channel now joins by a unique id the sender mints and the engine's rank hands
to vLLM's control plane. NCCL cannot run here (no GPU): NCCL's library and the communicator's init are faked; the
sender's end, the init info our engine builds, and vLLM's real worker-side join (``worker_init_process_group``)
run as they are. What NCCL then does on a GPU is not exercised (a hypothesis, docs/reliability.md).

The stranger writes a pickle that creates a marker file into every TCP port the process started listening on while
the channel opened, under the key vLLM's workers read; the test fails naming the port and the key when the marker
appears, and fails when the channel opens any TCP port at all.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import secrets
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

from vllm.distributed.device_communicators import pynccl, pynccl_wrapper  # noqa: E402
from vllm.distributed.weight_transfer import nccl_common  # noqa: E402

from hpc_rlhf.weight_sync import sharded  # noqa: E402
from hpc_rlhf.weight_sync.vllm_transfer_info import worker_init_info  # noqa: E402
from tests.security.waits import join_or_fail  # noqa: E402

JOIN_TIMEOUT_S = 30
# The key vLLM's StatelessProcessGroup.broadcast_obj reads the NCCL id from (the first broadcast from rank 0).
VLLM_ID_KEY = "broadcast_from/0/0"


class _MarkerPayload:
    """Unpickling it creates ``path``: code of the stranger's choice ran in the unpickling process."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


_REAL_NCCL_LIBRARY = pynccl_wrapper.NCCLLibrary


class _FakeNccl:
    """NCCL's library as vLLM's wrapper calls it, without a GPU: unique ids are random bytes."""

    def __init__(self, *args, **kwargs):
        pass

    def ncclGetRawVersion(self) -> int:
        return 22805

    def ncclGetVersion(self) -> str:
        return "2.28.5"

    def ncclGetUniqueId(self):
        unique_id = pynccl_wrapper.ncclUniqueId()
        ctypes.memmove(ctypes.addressof(unique_id), secrets.token_bytes(128), 128)
        return unique_id

    def unique_id_from_bytes(self, data: bytes):
        return _REAL_NCCL_LIBRARY.unique_id_from_bytes(self, data)  # pure ctypes, no library call


@pytest.fixture
def fake_nccl(monkeypatch):
    """Every communicator's init records ``(rank, unique id bytes)`` instead of calling ``ncclCommInitRank``."""
    joined: list[tuple[int, bytes]] = []

    def init_comm(self, device) -> None:
        joined.append((self.rank, bytes(self.unique_id.internal)))

    monkeypatch.setattr(pynccl_wrapper, "NCCLLibrary", _FakeNccl)
    monkeypatch.setattr(pynccl, "NCCLLibrary", _FakeNccl)
    monkeypatch.setattr(pynccl.PyNcclCommunicator, "_init_comm", init_comm)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the sender picks NCCL, as on a GPU node
    return joined


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (``/proc/net/tcp*`` sockets in state LISTEN whose inode is one of ours)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _plant_payload(ports: set[int], marker: Path) -> list[str]:
    """The stranger: into every port, the payload under the key vLLM's workers read. Returns where it was written."""
    planted = []
    for port in sorted(ports):
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=5))
            store.add("init/", 1)  # torch's unsealed worker count: a store that waits for its clients goes on
            store.wait([VLLM_ID_KEY], datetime.timedelta(seconds=5))  # the sender's own id is there: replace it
            store.set(VLLM_ID_KEY, pickle.dumps(_MarkerPayload(str(marker))))
            planted.append(f"port {port}, key {VLLM_ID_KEY!r}")
        except Exception:  # noqa: BLE001 - not a store, or no such key: nothing for the stranger there
            continue
    return planted


def _worker_joins(init_info: dict) -> None:
    """vLLM's own worker-side join (one worker: tp 1, dp 1), from the init info our engine sends it."""
    info = nccl_common.NCCLWeightTransferInitInfo(**init_info)
    nccl_common.worker_init_process_group(info, SimpleNamespace(data_parallel_index=0, world_size=1, rank=0))


def test_a_stranger_cannot_run_code_in_vllms_workers_through_the_nccl_channel(fake_nccl, tmp_path):
    marker = tmp_path / "stranger_ran_code"
    before = _listening_ports()
    channel = sharded._open_vllm_channel(1)  # the sender's end, as EngineChannelWeightSync makes it on a GPU node
    opened = _listening_ports() - before
    planted = _plant_payload(opened, marker)
    init_info = worker_init_info(channel.rendezvous, num_workers=1, backend="nccl")
    worker = threading.Thread(target=_worker_joins, args=(init_info,))
    worker.start()
    channel.connect()
    join_or_fail(worker, JOIN_TIMEOUT_S, "vLLM's worker joining the channel")
    assert not marker.exists(), f"the stranger's pickle ran in vLLM's worker; planted at {planted}"
    assert not opened, f"the NCCL channel opened TCP ports {sorted(opened)} a stranger can reach"
    assert "master_port" not in init_info and "master_address" not in init_info, init_info
    # Both ends joined one communicator, from the id that went through the control plane.
    assert sorted(rank for rank, _ in fake_nccl) == [0, 1] and len({uid for _, uid in fake_nccl}) == 1, fake_nccl


def test_an_nccl_channel_through_a_store_is_refused():
    with pytest.raises(ValueError, match="unpickle the NCCL id"):
        worker_init_info({"master_address": "10.0.0.1", "master_port": 31000}, num_workers=1, backend="nccl")
    with pytest.raises(ValueError, match="needs nccl_unique_id_b64"):
        worker_init_info({}, num_workers=1, backend="nccl")


def test_the_gloo_channel_holds_its_port_from_the_moment_it_is_made(monkeypatch):
    """No window between choosing the port and binding it (a port picked free, then released, may be taken by any
    process before the store binds it), and one store namespace per channel (sealed values do not replay across)."""
    from hpc_rlhf.weight_sync.vllm_gloo_transfer import GlooSenderChannel
    from hpc_rlhf.world.job_secret import JOB_SECRET_ENV

    monkeypatch.setenv(JOB_SECRET_ENV, "g" * 64)
    before = _listening_ports()
    first, second = GlooSenderChannel(num_workers=1, timeout_s=5), GlooSenderChannel(num_workers=1, timeout_s=5)
    held = _listening_ports() - before
    assert {first.rendezvous["master_port"], second.rendezvous["master_port"]} <= held, (first.rendezvous, held)
    assert first.rendezvous["channel"] != second.rendezvous["channel"]
    first.close()
    second.close()
