"""The RL run's typed commands and replies: what rank 0 (the controller) asks of the role workers.

Rank 0 tells the run's story (``controller``): each thing the other ranks must do is a command it sends to every
worker rank over the command bus (``command_bus``) before running its own part in place (rank 0 is a worker too
wherever it hosts a role). A worker rank serves the commands in the order they come (``role_worker``) and decides
nothing about the run itself. The commands:

* :class:`StartRollouts` / :class:`CollectRollouts`: deal the prompts to the rollout engines and generate; bring
  the trajectories back (a future in between: the asynchronous trainer trains while the engines generate);
* :class:`ScoreRows`: the reward model's scores of the step's samples;
* :class:`RunForwards` / :class:`RunUpdates`: the step's make-experience forwards (:class:`Forward`) and updates
  (:class:`Update`), as rank 0 decided them (:class:`StepCommands`);
* :class:`SyncWeights`: the actor's weights to the rollout engines, making policy version ``version``;
* :class:`Save`, :class:`SaveHFExport`, :class:`Restore`, :class:`ExportModel`: checkpoints and exports;
* :class:`CloseRollouts`, :class:`Stop`: the end of the steps; the end of the run on rank 0's verdict;
* :class:`EndPhase`: the end of one phase of the run skeleton (a step, an eval, a save), where every worker goes back
  to the skeleton (``hpc_rlhf.trainers.run_skeleton``), which runs on every rank.

A forward and an update, once issued, are futures (``roles.Pending``); waiting gives the typed reply
(:class:`ForwardReply`, :class:`UpdateReply`). A command that fails on a worker rank comes back to rank 0 as a
:class:`WorkerFailure` (rank, role, traceback) in place of the worker's result, and rank 0 raises
:class:`RoleWorkerError` with it, while the worker raises its own error: both end the job.

Collective order (``concurrent_moves`` issues the forwards and updates): the forwards in :data:`FORWARD_ORDER`, then,
after rank 0 has computed the advantages, the updates in :data:`UPDATE_ORDER`; within each kind the roles rank 0 does
not host start before those it hosts (rank 0 runs its own part of a role in place when it starts it). The order
depends on the commands and the placement alone, so every rank of a role's group meets the role's scatters and
gathers in the same order. No RNG is drawn here.

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
    """The training ranks' part of one step, as rank 0 decided it (it travels inside :class:`RunForwards` and
    :class:`RunUpdates`)."""

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
class StartRollouts:
    """Deal rank 0's prompts to the rollout engines and start generating: ``seed_step`` seeds the sampling
    (``loop.sampling_seed``); ``evaluation``: the held-out prompts, with ``eval``'s sampling and sample count."""

    seed_step: int
    evaluation: bool = False


@dataclass(frozen=True)
class CollectRollouts:
    """Every engine's trajectories (and seconds) to rank 0, after the engines' service point (a restarted engine gets
    its weights there)."""


@dataclass(frozen=True)
class ScoreRows:
    """The reward model's score of each of rank 0's samples (issued only where the placement has a reward role)."""


@dataclass(frozen=True)
class RunForwards:
    """The step's make-experience forwards over rank 0's step batch; ``commands`` says which (and its updates)."""

    commands: StepCommands


@dataclass(frozen=True)
class RunUpdates:
    """The step's updates over rank 0's step batch (``commands.updates``)."""

    commands: StepCommands


@dataclass(frozen=True)
class SyncWeights:
    """Actor -> rollout engines; the engines then generate as policy version ``version``."""

    version: int


@dataclass(frozen=True)
class Save:
    """Write the checkpoint of step ``step`` (every rank its engines' states and RNG, rank 0 the controller's)."""

    step: int


@dataclass(frozen=True)
class SaveHFExport:
    """Write the actor (and with ``ckpt.save_critic_hf`` the critic) in HF format into ``directory`` (rank 0 renames
    it into place once every writer is done)."""

    directory: str


@dataclass(frozen=True)
class Restore:
    """Load the latest checkpoint into every rank's engines and RNG."""


@dataclass(frozen=True)
class ExportModel:
    """Write the final actor in HF format into ``<train.output_dir>/model``."""


@dataclass(frozen=True)
class CloseRollouts:
    """The steps are over: stop the agent executors (an OpenAI-agent endpoint stops serving)."""


@dataclass(frozen=True)
class GeneratedSoFar:
    """The asynchronous trainer: ``count`` batches were generated so far (restored from a checkpoint)."""

    count: int


@dataclass(frozen=True)
class Stop:
    """End the run: every worker raises with rank 0's ``reason`` (rank 0 raises it itself)."""

    reason: str


@dataclass(frozen=True)
class EndPhase:
    """The phase of the run skeleton that rank 0 is telling is over: the workers go back to the skeleton."""


PhaseCommand = (StartRollouts | CollectRollouts | ScoreRows | RunForwards | RunUpdates | SyncWeights | Save
                | SaveHFExport | Restore | ExportModel | CloseRollouts | GeneratedSoFar | Stop | EndPhase)


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
