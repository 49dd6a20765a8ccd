"""Actor -> rollout weight sync where the rollout ranks are a subset of the world (disaggregated, partial,
asynchronous layouts). The colocated layout loads weights in-process instead (``RoleWorker.sync_weights``).

Two paths, one interface (``send(actor)`` on actor ranks, ``receive(engine)`` on rollout ranks, once per sync;
``build_weight_sync`` picks one from the config):

- ``ShardedWeightSync``, for engines living in the rollout rank's process (the transformers engine): the plan
  (``weight_sync.plan``) spreads size-bounded buckets over the actor's replicas (one rank each under ZeRO 0-2,
  the tp group under AutoTP), every replica gathers only its own buckets, and in each round all senders
  broadcast one flat bucket at once over groups of the main world (``weight_sync.transport``). Rank 0 is one sender
  among the others: it carries its share of the bytes, not the whole model.
- ``EngineChannelWeightSync``, for vLLM in processes of its own (``rollout.vllm_mode=server_process``): each
  engine takes every bucket from one actor rank over a communicator of its own (vLLM's weight transfer allows one
  sender per engine: NCCL on CUDA, our gloo backend on CPU, ``vllm_transfer_info.transfer_backend``), the engines spread
  round-robin over the replicas (``assign_engine_senders``) so they are fed in parallel. The main world carries
  only the rendezvous and the buckets' descriptions, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hpc_rlhf.config.rollout import RolloutConfig, rollout_engine_kind
from hpc_rlhf.rollout.base import RolloutEngine
from hpc_rlhf.rollout.engine_restart import EngineFailure, EngineRestartLimitError, Restartable
from hpc_rlhf.rollout.weight_round_failure import LostReceivers
from hpc_rlhf.weight_sync.plan import (
    WeightSyncPlan,
    assign_engine_senders,
    bucket_size_for,
    pack_consecutive,
    plan_weight_sync,
)
from hpc_rlhf.weight_sync.transport import (
    BucketSink,
    GroupBroadcastTransport,
    WeightTransport,
    pack_bucket,
    sender_groups,
)
from hpc_rlhf.weight_sync.vllm_gloo_transfer import GlooSenderChannel
from hpc_rlhf.weight_sync.vllm_nccl_transfer import SenderChannel  # vLLM itself: only when a channel opens
from hpc_rlhf.weight_sync.vllm_transfer_info import transfer_backend
from hpc_rlhf.world.channel import broadcast_to_role
from hpc_rlhf.world.groups import WorldGroups, comm_device, new_group
from hpc_rlhf.world.launch_env import host_address

log = logging.getLogger(__name__)


class ActorWeights(Protocol):
    """What a weight sync reads from the actor on an actor rank: a ``TrainEngine``, or ``state_gather.ModuleWeights``
    for a plain module."""

    zero_stage: int

    def state_dict_sizes(self) -> list[tuple[str, int]]: ...

    def gathered_state_dict_items(self, bucket_bytes: int = ...,
                                  names: list[list[str]] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]: ...


class ShardedWeightSync:
    """Built collectively by every rank (it creates one group per actor rank); then ``send`` on actor ranks and
    ``receive`` on rollout ranks, once per sync. The plan is computed by rank 0 (an actor rank) at the first sync
    from the actor's state-dict sizes and sent once to the actor and rollout ranks; later syncs reuse it."""

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

    def send(self, actor: ActorWeights) -> None:
        """Actor ranks: gather this rank's replica's buckets (collective over its tp group) and send the ones
        this rank is the sender of."""
        rank = self.world.rank
        if actor.zero_stage == 3:  # check_engines_can_run refuses the layout before this
            raise ValueError("sharded weight sync plans ZeRO 0-2 replicas; ZeRO-3 runs in the colocated layout only")
        if self.plan is None:
            # One plan, made on the controller (an actor rank) and broadcast: under AutoTP each rank sees its own
            # shard sizes, and uneven shards would give tensor-parallel peers different buckets.
            controller = rank == self.world.placement.controller_rank
            plan = None
            if controller:
                sizes = actor.state_dict_sizes()
                bucket_bytes = bucket_size_for(sum(n for _, n in sizes), len(self.replicas), self.bucket_bytes)
                plan = plan_weight_sync(sizes, self.replicas, bucket_bytes)
            self.plan = broadcast_to_role(plan, self.world.roles["actor"])
            if controller:
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


class EngineChannel(Protocol):
    """The sending actor rank's end of one engine's communicator (``vllm_nccl_transfer.SenderChannel``,
    ``vllm_gloo_transfer.GlooSenderChannel``): made with its ``rendezvous`` (what the engine's rank passes to its
    ``open_weight_channel``; it travels over the world's group, never through a store of its own), then ``connect``,
    collective with that ``open_weight_channel``, then ``send`` per bucket. A channel whose ``send`` fails at once,
    and leaves it free, when the engine's workers died may say so with ``survives_lost_receiver = True``: the
    sender then goes on with the round without that engine (``weight_round_failure.LostReceivers``); without it,
    such a failure ends the job."""

    rendezvous: dict[str, Any]

    def connect(self) -> None: ...

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> None: ...


# The engine's worker count -> the sender's end of a new channel, not yet connected.
OpenChannel = Callable[[int], EngineChannel]


def _open_vllm_channel(num_workers: int) -> EngineChannel:
    """The sender's end for this machine's backend (``vllm_transfer_info.transfer_backend``, the rule the engine
    follows): vLLM's NCCL on CUDA (never run on a GPU yet), our gloo group without it."""
    if transfer_backend(torch.cuda.is_available()) == "nccl":
        return SenderChannel(num_workers)
    return GlooSenderChannel(num_workers, host_address())


def _describe(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(name, tuple(t.shape), t.dtype) for name, t in bucket]


class EngineChannelWeightSync:
    """Weight sync to rollout engines that run in processes of their own and take their weights over a
    communicator per engine with one sender (``rollout.vllm_mode=server_process``).

    Built collectively by every rank (one control-plane group per sender: the sender and the rollout ranks it
    feeds). The first sync opens the channels (lazily: the engines exist only after the trainer's roles are
    built): each sender makes one channel per engine (NCCL: a fresh unique id; gloo: a sealed store bound on a port
    the kernel picks, and kept), sends their rendezvous over its group, and connects the engines' channels one after
    the other while each engine's rank opens its end (the communicator's init is collective between the two; each rank
    blocks in its own open only, so no order deadlocks). Every sync, the senders' replicas gather the whole state
    dict bucket by bucket (every rank of a tp group takes part; replicas feeding no engine skip the gathering)
    and each sender sends every bucket to each of its engines. The engine needs each bucket's names, shapes and
    dtypes before its transfer: they go over the group with the first sync's buckets and are cached.

    Args:
        world: the world's groups (placement: rollout ranks disjoint from actor ranks, one engine per rollout rank).
        bucket_bytes: the largest bucket (each bucket is one transfer and one ``update_weights`` on the engine).
        num_workers: worker processes of each engine (its tensor-parallel size).
        open_channel: makes the sender's end of one engine's communicator (vLLM's by default).
    """

    def __init__(self, world: WorldGroups, bucket_bytes: int = 256 << 20, num_workers: int = 1,
                 open_channel: OpenChannel = _open_vllm_channel):
        placement = world.placement
        actor, rollout = placement.roles["actor"], placement.roles["rollout"]
        self.world = world
        self.bucket_bytes = bucket_bytes
        self.num_workers = num_workers
        self.open_channel = open_channel
        self.replicas = [tuple(g) for g in actor.tp_groups]
        self.sender_of = assign_engine_senders(rollout.ranks, self.replicas, placement.controller_rank)
        self.engines_of: dict[int, list[int]] = {}
        for engine, sender in self.sender_of.items():
            self.engines_of.setdefault(sender, []).append(engine)
        self.groups = {}
        for sender in sorted(self.engines_of):  # collective: every rank creates every group, in this order
            members = [sender, *self.engines_of[sender]]
            group = new_group(sorted(members))
            self.groups[sender] = group if world.rank in members else None
        self.channels: dict[int, EngineChannel] = {}  # senders: engine rank -> open channel
        self.bucket_names: list[list[str]] | None = None  # senders' replicas: the buckets, in send order
        self.descriptions: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []  # per bucket, cached
        self.num_buckets: int | None = None  # rollout ranks: learnt at the rendezvous
        self.rounds = 0  # weight rounds this rank took part in (engine restarts are served only after the first)
        self.lost = LostReceivers(world.rank)  # senders: engines whose last round failed, until they restart
        self._bytes_sent = 0

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has sent over all syncs (each engine's copy counted)."""
        return self._bytes_sent

    def _broadcast(self, obj: Any, sender: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=sender, group=self.groups[sender], device=comm_device())
        return box[0]

    # ------------------------------------------------------------------ actor ranks
    def send(self, actor: ActorWeights) -> None:
        """Actor ranks: one weight round from ``actor`` to the engines this rank feeds."""
        rank = self.world.rank
        if actor.zero_stage == 3:  # check_engines_can_run refuses the layout before this
            raise ValueError("weight sync to server_process engines plans ZeRO 0-2 replicas; ZeRO-3 runs in the "
                             "colocated layout only")
        replica = next(r for r in self.replicas if rank in r)
        if not any(r in self.engines_of for r in replica):
            return  # this replica feeds no engine
        self.serve(actor)  # an engine that died since the last service point comes back first
        if self.bucket_names is None:
            self.bucket_names = self._plan_buckets(actor, replica)
        engines = self.engines_of.get(rank, [])
        if engines and not self.channels:
            self._open_sender(engines)
        self._send_round(actor, engines)
        self.rounds += 1

    def _send_round(self, actor: ActorWeights, engines: list[int]) -> None:
        """Every bucket to ``engines`` (this rank's, or none: its replica's peers gather with it)."""
        if self.bucket_names is None:
            raise RuntimeError(f"rank {self.world.rank}: a weight round before its buckets were planned")
        rank = self.world.rank
        # Every rank of the replica gathers (collective over its tp group); only the sender sends.
        for index, bucket in enumerate(actor.gathered_state_dict_items(names=self.bucket_names)):
            if not engines:
                continue
            if index == len(self.descriptions):  # first sync: the engines learn what this bucket holds
                self.descriptions.append(self._broadcast(_describe(bucket), rank))
            for engine in engines:
                if self.lost.skips(engine):  # its workers died earlier in this round
                    continue
                try:
                    self.channels[engine].send(bucket)
                except RuntimeError as err:  # the workers are gone (gloo: "Connection closed by peer")
                    self.lost.send_failed(engine, self.channels[engine], err, index, len(self.bucket_names))
                    continue
                self._bytes_sent += sum(t.numel() * t.element_size() for _, t in bucket)

    def _plan_buckets(self, actor: ActorWeights, replica: tuple[int, ...]) -> list[list[str]]:
        """The buckets' names, in send order. Under AutoTP the replica's first rank decides for its tp group: a
        shard's size may differ between its ranks, and every rank must gather the same buckets."""
        sizes = actor.state_dict_sizes()
        names = [[sizes[i][0] for i in run] for run in pack_consecutive([n for _, n in sizes], self.bucket_bytes)]
        if len(replica) > 1:
            box = [names]
            dist.broadcast_object_list(box, src=replica[0], group=self.world.roles["actor"].tp_group,
                                       device=comm_device())
            names = box[0]
        return names

    def _open_sender(self, engines: list[int]) -> None:
        if self.bucket_names is None:
            raise RuntimeError(f"rank {self.world.rank}: opens weight channels before planning its buckets")
        made = {engine: self.open_channel(self.num_workers) for engine in engines}
        self._broadcast({"rendezvous": {engine: channel.rendezvous for engine, channel in made.items()},
                         "num_buckets": len(self.bucket_names)}, self.world.rank)
        for engine, channel in made.items():  # each returns once that engine's workers have joined
            channel.connect()
            self.channels[engine] = channel

    # ------------------------------------------------------------------ rollout ranks
    def receive(self, engine: RolloutEngine) -> None:
        """Rollout ranks: one weight round of ``engine`` (``open_weight_channel``, ``receive_weights``)."""
        sender = self.sender_of[self.world.rank]
        if self.num_buckets is None:
            info = self._broadcast(None, sender)
            engine.open_weight_channel(info["rendezvous"][self.world.rank])
            self.num_buckets = int(info["num_buckets"])
        else:
            self.checkpoint_engine(engine)  # the sender serves restarts before each round
        engine.receive_weights(self._bucket_descriptions(sender, self.num_buckets))
        self.rounds += 1

    def _bucket_descriptions(self, sender: int, num_buckets: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket as ``(name, meta tensor)`` pairs, in send order (the first sync waits for each one's
        description from the sender; the data itself comes over the engine's channel)."""
        for index in range(num_buckets):
            if index == len(self.descriptions):
                self.descriptions.append(self._broadcast(None, sender))
            yield [(name, torch.empty(shape, dtype=dtype, device="meta"))
                   for name, shape, dtype in self.descriptions[index]]


    # ------------------------------------------------------------------ engine restarts
    # A restarted engine needs its channel reopened and the current weights, and its sender is an actor rank busy
    # with its own phases. So restarts are served at two known points where every rank of an engine's channel group
    # is anyway (``serve`` on the replica, ``checkpoint_engine`` / ``rejoin`` on the engine's rank): before the
    # trajectories are collected (``RoleWorker.collect_rollouts``) and at the start of each weight round. A
    # rollout rank whose engine failed while generating restarts it at once and blocks in ``rejoin`` until its sender
    # reaches the next service point; then it continues the unfinished requests. Messages go point to point over the
    # engine's channel group, one engine after another, so no rank waits on a collective that another skips. An engine
    # that died during a weight round (``weight_round_failure``) is left out of the rest of that round on both ends
    # and restarted the same way at its rank's next generation or service point; its sender holds it in ``lost``
    # until then, and refuses a ``done`` from it before a ``restarted``.
    def _tell(self, message: dict[str, Any], dst: int, sender: int) -> None:
        dist.send_object_list([message], dst=dst, group=self.groups[sender], device=comm_device())

    def _hear(self, src: int, sender: int) -> dict[str, Any]:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=self.groups[sender], device=comm_device())
        return dict(box[0])

    def serve(self, actor: ActorWeights) -> None:
        """Actor ranks of a replica that feeds engines, at a service point: hear each of the replica's engines until
        it reports done; each restarted one gets its channel reopened and a weight round of the actor's current
        weights. Raises when an engine reports that it is past its restart bound. Nothing before the first round
        (the engines still hold the checkpoint's weights, which a restarted engine loads by itself)."""
        rank = self.world.rank
        replica = next(r for r in self.replicas if rank in r)
        if not self.rounds or not any(r in self.engines_of for r in replica):
            return
        for sender in replica:
            for engine in self.engines_of.get(sender, []):
                while True:
                    event = self._hear(engine, sender) if rank == sender else None
                    if len(replica) > 1:  # its tp peers gather each bucket with it (never run: no AutoTP test yet)
                        box = [event]
                        dist.broadcast_object_list(box, src=sender, group=self.world.roles["actor"].tp_group,
                                                   device=comm_device())
                        event = box[0]
                    if event is None or event["kind"] == "done":
                        if rank == sender:
                            self.lost.reported_done(engine)  # an engine lost mid-round must have been restarted
                        break
                    if event["kind"] == "failed":
                        raise EngineRestartLimitError(f"rank {rank}: stopping with rank {engine}, whose rollout "
                                                      f"engine failed: {event['error']}")
                    log.warning("rank %d: rank %d's rollout engine was restarted (%s); reopening its weight channel "
                                "and sending the current weights", rank, engine, event["cause"])
                    if rank == sender:
                        self.lost.restarted(engine)
                        self._reopen(engine)
                    self._send_round(actor, [engine] if rank == sender else [])

    def _reopen(self, engine: int) -> None:
        """The sender's end of a restarted engine's channel, a new one (the old group is closed)."""
        old = self.channels.pop(engine, None)
        close = getattr(old, "close", None)
        if close is not None:
            close()
        channel = self.open_channel(self.num_workers)
        self._tell({"rendezvous": channel.rendezvous}, engine, self.world.rank)
        channel.connect()
        self.channels[engine] = channel

    def rejoin(self, engine: RolloutEngine, cause: str) -> None:
        """Rollout rank, right after its engine was restarted (``VllmServerEngine.rejoin`` hook): tell the sender,
        reopen the channel and receive the current weights (blocks until the sender reaches a service point). Before
        the first round the new engine's checkpoint weights are current: nothing to do."""
        if self.num_buckets is None:
            return
        sender = self.sender_of[self.world.rank]
        self._tell({"kind": "restarted", "cause": cause}, sender, sender)
        where = self._hear(sender, sender)
        engine.open_weight_channel(where["rendezvous"])
        engine.receive_weights(self._bucket_descriptions(sender, self.num_buckets))

    def give_up(self, error: str) -> None:
        """Rollout rank, its engine past the restart bound: the sender raises ``error`` too instead of waiting."""
        if self.num_buckets is not None:
            sender = self.sender_of[self.world.rank]
            self._tell({"kind": "failed", "error": error}, sender, sender)

    def checkpoint_engine(self, engine: RolloutEngine) -> None:
        """Rollout rank, at a service point: restart an engine that died while idle or in the last weight round,
        then report done."""
        if self.num_buckets is None:
            return
        if isinstance(engine, Restartable) and not engine.alive():
            engine.restart(engine.round_failure()
                           or EngineFailure("vLLM's engine-core process exited while the engine was idle"))
        sender = self.sender_of[self.world.rank]
        self._tell({"kind": "done"}, sender, sender)


WeightSync = ShardedWeightSync | EngineChannelWeightSync


def build_weight_sync(rollout: RolloutConfig, world: WorldGroups, adapter: bool = False, **kwargs: Any) -> WeightSync:
    """The weight sync of a layout whose rollout ranks are a subset of the world (``rollout``: the rollout
    section): over vLLM's per-engine channels for ``rollout.vllm_mode=server_process``, else sharded over the main
    world. ``adapter`` (``ds.lora.sync=adapter``): sharded over the main world whatever the engine (the adapter is
    small, and vLLM loads it from a folder the rollout rank writes: ``hpc_rlhf.weight_sync.adapter``). Collective."""
    # Only runs without train.colocate_all build one (colocated runs load weights in-process): ``auto`` resolves so.
    if adapter:
        return ShardedWeightSync(world, **kwargs)
    if rollout_engine_kind(rollout, colocate_all=False) == "vllm_server_process":
        return EngineChannelWeightSync(world, num_workers=rollout.tensor_parallel_size, **kwargs)
    return ShardedWeightSync(world, **kwargs)
