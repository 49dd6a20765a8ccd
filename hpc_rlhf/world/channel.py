"""Move batches between the controller (rank 0) and a role group.

A batch is any nest (``torch.utils._pytree``: dicts, lists, tuples, named tuples) of tensors and picklable
Python objects. It travels as ONE byte buffer per message: the pickled skeleton of the nest (tensors replaced
by their shape and dtype), then every tensor's bytes at a 16-byte boundary; the receiver unpickles the
skeleton and takes each tensor as a typed view of the buffer, without a copy (so one received tensor keeps
the whole buffer alive: clone it to keep it alone, e.g. before ``torch.save``). The buffer's length travels
ahead of it in a small int64 message. One buffer for all dtypes, rather than one per dtype, keeps a shard at
one message however many fields and dtypes it has.

The data path, and what each step costs (NCCL costs are hypotheses: nothing here ran on a GPU):

- ``scatter_to_role``: rank 0 broadcasts the buffers' lengths over the role (16 bytes per replica), then sends
  each data-parallel shard ONCE, to its replica's leader, all replicas at once (``batch_isend_irecv``: on NCCL
  one grouped launch on the controller group's communicator, on gloo one non-blocking send each); each leader
  broadcasts the buffer inside its replica's tensor/sequence-parallel group (``RoleGroups.replica_group``:
  the same node, NVLink, in a real allocation). Rank 0's NIC carries each shard once, not tp x sp times.
  Not ``dist.scatter``: shards differ in size and gloo's scatter takes equal sizes (padding costs bytes),
  and NCCL implements scatter as the same grouped sends.
- ``gather_from_role``: each leader sends its buffer's length, then the buffer, to rank 0; rank 0 receives
  from all leaders at once. Tensor/sequence-parallel peers send nothing (their leader holds the same values).
- ``broadcast_to_role``: length, then buffer, as two broadcasts over the controller group: a pipelined ring
  or tree on NCCL sends each byte out of rank 0 about once; gloo's broadcast is a binomial tree (the root
  sends ~log2(ranks) copies, ``benchmarks/controller_traffic.py`` shows the bytes).

Every rank counts what it sends into a :class:`~hpc_rlhf.world.traffic.TrafficLedger` while
:func:`count_traffic` is open; ``hpc_rlhf.world.traffic`` lists the same messages from the layout alone (what
``plan`` prices). Every function is collective over ``RoleGroups.controller_ranks`` (the role's ranks plus rank
0): each of those ranks must call it, in the same order, and other ranks must not. Under NCCL the first call on a
role's groups must be a broadcast or a scatter (they start with a collective over every rank, which is where
NCCL builds the communicator that the grouped point-to-point sends then use); the trainer always scatters first.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from hpc_rlhf.world.groups import RoleGroups, comm_device
from hpc_rlhf.world.traffic import (
    CONTROLLER,
    Message,
    Payload,
    ReplicaLayout,
    TrafficLedger,
    aligned,
    packed_bytes,
)

_ledger: TrafficLedger | None = None


@contextmanager
def count_traffic() -> Iterator[TrafficLedger]:
    """Record every message this rank sends through the channel while the block runs."""
    global _ledger
    previous, _ledger = _ledger, TrafficLedger()
    try:
        yield _ledger
    finally:
        _ledger = previous


def _record(op: str, dst: Sequence[int], buffer: torch.Tensor, tensor_bytes: int = 0) -> None:
    if _ledger is not None:
        _ledger.record(Message(op, dist.get_rank(), tuple(dst), buffer.numel() * buffer.element_size(), tensor_bytes))


# ---- packing: a nest <-> one byte buffer --------------------------------------------------------------------

@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _skeleton(obj: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The pickled nest with every tensor replaced by its slot, and the tensors in leaf order."""
    leaves, spec = pytree.tree_flatten(obj)
    tensors = [leaf.detach() for leaf in leaves if isinstance(leaf, torch.Tensor)]
    slots = [_TensorSlot(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves]
    return pickle.dumps(pytree.tree_unflatten(slots, spec), protocol=pickle.HIGHEST_PROTOCOL), tensors


def payload_of(obj: Any) -> Payload:
    """What ``obj`` weighs on the wire (``hpc_rlhf.world.traffic`` prices the messages from it)."""
    head, tensors = _skeleton(obj)
    return Payload(len(head), tuple(t.numel() * t.element_size() for t in tensors))


def _pack(obj: Any, device: torch.device) -> tuple[torch.Tensor, Payload]:
    """``obj`` -> (uint8 buffer of ``packed_bytes(payload)`` on ``device``, payload)."""
    head, tensors = _skeleton(obj)
    payload = Payload(len(head), tuple(t.numel() * t.element_size() for t in tensors))
    buffer = torch.empty(packed_bytes(payload), dtype=torch.uint8, device=device)
    buffer[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    offset = aligned(len(head))
    for tensor, num_bytes in zip(tensors, payload.tensor_bytes, strict=True):
        buffer[offset : offset + num_bytes].view(tensor.dtype).copy_(tensor.reshape(-1))
        offset += aligned(num_bytes)
    return buffer, payload


def _unpack(buffer: torch.Tensor, skeleton_bytes: int) -> tuple[Any, int]:
    """(the nest in ``buffer``, its tensor bytes); its tensors are views of the buffer."""
    leaves, spec = pytree.tree_flatten(pickle.loads(buffer[:skeleton_bytes].cpu().numpy().tobytes()))
    offset, filled, tensor_bytes = aligned(skeleton_bytes), [], 0
    for leaf in leaves:
        if isinstance(leaf, _TensorSlot):
            filled.append(buffer[offset : offset + leaf.num_bytes].view(leaf.dtype).view(leaf.shape))
            offset += aligned(leaf.num_bytes)
            tensor_bytes += leaf.num_bytes
        else:
            filled.append(leaf)
    return pytree.tree_unflatten(filled, spec), tensor_bytes


def _lengths(payload: Payload, buffer: torch.Tensor) -> list[int]:
    return [payload.skeleton_bytes, buffer.numel()]


# ---- the wire: every send goes through these, so the ledger sees it ------------------------------------------

def _broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None, receivers: Sequence[int],
               tensor_bytes: int = 0) -> None:
    if dist.get_rank() == src:
        _record("broadcast", receivers, tensor, tensor_bytes)
    dist.broadcast(tensor, src=src, group=group)


def _send_all(sends: Sequence[tuple[torch.Tensor, int, int]], group: dist.ProcessGroup | None) -> list:
    """Start ``(tensor, dst, tensor_bytes)`` sends at once; returns the works to wait on."""
    for tensor, dst, tensor_bytes in sends:
        _record("send", (dst,), tensor, tensor_bytes)
    ops = [dist.P2POp(dist.isend, tensor, dst, group) for tensor, dst, _ in sends]
    return dist.batch_isend_irecv(ops) if ops else []


def _recv_all(recvs: Sequence[tuple[torch.Tensor, int]], group: dist.ProcessGroup | None) -> None:
    """Receive ``(tensor, src)`` pairs, all posted at once."""
    ops = [dist.P2POp(dist.irecv, tensor, src, group) for tensor, src in recvs]
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _require_member(groups: RoleGroups) -> int:
    rank = dist.get_rank()
    if rank not in groups.controller_ranks:
        raise RuntimeError(f"rank {rank} called a controller collective for role {groups.role!r} it is not part of")
    return rank


def replica_layout(groups: RoleGroups) -> ReplicaLayout:
    return ReplicaLayout.from_ranks(groups.dp_rank_of, groups.dp_leaders)


# ---- the three moves ------------------------------------------------------------------------------------------

def broadcast_to_role(batch: Any, groups: RoleGroups) -> Any:
    """Rank 0 passes ``batch``; every rank of the role gets a copy (rank 0 gets its own back)."""
    rank = _require_member(groups)
    receivers = [r for r in groups.controller_ranks if r != CONTROLLER]
    if not receivers:
        return batch
    device = comm_device()
    if rank == CONTROLLER:
        buffer, payload = _pack(batch, device)
        lengths = torch.tensor(_lengths(payload, buffer), dtype=torch.int64, device=device)
    else:
        lengths = torch.empty(2, dtype=torch.int64, device=device)
    _broadcast(lengths, CONTROLLER, groups.controller_group, receivers)
    skeleton_bytes, num_bytes = lengths.tolist()
    if rank != CONTROLLER:
        buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    _broadcast(buffer, CONTROLLER, groups.controller_group, receivers,
               sum(payload.tensor_bytes) if rank == CONTROLLER else 0)
    return batch if rank == CONTROLLER else _unpack(buffer, skeleton_bytes)[0]


def scatter_to_role(shards: list[Any] | None, groups: RoleGroups) -> Any:
    """Deliver ``shards[dp_rank]`` to every rank of the role (tensor/sequence peers get the same shard).

    Args:
        shards: on rank 0, one entry per data-parallel replica; ignored elsewhere.

    Returns:
        This rank's shard; on rank 0 its own shard if it is in the role, else ``None``.
    """
    rank = _require_member(groups)
    layout = replica_layout(groups)
    device = comm_device()
    num_dp = len(layout.replicas)
    packed: list[tuple[torch.Tensor, Payload]] = []
    if rank == CONTROLLER:
        if shards is None or len(shards) != num_dp:
            raise ValueError(f"role {groups.role!r} has {num_dp} data-parallel ranks but got "
                             f"{None if shards is None else len(shards)} shards")
        if not layout.controller_peers:
            return shards[0]
        packed = [_pack(shard, device) for shard in shards]
        lengths = torch.tensor([_lengths(p, b) for b, p in packed], dtype=torch.int64, device=device)
    else:
        lengths = torch.empty(num_dp, 2, dtype=torch.int64, device=device)
    _broadcast(lengths, CONTROLLER, groups.controller_group, layout.controller_peers)
    sizes = lengths.tolist()
    works = []
    if rank == CONTROLLER:
        works = _send_all([(buffer, leader, sum(payload.tensor_bytes))
                           for leader, (buffer, payload) in zip(layout.leaders, packed, strict=True)
                           if leader != CONTROLLER], groups.controller_group)
    mine = None
    if rank in groups.ranks:
        dp = groups.dp_rank_of[rank]
        replica, (skeleton_bytes, num_bytes) = layout.replicas[dp], sizes[dp]
        leader, forwarded = replica[0], 0  # forwarded: the tensor bytes a leader passes on (for the ledger)
        if rank == CONTROLLER:
            assert shards is not None  # checked above
            (buffer, payload), mine = packed[dp], shards[dp]
            forwarded = sum(payload.tensor_bytes)
        else:
            buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
            if rank == leader:
                _recv_all([(buffer, CONTROLLER)], groups.controller_group)
                mine, forwarded = _unpack(buffer, skeleton_bytes)
        if len(replica) > 1:
            _broadcast(buffer, leader, groups.replica_group, replica[1:], forwarded)
        if rank != leader:  # rank 0 always leads its replica (ReplicaLayout.from_ranks)
            mine, _ = _unpack(buffer, skeleton_bytes)
    for work in works:
        work.wait()
    return mine


def gather_from_role(result: Any, groups: RoleGroups) -> list[Any] | None:
    """Collect one result per data-parallel replica (from its leader) on rank 0, ordered by dp rank.

    Non-leader ranks (tp/sp peers) pass their result too; it is ignored, as their replica's leader
    holds the same values.
    """
    rank = _require_member(groups)
    layout = replica_layout(groups)
    device = comm_device()
    others = [leader for leader in layout.leaders if leader != CONTROLLER]
    if rank in others:
        buffer, payload = _pack(result, device)
        lengths = torch.tensor(_lengths(payload, buffer), dtype=torch.int64, device=device)
        works = _send_all([(lengths, CONTROLLER, 0)], groups.controller_group)
        works += _send_all([(buffer, CONTROLLER, sum(payload.tensor_bytes))], groups.controller_group)
        for work in works:
            work.wait()
        return None
    if rank != CONTROLLER:
        return None
    headers = {leader: torch.empty(2, dtype=torch.int64, device=device) for leader in others}
    _recv_all([(headers[leader], leader) for leader in others], groups.controller_group)
    sizes = {leader: headers[leader].tolist() for leader in others}
    buffers = {leader: torch.empty(sizes[leader][1], dtype=torch.uint8, device=device) for leader in others}
    _recv_all([(buffers[leader], leader) for leader in others], groups.controller_group)
    return [result if leader == CONTROLLER else _unpack(buffers[leader], sizes[leader][0])[0]
            for leader in layout.leaders]
