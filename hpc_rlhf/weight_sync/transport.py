"""Moving weight buckets from the actor ranks that hold them to every rollout engine.

A bucket travels as one flat byte tensor (``pack_bucket``) plus a small header (names, shapes, dtypes,
offsets), so each bucket costs one collective whatever its tensors' dtypes. The header is sent with a
bucket's first transfer only and cached on both sides: shapes and dtypes do not change between syncs.

``WeightTransport`` is the seam between the plan (``weight_sync.plan``) and a wire. ``GroupBroadcastTransport``
broadcasts over torch.distributed groups of the main world, one group per sender (the sender plus every
rollout rank), all senders of a round at once (``async_op``), so the transfers of different senders overlap.
vLLM in processes of its own takes every bucket from one sender over a communicator of its own instead:
``hpc_rlhf.weight_sync.sharded.EngineChannelWeightSync``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from hpc_rlhf.weight_sync.plan import SyncBucket
from hpc_rlhf.world.groups import new_group

_ALIGN = 16  # byte offset of every tensor in a flat bucket: a slice viewed as any dtype stays aligned


@dataclass(frozen=True)
class BucketHeader:
    """Where each tensor of a flat bucket lies: ``offsets[i]`` bytes in, ``shapes[i]`` of ``dtypes[i]``."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_bucket(named_tensors: Iterable[tuple[str, torch.Tensor]],
                device: torch.device | None = None) -> tuple[BucketHeader, torch.Tensor]:
    """(header, flat uint8 tensor of ``header.nbytes``) holding every tensor's bytes at an aligned offset."""
    items = list(named_tensors)
    offsets, offset = [], 0
    for _, t in items:
        offsets.append(offset)
        offset = _aligned(offset + t.numel() * t.element_size())
    device = device or (items[0][1].device if items else torch.device("cpu"))
    flat = torch.empty(offset, dtype=torch.uint8, device=device)
    for (_, t), start in zip(items, offsets, strict=True):
        n = t.numel() * t.element_size()
        flat[start:start + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    header = BucketHeader(tuple(n for n, _ in items), tuple(tuple(t.shape) for _, t in items),
                          tuple(t.dtype for _, t in items), tuple(offsets), offset)
    return header, flat


def unpack_bucket(header: BucketHeader, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into ``flat`` (no copy), one per tensor of ``header``."""
    out = []
    for name, shape, dtype, start in zip(header.names, header.shapes, header.dtypes, header.offsets, strict=True):
        n = torch.Size(shape).numel() * dtype.itemsize
        out.append((name, flat[start:start + n].view(dtype).reshape(shape)))
    return out


class BucketSink(Protocol):
    """Where a rollout rank puts the buckets it receives: a ``RolloutEngine`` is one."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


class WeightTransport(ABC):
    """One round of a ``WeightSyncPlan`` at a time: senders call ``send``, rollout ranks ``receive``."""

    @abstractmethod
    def send(self, bucket: SyncBucket, header: BucketHeader, flat: torch.Tensor) -> None:
        """Send this rank's bucket of the round to every rollout engine (returns once it is out)."""

    @abstractmethod
    def receive(self, round_buckets: Sequence[SyncBucket], sink: BucketSink) -> None:
        """Receive every bucket of the round (concurrently from their senders) into ``sink``."""

    @property
    @abstractmethod
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent so far (headers excluded)."""


def sender_groups(sender_ranks: Sequence[int], rollout_ranks: Sequence[int]) -> dict[int, dist.ProcessGroup | None]:
    """{sender: group of the sender and every rollout rank}; collective: every rank of the world calls it with the
    same arguments, in the same order (``hpc_rlhf.world.groups.new_group``)."""
    rank = dist.get_rank()
    groups = {}
    for sender in sender_ranks:
        members = sorted({sender, *rollout_ranks})
        handle = new_group(members)
        groups[sender] = handle if rank in members else None
    return groups


class GroupBroadcastTransport(WeightTransport):
    """Broadcast over one torch.distributed group per sender (``sender_groups``)."""

    def __init__(self, groups: dict[int, dist.ProcessGroup | None], device: torch.device):
        self.groups = groups
        self.device = device
        self._headers: dict[int, BucketHeader] = {}  # bucket index -> header, cached after the first sync
        self._bytes_sent = 0

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def _header(self, bucket: SyncBucket, header: BucketHeader | None) -> BucketHeader:
        """The header on every member of the sender's group: broadcast once, then cached."""
        if bucket.index not in self._headers:
            box = [header]
            dist.broadcast_object_list(box, src=bucket.sender, group=self.groups[bucket.sender], device=self.device)
            if box[0] is None:
                raise RuntimeError(f"bucket {bucket.index}: its sender, rank {bucket.sender}, broadcast no header")
            self._headers[bucket.index] = box[0]
        return self._headers[bucket.index]

    def send(self, bucket: SyncBucket, header: BucketHeader, flat: torch.Tensor) -> None:
        self._header(bucket, header)
        dist.broadcast(flat.to(self.device), src=bucket.sender, group=self.groups[bucket.sender])
        self._bytes_sent += flat.numel()

    def receive(self, round_buckets: Sequence[SyncBucket], sink: BucketSink) -> None:
        headers = [self._header(b, None) for b in round_buckets]  # senders answer in this (plan) order
        flats = [torch.empty(h.nbytes, dtype=torch.uint8, device=self.device) for h in headers]
        works = [dist.broadcast(flat, src=b.sender, group=self.groups[b.sender], async_op=True)
                 for b, flat in zip(round_buckets, flats, strict=True)]
        for header, flat, work in zip(headers, flats, works, strict=True):
            work.wait()
            sink.update_weights(unpack_bucket(header, flat))
