"""The sending actor rank's end of a ``server_process`` engine's NCCL weight channel.

The engine's side (its workers join the communicator, unpack each bucket) is
:meth:`hpc_rlhf.rollout.vllm_server.VllmServerEngine.open_weight_channel` and ``receive_weights``; the gloo
channel used on CPU is :class:`hpc_rlhf.weight_sync.vllm_gloo_transfer.GlooSenderChannel`. The NCCL sender has
never run on a GPU: what it does there is a hypothesis until it runs. Imports no vLLM until a channel opens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from hpc_rlhf.rollout.vllm_api import resolve
from hpc_rlhf.rollout.vllm_server import PACKED_BUFFER_BYTES, PACKED_NUM_BUFFERS


def open_sender_channel(master_address: str, master_port: int, num_workers: int) -> Any:
    """The sending actor rank's end of one engine's NCCL communicator (rank 0; hosts the rendezvous store).
    Collective with that engine's :meth:`VllmServerEngine.open_weight_channel`. Uses the current CUDA device."""
    trainer_init = resolve("vllm.distributed.weight_transfer.nccl_common:trainer_init")
    return trainer_init(init_info={"master_address": master_address, "master_port": master_port,
                                   "world_size": 1 + num_workers}, rank=0)


def send_bucket(communicator: Any, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Broadcast one bucket's tensors (CUDA, in the order the engine was told) packed, as the workers unpack."""
    producer = resolve("vllm.distributed.weight_transfer.packed_tensor:packed_nccl_broadcast_producer")
    producer(iterator=iter(bucket), group=communicator, src=0, post_iter_func=lambda item: item[1],
             buffer_size_bytes=PACKED_BUFFER_BYTES, num_buffers=PACKED_NUM_BUFFERS)


class SenderChannel:
    """One engine's NCCL communicator seen from its sending actor rank: opened once (collective with the engine's
    :meth:`VllmServerEngine.open_weight_channel`), then one :meth:`send` per bucket of every weight round.
    Never run on a GPU yet (module docstring)."""

    # A broadcast whose receivers died mid-round is expected to wait without end, with no abort in vLLM's
    # communicator (a hypothesis, never run on a GPU): such a failure ends the job (weight_round_failure).
    survives_lost_receiver = False

    def __init__(self, master_address: str, master_port: int, num_workers: int):
        self.communicator = open_sender_channel(master_address, master_port, num_workers)

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None:
        send_bucket(self.communicator, bucket)
