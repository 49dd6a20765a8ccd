"""Typed role handles: each role of the placement as this rank sees it, and the moves the loop makes with it.

A handle holds the role's process groups, this rank's engine (``None`` where the rank does not host the role),
its sequence-parallel peers and its data-parallel layout (one replica per ``groups.dp_leaders`` entry). The two
moves of the controller over a model role are its methods:

* a forward over a step batch's rows (:meth:`ModelRole.forward`): rank 0 deals the rows to the replicas
  (``row_layout.forward_shards``), each replica computes a per-row result, and rank 0 gets the results back as
  (B, ...) in the batch's row order;
* an update over train shards (:meth:`TrainedRole.update`): rank 0 cuts the batch into one
  ``row_layout.train_shards`` shard per replica, each replica trains on its shard, and rank 0 gets the metrics
  averaged over the replicas.

Both are collective over the role's controller ranks (rank 0 plus the role's ranks) and return None at once on
every other rank, so every rank may call them; only rank 0 passes a batch and gets a result.

A forward and an update are also futures (``start_*`` methods, :class:`Pending`): starting one deals the rows and
runs the replicas' part (the scatter, then the work on the role's ranks); ``wait()`` gathers the results on rank 0.
The controller starts the moves of several roles before it waits on any (``hpc_rlhf.trainers.rl.concurrent_moves``), so
roles on disjoint ranks compute at once. Collective order: every rank
starts and waits in the same order, so the scatters and gathers of each role's controller group meet in the
same order on all of its ranks, whichever other roles a rank hosts.

Runs on every rank (each builds every handle); each move is collective over its role's controller ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hpc_rlhf.config.schema import AlgoConfig, RunConfig
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.micro_forward import SequenceParallel
from hpc_rlhf.resilience.fault_injection import fault_point
from hpc_rlhf.rewards.reward_model import RewardModelRole
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.commands import RoleWorkerError, WorkerFailure
from hpc_rlhf.trainers.rl.row_layout import Batching, forward_shards, in_batch_order, train_shards
from hpc_rlhf.trainers.rl.setup import Roles, RolloutSide
from hpc_rlhf.trainers.rl.step_batch import StepBatch, TrainShard
from hpc_rlhf.trainers.rl.workers import (
    TRAIN_FIELDS,
    UpdateSettings,
    forward_logprobs,
    forward_values,
    train_actor,
    train_critic,
)
from hpc_rlhf.training.deepspeed_engine import FrozenEngine, TrainEngine
from hpc_rlhf.world.channel import gather_from_role, scatter_to_role
from hpc_rlhf.world.groups import RoleGroups, WorldGroups
from hpc_rlhf.world.placement import Role

log = logging.getLogger(__name__)
CONTROLLER = 0  # the rank that owns the batch (``hpc_rlhf.world.channel``)
Metrics = dict[str, float]
Wire = dict[str, Any]  # a shard as it travels (``StepBatch.to_wire`` / ``TrainShard.to_wire``)
Generated = tuple[list[Trajectory], float]  # one engine's trajectories and its generation seconds
RolloutResult = Generated | WorkerFailure  # what an engine's rank sends back: its rollouts, or why it has none


class HoldsStates(Protocol):
    """An engine whose training states can leave the device between phases (colocated runs)."""

    def reload_states(self) -> None: ...

    def offload_states(self) -> None: ...


E = TypeVar("E")  # a role's engine type
S = TypeVar("S", bound=HoldsStates)
R = TypeVar("R")  # what a replica returns
T = TypeVar("T")


def split_even(items: Sequence[T], parts: int) -> list[list[T]]:
    """Split ``items`` into ``parts`` contiguous chunks whose sizes differ by at most one."""
    bounds = np.linspace(0, len(items), parts + 1).round().astype(int)
    return [list(items[bounds[i] : bounds[i + 1]]) for i in range(parts)]


def sequence_parallel(cfg: RunConfig, world: WorldGroups, role: str) -> SequenceParallel | None:
    """This rank's sequence-parallel peers in ``role`` (``ds.ring_attn_size`` > 1), else None."""
    if cfg.ds.ring_attn_size == 1 or not world.has_role(role):
        return None
    group = world.roles[role].sp_group
    return SequenceParallel(group, dist.get_rank(group), cfg.ds.ring_attn_size, cfg.ds.ring_head_stride)


@dataclass(frozen=True)
class MoveSettings:
    """What the forwards and updates read from the run config (the same at every step)."""

    experience: Batching
    """Micro-batching of the experience forwards (``Batching.for_experience``)."""
    temperature: float
    """``rollout.temperature``: log-probs of the sampling distribution."""
    replay_routes: bool
    """``algo.routing_replay=rollout``: the actor's forwards route tokens to the experts the rollout recorded."""
    balance_tokens: bool
    """``train.use_dynamic_batch``: rows dealt to replicas by tokens, not by count."""
    update: UpdateSettings
    algo: AlgoConfig
    train_batch_size: int
    """``train.train_batch_size``: episodes per optimizer step over all replicas."""
    offload_after_update: bool
    """Whether an update offloads the training states after it (colocated runs do it after the weight sync)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> MoveSettings:
        return cls(Batching.for_experience(cfg.train, cfg.rollout, cfg.ds), cfg.rollout.temperature,
                   cfg.algo.routing_replay == "rollout", cfg.train.use_dynamic_batch,
                   UpdateSettings.from_sections(cfg.train, cfg.rollout, cfg.ds), cfg.algo, cfg.train.train_batch_size,
                   not cfg.train.colocate_all)


def _controller_batch(batch: StepBatch | None, role: str) -> StepBatch:
    if batch is None:
        raise ValueError(f"rank 0 must pass the step batch to role {role!r}")
    return batch


class Pending(Generic[T]):
    """A started move of a role (a forward, an update): ``wait()`` brings its result to rank 0 (None on every other
    rank, and at once where the rank takes no part). Waiting twice returns the same result."""

    def __init__(self, role: str, finish: Callable[[], tuple[T | None, float]]) -> None:
        self.role = role
        self._finish: Callable[[], tuple[T | None, float]] | None = finish
        self._result: T | None = None
        self.compute_seconds = 0.0
        """Rank 0, after ``wait()``: the slowest replica's seconds inside the move (no transfers)."""

    @classmethod
    def nothing(cls, role: str) -> Pending[T]:
        """The move of a rank that takes no part in the role's moves."""
        return cls(role, lambda: (None, 0.0))

    def wait(self) -> T | None:
        if self._finish is not None:
            self._result, self.compute_seconds = self._finish()
            self._finish = None
        return self._result


PendingForward = Pending[torch.Tensor]  # (B, ...) outputs in the batch's row order
PendingUpdate = Pending[dict[str, float]]  # the replicas' metrics, averaged


class RoleMembership:
    """Where this rank stands in one role: the role's groups and this rank."""

    def __init__(self, groups: RoleGroups, rank: int) -> None:
        self.groups, self.rank = groups, rank

    @property
    def takes_part(self) -> bool:
        """Whether this rank takes part in the role's moves (rank 0 and the role's ranks)."""
        return self.rank in self.groups.controller_ranks

    @property
    def hosts(self) -> bool:
        """Whether this rank hosts the role (holds its engine)."""
        return self.rank in self.groups.ranks


class RoleHandle(RoleMembership, Generic[E]):
    """One role as this rank sees it: its groups, this rank's engine (None if it hosts none) and sp peers."""

    def __init__(self, name: str, groups: RoleGroups, rank: int, engine: E | None, sp: SequenceParallel | None,
                 settings: MoveSettings) -> None:
        super().__init__(groups, rank)
        self.name, self.engine, self.sp, self.settings = name, engine, sp, settings

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas of the role (each gets one shard of a move)."""
        return len(self.groups.dp_leaders)

    def require_engine(self) -> E:
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} hosts no {self.name} engine (role ranks {self.groups.ranks})")
        return self.engine

    def _reload(self, engine: E) -> None:
        """Bring the engine's states back before a move (none by default: the reward model keeps none)."""

    def _offload(self, engine: E) -> None:
        """Let the engine's states leave the device after an update (none by default)."""

    def _start_on_replicas(self, shards: Sequence[StepBatch] | Sequence[TrainShard] | None,
                           receive: Callable[[Wire], T], run: Callable[[E, T], R], *, offload: bool = False,
                           ) -> Callable[[], list[tuple[R, float]] | None]:
        """Rank 0's ``shards`` (one per replica) to the role's ranks, which reload their states, run
        ``run(engine, shard)`` and (``offload``) offload them again. Returns the gather still to do: calling it
        brings each replica's ``(result, seconds in run)`` to rank 0 in replica order (None elsewhere).
        Collective over the role's controller ranks (the scatter here, the gather when called)."""
        wire = scatter_to_role(None if shards is None else [s.to_wire() for s in shards], self.groups)
        result = None
        failed: Exception | None = None
        if self.hosts:
            engine = self.require_engine()
            self._reload(engine)
            start = time.perf_counter()
            try:
                result = (run(engine, receive(wire)), time.perf_counter() - start)
            except Exception as exc:  # the launcher prints this rank's traceback: say where it failed
                where = f"rank {self.rank}: failed in role {self.name!r}'s move (role ranks {self.groups.ranks})"
                log.error("%s: %s: %s", where, type(exc).__name__, exc)
                add_note = getattr(exc, "add_note", None)  # Python 3.11+: printed with the traceback
                if add_note is not None:
                    add_note(where)
                if self.rank == CONTROLLER:
                    raise  # rank 0 ran its part in place: the error is already where the step is told
                failed = exc  # goes to rank 0 at the gather, then raises here
            if offload and failed is None:
                self._offload(engine)

        def gather() -> list[tuple[R, float]] | None:
            if failed is not None:
                failure = WorkerFailure.from_exception(self.rank, self.name, failed)
                # Only a replica's leader sends: a failed tensor/sequence-parallel peer leaves its leader in a
                # collective of the role's work, which the watchdog (StallGuard) ends.
                gather_from_role((failure, 0.0), self.groups)
                raise failed
            gathered = gather_from_role(result, self.groups)
            if self.rank != CONTROLLER or gathered is None:
                return None
            failures = [part for part, _ in gathered if isinstance(part, WorkerFailure)]
            if failures:
                raise RoleWorkerError(failures)
            return gathered

        return gather

    def _run_on_replicas(self, shards: Sequence[StepBatch] | Sequence[TrainShard] | None,
                         receive: Callable[[Wire], T], run: Callable[[E, T], R], *, offload: bool = False,
                         ) -> list[R] | None:
        """:meth:`_start_on_replicas` and its gather at once: the replicas' results on rank 0 (None elsewhere)."""
        gathered = self._start_on_replicas(shards, receive, run, offload=offload)()
        return None if gathered is None else [result for result, _ in gathered]

    def _start_forward(self, batch: StepBatch | None, compute: Callable[[E, StepBatch], torch.Tensor],
                       fields: tuple[str, ...] = ()) -> PendingForward:
        """Start the batch's forward inputs (and ``fields``) over the replicas, ``compute(engine, rows) -> (b, ...)``
        on each; the future's ``wait()`` gives the outputs on rank 0 as (B, ...) in the batch's row order."""
        if not self.takes_part:
            return Pending.nothing(self.name)
        if self.rank != CONTROLLER:
            gather = self._start_on_replicas(None, StepBatch.from_wire, compute)

            def send() -> tuple[torch.Tensor | None, float]:
                gather()  # this rank's outputs (if it leads a replica) go to rank 0
                return None, 0.0

            return Pending(self.name, send)
        batch = _controller_batch(batch, self.name)
        shards, layout = forward_shards(batch, self.num_replicas, self.settings.balance_tokens, fields)
        gather_outputs = self._start_on_replicas(shards, StepBatch.from_wire, compute)
        num_rows = batch.num_rows

        def finish() -> tuple[torch.Tensor | None, float]:
            gathered = gather_outputs()
            assert gathered is not None  # rank 0 gathers one output per replica
            outputs = [output for output, _ in gathered]
            return in_batch_order(outputs, layout, num_rows), max(seconds for _, seconds in gathered)

        return Pending(self.name, finish)

    def _forward(self, batch: StepBatch | None, compute: Callable[[E, StepBatch], torch.Tensor],
                 fields: tuple[str, ...] = ()) -> torch.Tensor | None:
        """:meth:`_start_forward` and its wait at once."""
        return self._start_forward(batch, compute, fields).wait()


class ModelRole(RoleHandle[S]):
    """A role whose engine is a DeepSpeed facade: colocated runs move its states off the device between phases."""

    def _reload(self, engine: S) -> None:
        engine.reload_states()

    def _offload(self, engine: S) -> None:
        engine.offload_states()


class FrozenPolicyRole(ModelRole[FrozenEngine]):
    """The reference model or the distillation teacher: scores the sampled tokens, never trains."""

    def logprobs(self, batch: StepBatch | None) -> torch.Tensor | None:
        """(B, R) fp32 log-probs of the batch's response tokens on rank 0."""
        return self.start_logprobs(batch).wait()

    def start_logprobs(self, batch: StepBatch | None) -> PendingForward:
        """:meth:`logprobs` as a future."""
        s = self.settings
        return self._start_forward(batch, lambda engine, rows: forward_logprobs(engine, rows, s.experience,
                                                                               s.temperature, self.sp))


class TrainedRole(ModelRole[TrainEngine]):
    """A role trained by the loop (actor, critic): its update over the step's train shards."""

    def __init__(self, name: str, groups: RoleGroups, rank: int, engine: TrainEngine | None,
                 sp: SequenceParallel | None, settings: MoveSettings,
                 train: Callable[[TrainEngine, TrainShard, AlgoConfig, UpdateSettings, int, SequenceParallel | None],
                                 Metrics]) -> None:
        super().__init__(name, groups, rank, engine, sp, settings)
        self._train = train

    def update(self, batch: StepBatch | None, version: int, kl_coef: float = 0.0) -> Metrics | None:
        """Train on ``batch`` (rank 0's; the fields ``workers.TRAIN_FIELDS`` lists travel) cut into one shard of
        whole mini-batches per replica; returns the replicas' metrics averaged on rank 0 (None elsewhere).
        ``version``: the policy version this update makes (fault injection counts it); ``kl_coef``: the KL loss
        coefficient the shards carry (actor)."""
        return self.start_update(batch, version, kl_coef).wait()

    def start_update(self, batch: StepBatch | None, version: int, kl_coef: float = 0.0) -> PendingUpdate:
        """:meth:`update` as a future: the shards go out and the role's ranks train here; ``wait()`` gathers the
        metrics."""
        if not self.takes_part:
            return Pending.nothing(self.name)
        s, dp = self.settings, self.num_replicas
        shards = None
        if self.rank == CONTROLLER:
            batch = _controller_batch(batch, self.name)
            # train.train_batch_size counts episodes; a branching agent's episode brings all its rows.
            shards = train_shards(batch.select(*TRAIN_FIELDS[self.name]), batch.episodes, s.train_batch_size,
                                  dp, s.balance_tokens, kl_coef)

        def run(engine: TrainEngine, shard: TrainShard) -> Metrics:
            fault_point("train", version, self.rank)
            return self._train(engine, shard, s.algo, s.update, dp, self.sp)

        gather = self._start_on_replicas(shards, TrainShard.from_wire, run, offload=s.offload_after_update)

        def finish() -> tuple[Metrics | None, float]:
            gathered = gather()
            if gathered is None:
                return None, 0.0
            metrics = [m for m, _ in gathered]
            return ({k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]},
                    max(seconds for _, seconds in gathered))

        return Pending(self.name, finish)


class ActorRole(TrainedRole):
    """The trained policy."""

    def logprobs(self, batch: StepBatch | None) -> torch.Tensor | None:
        """(B, R) fp32 log-probs of the response tokens before the update (the old log-probs) on rank 0; with
        ``algo.routing_replay=rollout`` the recorded routes travel along and are replayed."""
        return self.start_logprobs(batch).wait()

    def start_logprobs(self, batch: StepBatch | None) -> PendingForward:
        """:meth:`logprobs` as a future."""
        s = self.settings
        return self._start_forward(batch, lambda engine, rows: forward_logprobs(engine, rows, s.experience,
                                                                               s.temperature, self.sp,
                                                                               s.replay_routes),
                                   fields=("routed_experts",) if s.replay_routes else ())


class CriticRole(TrainedRole):
    """The value model."""

    def values(self, batch: StepBatch | None) -> torch.Tensor | None:
        """(B, R) fp32 values before each response token on rank 0."""
        return self.start_values(batch).wait()

    def start_values(self, batch: StepBatch | None) -> PendingForward:
        """:meth:`values` as a future."""
        s = self.settings
        return self._start_forward(batch, lambda engine, rows: forward_values(engine, rows, s.experience, self.sp))


class RewardRole(RoleHandle[RewardModelRole]):
    """The reward model: one score per row. It holds no states to reload (they never leave the device)."""

    def scores(self, batch: StepBatch | None) -> torch.Tensor | None:
        """(B,) scores of the batch's rows on rank 0."""
        return self._forward(batch, lambda engine, rows: engine.scores(rows.forward_inputs(), self.sp))


class RolloutRole(RoleMembership):
    """The rollout engines: prompts out to each engine (data-parallel replica), trajectories back."""

    def __init__(self, groups: RoleGroups, rank: int, side: RolloutSide | None) -> None:
        super().__init__(groups, rank)
        self.side = side
        self._failed: Exception | None = None  # this rank's engine failed: raised after its WorkerFailure is sent

    @property
    def engine_index(self) -> int:
        """This rank's engine: its data-parallel rank in the role (sampling seeds differ per engine)."""
        return self.groups.dp_rank_of[self.rank]

    def require_side(self) -> RolloutSide:
        if self.side is None:
            raise RuntimeError(f"rank {self.rank} hosts no rollout engine (rollout ranks {self.groups.ranks})")
        return self.side

    def shares(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        """Each engine's share of ``prompts``, in engine order."""
        return split_even(prompts, len(self.groups.dp_leaders))

    def dispatch(self, prompts: Sequence[Prompt] | None) -> list[Prompt] | None:
        """Rank 0's ``prompts`` -> this engine's share on every rollout rank (None elsewhere). Collective over the
        role's controller ranks."""
        if not self.takes_part:
            return None
        shares = None
        if self.rank == CONTROLLER:
            if prompts is None:
                raise ValueError("rank 0 must pass the prompts to the rollout role")
            shares = self.shares(prompts)
        mine: list[Prompt] | None = scatter_to_role(shares, self.groups)
        return mine

    def serve(self, run: Callable[[], Generated]) -> RolloutResult:
        """This rank's engine runs ``run`` (a generation round). A failure on a worker rank becomes the
        :class:`~hpc_rlhf.trainers.rl.commands.WorkerFailure` that :meth:`collect` sends to rank 0 (and then raises
        here); on rank 0, which runs its engine in place, it raises at once."""
        try:
            return run()
        except Exception as exc:
            if self.rank == CONTROLLER:
                raise
            log.error("rank %d: the rollout engine failed: %s: %s", self.rank, type(exc).__name__, exc)
            self._failed = exc
            return WorkerFailure.from_exception(self.rank, "rollout", exc)

    def collect(self, result: RolloutResult | None) -> list[Generated] | None:
        """Each engine's ``result`` -> rank 0, in engine order (None elsewhere). An engine's
        :class:`~hpc_rlhf.trainers.rl.commands.WorkerFailure` raises :class:`RoleWorkerError` on rank 0 (with the
        engine rank's traceback) and the engine's own error on its rank. Collective over the role's controller ranks.
        """
        if not self.takes_part:
            return None
        gathered: list[RolloutResult] | None = gather_from_role(result, self.groups)
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed
        if self.rank != CONTROLLER or gathered is None:
            return None
        failures = [part for part in gathered if isinstance(part, WorkerFailure)]
        if failures:
            raise RoleWorkerError(failures)
        return [part for part in gathered if not isinstance(part, WorkerFailure)]


@dataclass
class RoleHandles:
    """A handle per role of the placement (None: the placement has no such role)."""

    actor: ActorRole
    rollout: RolloutRole
    critic: CriticRole | None = None
    ref: FrozenPolicyRole | None = None
    teacher: FrozenPolicyRole | None = None
    reward: RewardRole | None = None

    @property
    def frozen_policies(self) -> list[FrozenPolicyRole]:
        """The reference and the teacher, in the order their forwards run."""
        return [role for role in (self.ref, self.teacher) if role is not None]

    def scoring(self, role: Role) -> ActorRole | FrozenPolicyRole | CriticRole | None:
        """The handle of a role with a make-experience forward (None: the placement has no such role)."""
        handles = {Role.ACTOR: self.actor, Role.REF: self.ref, Role.TEACHER: self.teacher, Role.CRITIC: self.critic}
        if role not in handles:
            raise ValueError(f"role '{role}' has no make-experience forward")
        return handles[role]

    def trained(self, role: Role) -> TrainedRole | None:
        """The handle of a trained role (None: the placement has no such role)."""
        handles: dict[Role, TrainedRole | None] = {Role.ACTOR: self.actor, Role.CRITIC: self.critic}
        if role not in handles:
            raise ValueError(f"role '{role}' is not trained")
        return handles[role]

    def membership(self, role: Role) -> RoleMembership:
        """Where this rank stands in ``role``, which the placement must have."""
        handle: RoleMembership | None = self.rollout if role == Role.ROLLOUT else \
            self.reward if role == Role.REWARD else self.scoring(role)
        if handle is None:
            raise ValueError(f"the placement has no {role} role")
        return handle

    @classmethod
    def build(cls, cfg: RunConfig, world: WorldGroups, engines: Roles) -> RoleHandles:
        """Handles over ``engines`` (this rank's, :func:`setup.build_roles`). No collective."""
        settings = MoveSettings.from_config(cfg)
        rank, groups = world.rank, world.roles

        def frozen(name: str, engine: FrozenEngine | None) -> FrozenPolicyRole | None:
            if name not in groups:
                return None
            return FrozenPolicyRole(name, groups[name], rank, engine, sequence_parallel(cfg, world, name), settings)

        critic = None
        if "critic" in groups:
            critic = CriticRole("critic", groups["critic"], rank, engines.critic,
                                sequence_parallel(cfg, world, "critic"), settings, train_critic)
        reward = None
        if "reward" in groups:
            reward = RewardRole("reward", groups["reward"], rank, engines.reward,
                                sequence_parallel(cfg, world, "reward"), settings)
        return cls(ActorRole("actor", groups["actor"], rank, engines.actor, sequence_parallel(cfg, world, "actor"),
                             settings, train_actor),
                   RolloutRole(groups["rollout"], rank, engines.rollout), critic, frozen("ref", engines.ref),
                   frozen("teacher", engines.teacher), reward)
