"""The sending actor rank's end of a ``server_process`` engine's NCCL weight channel.

The engine's side (its workers join the communicator, unpack each bucket) is
:meth:`hpc_rlhf.rollout.vllm_server.VllmServerEngine.open_weight_channel` and ``receive_weights``; the gloo
channel used on CPU is :class:`hpc_rlhf.weight_sync.vllm_gloo_transfer.GlooSenderChannel`.

Rendezvous without a store: the sender mints the communicator's NCCL unique id (``ncclGetUniqueId``) and the id
reaches the engine's workers through two channels that are the job's own: the world's group to the engine's
rollout rank (sealed at start-up, :mod:`hpc_rlhf.world.sealed_store`), then vLLM's control plane, as
``NCCLWeightTransferInitInfo.nccl_unique_id_b64`` of ``init_weight_transfer_engine``. vLLM's other path
(``trainer_init`` with ``master_address`` / ``master_port``) is refused: there every worker unpickles what it reads
from a plain ``TCPStore`` on the sender's node, so anyone who reaches that port runs code in the workers.

What is NOT guarded here: NCCL's own bootstrap (the listening socket the unique id names, on the sender) has no
authentication; someone on the network who learns or guesses the id could disturb or join the communicator. No
pickle is involved there. Both ends have never run on a GPU (no device here has vLLM): how NCCL behaves is a
hypothesis until it runs. Imports no vLLM until a channel is made.
"""

from __future__ import annotations

import base64
import ctypes
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hpc_rlhf.rollout.vllm_api import resolve
from hpc_rlhf.weight_sync.vllm_transfer_info import PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS

NCCL_UNIQUE_ID_KEY = "nccl_unique_id_b64"


def mint_unique_id() -> bytes:
    """A fresh ``ncclUniqueId`` (128 bytes) from the NCCL library vLLM loads; it starts NCCL's bootstrap root in
    this process, which the communicator's other ranks then reach."""
    library = resolve("vllm.distributed.device_communicators.pynccl_wrapper:NCCLLibrary")()
    unique_id = library.ncclGetUniqueId()
    return ctypes.string_at(ctypes.addressof(unique_id), ctypes.sizeof(unique_id))


def nccl_rendezvous(unique_id: bytes) -> dict[str, str]:
    """What an engine's workers need to join: the unique id, as vLLM's ``nccl_unique_id_b64`` (standard base64)."""
    return {NCCL_UNIQUE_ID_KEY: base64.b64encode(unique_id).decode("ascii")}


def send_bucket(communicator: Any, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Broadcast one bucket's tensors (CUDA, in the order the engine was told) packed, as the workers unpack."""
    producer = resolve("vllm.distributed.weight_transfer.packed_tensor:packed_nccl_broadcast_producer")
    producer(iterator=iter(bucket), group=communicator, src=0, post_iter_func=lambda item: item[1],
             buffer_size_bytes=PACKED_BUFFER_BYTES, num_buffers=PACKED_NUM_BUFFERS)


class SenderChannel:
    """One engine's NCCL communicator seen from its sending actor rank (NCCL rank 0).

    Made with a fresh unique id (:attr:`rendezvous`, which the engine's rank passes to ``open_weight_channel``),
    then :meth:`connect`, collective with the engine's workers (every rank must enter at once: there is no store
    barrier), then one :meth:`send` per bucket of every weight round. Never run on a GPU yet (module docstring)."""

    # A broadcast whose receivers died mid-round is expected to wait without end, with no abort in vLLM's
    # communicator (a hypothesis, never run on a GPU): such a failure ends the job (weight_round_failure).
    survives_lost_receiver = False

    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"SenderChannel: num_workers={num_workers}; an engine has at least one worker")
        self.num_workers = num_workers
        self.unique_id = mint_unique_id()
        self.rendezvous: dict[str, Any] = nccl_rendezvous(self.unique_id)
        self.communicator: Any = None

    def connect(self) -> None:
        """Join the communicator on the current CUDA device (returns once the engine's workers joined and the
        one-element warm-up ``all_reduce`` that vLLM's ``from_unique_id_bytes`` issues on every rank is done)."""
        communicator_cls = resolve("vllm.distributed.device_communicators.pynccl:PyNcclCommunicator")
        self.communicator = communicator_cls.from_unique_id_bytes(
            self.unique_id, rank=0, world_size=1 + self.num_workers, device=torch.accelerator.current_device_index())

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        if self.communicator is None:
            raise RuntimeError("SenderChannel: send before connect; the engine's workers have not joined")
        send_bucket(self.communicator, bucket)
