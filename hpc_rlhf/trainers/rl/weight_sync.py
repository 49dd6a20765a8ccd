"""Actor -> rollout weight sync where the rollout ranks are a subset of the world (disaggregated, partial,
asynchronous layouts). The colocated layout loads weights in-process instead (``PPOTrainer.sync_weights``).

The weights leave from the ranks that hold them: the plan (``weight_sync_plan``) spreads size-bounded buckets
over the actor's replicas (one rank each under ZeRO 0-2, the tp group under AutoTP), every replica gathers only
its own buckets, and in each round all senders broadcast one flat bucket at once (``weight_transport``). Rank 0
is one sender among the others: it carries its share of the bytes, not the whole model.
"""

from __future__ import annotations

from hpc_rlhf.engines.weight_sync_plan import WeightSyncPlan, bucket_size_for, plan_weight_sync
from hpc_rlhf.engines.weight_transport import (
    BucketSink,
    GroupBroadcastTransport,
    WeightTransport,
    pack_bucket,
    sender_groups,
)
from hpc_rlhf.world.channel import broadcast_to_role
from hpc_rlhf.world.groups import WorldGroups, comm_device


class ShardedWeightSync:
    """Built collectively by every rank (it creates one group per actor rank); then ``send`` on actor ranks and
    ``receive`` on rollout ranks, once per sync. The plan is computed on the actor ranks at the first sync (from
    the actor's state-dict sizes) and sent once by rank 0 to the rollout ranks; later syncs reuse it."""

    def __init__(self, world: WorldGroups, bucket_bytes: int = 256 << 20, transport: WeightTransport | None = None):
        """``bucket_bytes``: the largest bucket (smaller ones where the model is small: ``bucket_size_for``)."""
        placement = world.placement
        if placement.layout == "colocated":
            raise ValueError("ShardedWeightSync is for layouts where rollout ranks are a subset of the world; the "
                             "colocated layout loads weights in-process")
        self.world = world
        self.bucket_bytes = bucket_bytes
        actor, rollout = placement.roles["actor"], placement.roles["rollout"]
        self.replicas = [tuple(g) for g in actor.tp_groups]  # per (dp, sp) replica: the ranks holding one copy
        self.transport = transport or GroupBroadcastTransport(sender_groups(actor.ranks, rollout.ranks),
                                                              comm_device())
        self.plan: WeightSyncPlan | None = None

    def send(self, actor) -> None:
        """Actor ranks: gather this rank's replica's buckets (collective over its tp group) and send the ones
        this rank is the sender of. ``actor``: a ``TrainEngine`` (``state_dict_sizes``,
        ``gathered_state_dict_items(names=...)``)."""
        rank = self.world.rank
        if getattr(actor, "zero_stage", 0) == 3:  # check_engines_can_run refuses the layout before this
            raise ValueError("sharded weight sync plans ZeRO 0-2 replicas; ZeRO-3 runs in the colocated layout only")
        if self.plan is None:
            sizes = actor.state_dict_sizes()
            bucket_bytes = bucket_size_for(sum(n for _, n in sizes), len(self.replicas), self.bucket_bytes)
            self.plan = plan_weight_sync(sizes, self.replicas, bucket_bytes)
            if rank == self.world.placement.controller_rank:
                broadcast_to_role(self.plan, self.world.roles["rollout"])
        replica = next(r for r in self.replicas if rank in r)
        mine = self.plan.buckets_of_replica(replica)
        gathered = actor.gathered_state_dict_items(names=[list(b.names) for b in mine])
        for bucket, named in zip(mine, gathered, strict=True):
            if bucket.sender == rank:
                self.transport.send(bucket, *pack_bucket(named, comm_device()))

    def receive(self, sink: BucketSink) -> None:
        """Rollout ranks: every bucket of every round into ``sink`` (a rollout engine's ``update_weights``)."""
        if self.plan is None:
            self.plan = broadcast_to_role(None, self.world.roles["rollout"])
        for round_buckets in self.plan.rounds:
            self.transport.receive(round_buckets, sink)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent over all syncs."""
        return self.transport.bytes_sent

