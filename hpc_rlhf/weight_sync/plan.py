"""Which actor rank sends which weights to the rollout engines: a pure plan, no torch.

In a layout where the rollout ranks are a subset of the world, every weight sync moves the whole policy
from the actor ranks to every rollout engine. Sending it all from one rank makes that rank's link the
bottleneck (141 GB per step for a 70B model in bf16). Instead the state dict is cut into size-bounded
buckets of consecutive tensors and the buckets are spread over the actor's *replicas* -- the groups of
ranks that together hold one full copy of the weights: one rank each under ZeRO 0-2, the tensor-parallel
group under AutoTP (its shards are all-gathered inside the group, so every rank of the group then holds the
bucket and the group's ranks take turns sending). Buckets go out in rounds: in round ``k`` every replica
sends its ``k``-th bucket, all replicas at once, so the per-rank traffic is about ``total / num_replicas``.

Engines that accept a single sender (vLLM in processes of its own, over its NCCL weight transfer) take
every bucket from one actor rank instead; ``assign_engine_senders`` spreads the engines over the replicas.

ZeRO-3 is not planned here: its gathering is collective over the whole dp group (every rank receives every
bucket anyway), and it runs in the colocated layout only, where the weights load in-process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SyncBucket:
    """One bucket of the state dict: ``names`` (consecutive state-dict entries, ``nbytes`` of full tensors),
    gathered by every rank of ``replica`` and sent by ``sender`` (a member of ``replica``)."""

    index: int
    names: tuple[str, ...]
    nbytes: int
    replica: tuple[int, ...]
    sender: int


@dataclass(frozen=True)
class WeightSyncPlan:
    """Buckets grouped into rounds: ``rounds[k]`` holds at most one bucket per replica (sent concurrently)."""

    rounds: tuple[tuple[SyncBucket, ...], ...]

    @property
    def buckets(self) -> list[SyncBucket]:
        return sorted((b for r in self.rounds for b in r), key=lambda b: b.index)

    def bytes_per_sender(self) -> dict[int, int]:
        sent: dict[int, int] = {}
        for bucket in self.buckets:
            sent[bucket.sender] = sent.get(bucket.sender, 0) + bucket.nbytes
        return sent

    def buckets_of_replica(self, replica: tuple[int, ...]) -> list[SyncBucket]:
        """What the ranks of ``replica`` gather, in round order (every rank of it must take part)."""
        return [b for r in self.rounds for b in r if b.replica == replica]


def bucket_size_for(total_bytes: int, num_replicas: int, max_bytes: int, min_bytes: int = 1 << 20,
                    buckets_per_replica: int = 4) -> int:
    """A bucket size that gives every replica about ``buckets_per_replica`` buckets (so the largest-first
    spreading evens out the bytes), within [``min_bytes``, ``max_bytes``]: big enough that one collective
    per bucket costs little next to its transfer, small enough to bound the memory of a flat bucket."""
    share = total_bytes // max(1, num_replicas * buckets_per_replica)
    return min(max_bytes, max(min_bytes, share))


def pack_consecutive(sizes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into consecutive runs of about ``bucket_bytes``: a run closes as soon as it
    reaches the limit, so one tensor larger than the limit is a bucket of its own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    runs: list[list[int]] = []
    run: list[int] = []
    size = 0
    for i, nbytes in enumerate(sizes):
        run.append(i)
        size += nbytes
        if size >= bucket_bytes:
            runs.append(run)
            run, size = [], 0
    if run:
        runs.append(run)
    return runs


def plan_weight_sync(entries: Sequence[tuple[str, int]], replicas: Sequence[Sequence[int]],
                     bucket_bytes: int) -> WeightSyncPlan:
    """Cut ``entries`` ((name, full bytes) in state-dict order) into buckets and spread them over ``replicas``.

    Buckets are handed out largest first to the replica with the fewest bytes so far (ties: the earlier
    replica), so the busiest sender carries at most one bucket more than its share; inside a replica its
    ranks send its buckets in turn. Deterministic: every actor rank computes the same plan.

    Raises:
        ValueError: no replica, an empty or duplicated replica, or duplicated names.
    """
    groups = [tuple(r) for r in replicas]
    if not groups or any(not g for g in groups):
        raise ValueError(f"weight sync needs at least one non-empty replica, got {groups}")
    flat = [r for g in groups for r in g]
    if len(set(flat)) != len(flat):
        raise ValueError(f"a rank appears in two replicas: {groups}")
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("state-dict names must be unique")
    runs = pack_consecutive([nbytes for _, nbytes in entries], bucket_bytes)
    sizes = [sum(entries[i][1] for i in run) for run in runs]
    load = [0] * len(groups)
    owner = [0] * len(runs)
    for b in sorted(range(len(runs)), key=lambda b: (-sizes[b], b)):
        owner[b] = min(range(len(groups)), key=lambda g: (load[g], g))
        load[owner[b]] += sizes[b]
    per_replica: list[list[SyncBucket]] = [[] for _ in groups]
    for b, run in enumerate(runs):
        g = owner[b]
        turn = len(per_replica[g])
        per_replica[g].append(SyncBucket(b, tuple(entries[i][0] for i in run), sizes[b], groups[g],
                                         groups[g][turn % len(groups[g])]))
    depth = max(len(q) for q in per_replica)
    rounds = tuple(tuple(q[k] for q in per_replica if k < len(q)) for k in range(depth))
    return WeightSyncPlan(rounds)


def assign_engine_senders(engine_ranks: Sequence[int], replicas: Sequence[Sequence[int]],
                          controller_rank: int = 0) -> dict[int, int]:
    """{engine rank: the one actor rank that sends it every bucket}, for engines fed over a communicator of their
    own whose single sender is its rank 0 (vLLM's NCCL weight transfer, ``rollout.vllm_mode=server_process``).

    Engines go round-robin over the replicas, so with R engines and A replicas every replica feeds R // A or
    R // A + 1 engines and all of them send at once; inside a replica (a tensor-parallel group, whose ranks all
    hold each gathered bucket) its ranks take turns. The controller's replica comes last in the rotation and the
    controller last in its replica, so the controller feeds at most its share of engines, and none while other
    ranks are idle. Pure and deterministic: every rank computes the same assignment.

    Raises:
        ValueError: no engine, no replica, an empty or duplicated replica, or an engine rank that is an actor rank.
    """
    groups = [tuple(r) for r in replicas]
    if not engine_ranks or not groups or any(not g for g in groups):
        raise ValueError(f"assigning senders needs engines and non-empty replicas, got {list(engine_ranks)} "
                         f"and {groups}")
    flat = [r for g in groups for r in g]
    if len(set(flat)) != len(flat):
        raise ValueError(f"a rank appears in two replicas: {groups}")
    if set(flat) & set(engine_ranks):
        raise ValueError(f"engine ranks {sorted(set(flat) & set(engine_ranks))} are also actor ranks")

    def controller_last(ranks: Sequence[int]) -> list[int]:
        return sorted(ranks, key=lambda r: r == controller_rank)  # stable: the order is kept otherwise

    order = sorted(groups, key=lambda g: controller_rank in g)
    members = [controller_last(g) for g in order]
    assignment = {}
    for i, engine in enumerate(engine_ranks):
        replica, turn = members[i % len(order)], i // len(order)
        assignment[engine] = replica[turn % len(replica)]
    return assignment
