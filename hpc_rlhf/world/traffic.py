"""What the controller channel sends, as data. Pure Python: ``plan`` prices it on a login node.

``hpc_rlhf.world.channel`` moves a batch as one byte buffer per message (the pickled skeleton of the nest, then
every tensor's bytes at a ``ALIGN``-byte boundary, :func:`packed_bytes`). The functions below list the messages
every rank hands to torch.distributed for one call of the channel, given the role's replicas and each
shard's :class:`Payload`; the channel records the messages it really sends in a :class:`TrafficLedger`
(``channel.count_traffic``) and ``tests/multiproc/test_channel.py`` checks that the two agree, byte for byte.
``hpc_rlhf.planning.step_time`` prices the same lists for a whole step.

A collective counts as one message of its bytes from its root (``op="broadcast"``): that is what NCCL's
pipelined ring or tree costs the root (a hypothesis: not measured on a GPU here); gloo's binomial tree sends
more copies from the root, which ``benchmarks/controller_traffic.py`` shows as the bytes each process wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ALIGN = 16  # every tensor starts at a multiple of 16 bytes of the buffer: a typed view of it needs its
# element size to divide the offset, and vectorised kernels read 16-byte aligned memory fastest
LENGTH_BYTES = 16  # two int64 per buffer, sent ahead of it: its skeleton's length and its own
CONTROLLER = 0


def aligned(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Payload:
    """What one nest weighs on the wire: its pickled skeleton and the bytes of each of its tensors."""

    skeleton_bytes: int
    tensor_bytes: tuple[int, ...] = ()

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_bytes)


def packed_bytes(payload: Payload) -> int:
    """Bytes of the one buffer that carries ``payload``: skeleton, then each tensor at an aligned offset."""
    return aligned(payload.skeleton_bytes) + sum(aligned(b) for b in payload.tensor_bytes)


@dataclass(frozen=True)
class Message:
    """One call into torch.distributed that sends bytes: a point-to-point send, or a collective rooted at ``src``.

    ``tensor_bytes`` is the part of ``num_bytes`` that is tensor data (the rest: skeleton, lengths, padding).
    """

    op: str  # "send" | "broadcast"
    src: int
    dst: tuple[int, ...]
    num_bytes: int
    tensor_bytes: int = 0


@dataclass(frozen=True)
class ReplicaLayout:
    """The ranks of a role as the channel sees them: one tuple of ranks per data-parallel replica, its leader
    (tensor- and sequence-parallel rank 0) first; rank 0 is the controller and may be one of them."""

    replicas: tuple[tuple[int, ...], ...]

    @classmethod
    def from_ranks(cls, dp_rank_of: dict[int, int], leaders: Sequence[int]) -> ReplicaLayout:
        by_dp: dict[int, list[int]] = {}
        for rank in sorted(dp_rank_of):
            by_dp.setdefault(dp_rank_of[rank], []).append(rank)
        replicas = []
        for dp in sorted(by_dp):
            leader = next(r for r in leaders if dp_rank_of[r] == dp)
            if CONTROLLER in by_dp[dp] and leader != CONTROLLER:
                raise ValueError(f"rank {CONTROLLER} is in replica {dp} ({by_dp[dp]}) but does not lead it: the "
                                 "controller must be the first rank of its replica")
            replicas.append((leader, *(r for r in by_dp[dp] if r != leader)))
        return cls(tuple(replicas))

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(replica[0] for replica in self.replicas)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for replica in self.replicas for r in replica))

    @property
    def controller_peers(self) -> tuple[int, ...]:
        """Every rank of the role but the controller: who receives a collective over the controller group."""
        return tuple(r for r in self.ranks if r != CONTROLLER)


@dataclass
class TrafficLedger:
    """The messages one rank sent, in order (``channel.count_traffic`` fills it)."""

    messages: list[Message] = field(default_factory=list)

    def record(self, message: Message) -> None:
        self.messages.append(message)

    def clear(self) -> None:
        self.messages.clear()


def total_bytes(messages: Sequence[Message], src: int | None = CONTROLLER) -> int:
    """Bytes in ``messages`` sent by ``src`` (every sender: None)."""
    return sum(m.num_bytes for m in messages if src is None or m.src == src)


def count(messages: Sequence[Message], src: int | None = CONTROLLER) -> int:
    return sum(1 for m in messages if src is None or m.src == src)


# ---- the channel's messages, per call ---------------------------------------------------------------------

def scatter_messages(layout: ReplicaLayout, payloads: Sequence[Payload]) -> list[Message]:
    """``scatter_to_role``: rank 0 broadcasts the buffers' lengths over the role, sends shard ``i``'s buffer once
    to replica ``i``'s leader (or keeps it, when it leads that replica), and each leader broadcasts it inside
    its replica (tensor- and sequence-parallel peers: NVLink in a real allocation)."""
    if len(payloads) != len(layout.replicas):
        raise ValueError(f"{len(payloads)} payloads for {len(layout.replicas)} replicas")
    out = [Message("broadcast", CONTROLLER, layout.controller_peers, LENGTH_BYTES * len(payloads))]
    for replica, payload in zip(layout.replicas, payloads, strict=True):
        leader, size, data = replica[0], packed_bytes(payload), sum(payload.tensor_bytes)
        if leader != CONTROLLER:
            out.append(Message("send", CONTROLLER, (leader,), size, data))
        if len(replica) > 1:
            out.append(Message("broadcast", leader, replica[1:], size, data))
    return out


def gather_messages(layout: ReplicaLayout, payloads: Sequence[Payload]) -> list[Message]:
    """``gather_from_role``: every leader but rank 0 sends its buffer's length, then the buffer, to rank 0
    (``payloads``: each replica's result, in replica order)."""
    out = []
    for leader, payload in zip(layout.leaders, payloads, strict=True):
        if leader != CONTROLLER:
            out.append(Message("send", leader, (CONTROLLER,), LENGTH_BYTES))
            out.append(Message("send", leader, (CONTROLLER,), packed_bytes(payload), sum(payload.tensor_bytes)))
    return out


def broadcast_messages(layout: ReplicaLayout, payload: Payload) -> list[Message]:
    """``broadcast_to_role``: the buffer's length, then the buffer, over the role's ranks and rank 0."""
    peers = layout.controller_peers
    if not peers:
        return []
    return [Message("broadcast", CONTROLLER, peers, LENGTH_BYTES),
            Message("broadcast", CONTROLLER, peers, packed_bytes(payload), sum(payload.tensor_bytes))]


# ---- the baseline: a copy per rank, a message per tensor ---------------------------------------------------
# What the channel sent before it had the replica path and packed buffers; ``plan`` shows it next to the
# current cost and ``benchmarks/controller_traffic.py`` checks its message count against a run of that channel.

OBJECT_SIZE_BYTES = 8  # send_object_list sends the pickle's length (one int64), then the pickle


def per_rank_scatter_messages(layout: ReplicaLayout, payloads: Sequence[Payload]) -> list[Message]:
    """Every rank of the role but rank 0 gets its own copy of its replica's shard from rank 0, one after another:
    the pickled skeleton (``send_object_list``: two sends), then one send per tensor."""
    out = []
    for replica, payload in zip(layout.replicas, payloads, strict=True):
        for rank in sorted(replica):
            if rank != CONTROLLER:
                out.extend(_object_then_tensors(CONTROLLER, rank, payload))
    return out


def per_rank_gather_messages(layout: ReplicaLayout, payloads: Sequence[Payload]) -> list[Message]:
    """Every leader but rank 0 sends its result as a pickled skeleton, then one send per tensor."""
    out = []
    for leader, payload in zip(layout.leaders, payloads, strict=True):
        if leader != CONTROLLER:
            out.extend(_object_then_tensors(leader, CONTROLLER, payload))
    return out


def _object_then_tensors(src: int, dst: int, payload: Payload) -> list[Message]:
    return [Message("send", src, (dst,), OBJECT_SIZE_BYTES), Message("send", src, (dst,), payload.skeleton_bytes),
            *(Message("send", src, (dst,), b, b) for b in payload.tensor_bytes)]
