"""The RL step's typed commands and replies: what rank 0 (the controller) asks of the role workers.

Rank 0 decides what the training ranks do in a step and says it once, as a :class:`StepCommands` broadcast over the
training group (:func:`hpc_rlhf.trainers.rl.concurrent_moves.exchange_commands`): the forwards of the scoring roles
(:class:`Forward`) and the updates of the trained roles (:class:`Update`). The workers (every training rank,
rank 0 included where it hosts a role: it runs its part in place) serve exactly those commands; none of them
decides anything about the step itself. An empty :class:`StepCommands` (dynamic filtering dropped every group)
tells them that no update runs.

Each command, once issued, is a future (``roles.Pending``); waiting gives its typed reply (:class:`ForwardReply`,
:class:`UpdateReply`). A command that fails on a worker rank comes back to rank 0 as a :class:`WorkerFailure`
(rank, role, traceback) in place of the worker's result, and rank 0 raises :class:`RoleWorkerError` with it, while
the worker raises its own error: both end the job.

Collective order (``concurrent_moves`` issues them): the forwards in :data:`FORWARD_ORDER`, then, after rank 0 has
computed the advantages, the updates in :data:`UPDATE_ORDER`; within each kind the roles rank 0 does not host start
before those it hosts (rank 0 runs its own part in place when it starts it). The order depends on the commands
and the placement alone, so every rank of a role's group meets the role's scatters and gathers in the same order.
No RNG is drawn here.

Pure data: imports no torch.distributed and runs on any rank.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_rlhf.world.placement import Role

if TYPE_CHECKING:
    import torch


FORWARD_ORDER = (Role.ACTOR, Role.REF, Role.TEACHER, Role.CRITIC)
"""The scoring roles, in the order their make-experience forwards are issued (before moving rank 0's last)."""
UPDATE_ORDER = (Role.CRITIC, Role.ACTOR)
"""The trained roles, in the order their updates are issued (before moving rank 0's last)."""
OUTPUT_FIELD = {Role.ACTOR: "old_logprobs", Role.REF: "ref_logprobs", Role.TEACHER: "teacher_logprobs",
                Role.CRITIC: "values"}
"""The step batch's field each scoring role's forward fills (``StepBatch``)."""


@dataclass(frozen=True)
class Forward:
    """Score the step batch's rows with ``role``'s model: log-probs (actor, ref, teacher) or values (critic)."""

    role: Role

    def __post_init__(self) -> None:
        if self.role not in OUTPUT_FIELD:
            raise ValueError(f"Forward: role '{self.role}' has no make-experience forward (one of "
                             f"{[str(r) for r in FORWARD_ORDER]})")

    @property
    def output_field(self) -> str:
        return OUTPUT_FIELD[self.role]


@dataclass(frozen=True)
class Update:
    """Train ``role`` on the step batch's train shards, making policy version ``version``; ``kl_coef``: the KL loss
    coefficient the actor's shards carry (0 for the critic)."""

    role: Role
    version: int
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in UPDATE_ORDER:
            raise ValueError(f"Update: role '{self.role}' is not trained (one of {[str(r) for r in UPDATE_ORDER]})")


Command = Forward | Update


@dataclass(frozen=True)
class StepCommands:
    """The training ranks' part of one step, as rank 0 decided it; the same object on every training rank."""

    forwards: tuple[Forward, ...] = ()
    updates: tuple[Update, ...] = ()
    overlap: bool = True
    """False: each command is waited on before the next starts (the sequential baseline of
    ``benchmarks/experience_overlap.py``)."""

    @property
    def trains(self) -> bool:
        """Whether the step updates any role (False: every sample was filtered away)."""
        return bool(self.updates)


@dataclass(frozen=True)
class ForwardReply:
    """A forward's result on rank 0."""

    role: Role
    output: torch.Tensor
    """(B, R) fp32 in the step batch's row order."""
    compute_seconds: float
    """The slowest replica's seconds inside the forward (no transfers): ``timing/experience/<role>``."""


@dataclass(frozen=True)
class UpdateReply:
    """An update's result on rank 0."""

    role: Role
    metrics: dict[str, float]
    """The replicas' metrics, averaged."""
    compute_seconds: float
    """The slowest replica's seconds inside the update: ``timing/train/<role>``."""


@dataclass(frozen=True)
class WorkerFailure:
    """What a worker rank sends to rank 0 instead of its result when its part of a command raised."""

    rank: int
    role: str
    error: str
    """``Type: message`` of the exception."""
    traceback: str

    @classmethod
    def from_exception(cls, rank: int, role: str, exc: BaseException) -> WorkerFailure:
        return cls(rank, role, f"{type(exc).__name__}: {exc}", "".join(traceback.format_exception(exc)))


class RoleWorkerError(RuntimeError):
    """Raised on rank 0 when a worker rank's part of a command failed; says the rank, the role and the traceback."""

    def __init__(self, failures: list[WorkerFailure]) -> None:
        self.failures = failures
        lines = [f"rank {f.rank} failed in role {f.role!r}'s move: {f.error}\n"
                 f"--- traceback on rank {f.rank} ---\n{f.traceback.rstrip()}" for f in failures]
        super().__init__("\n".join(lines))
