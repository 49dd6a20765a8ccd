"""Rank 0's typed commands (``commands``) issued to the role workers: the make-experience forwards and the updates
of the trained roles, each started at once and then waited on.

Runs on every rank: rank 0 builds the step's :class:`~hpc_rlhf.trainers.rl.commands.StepCommands` (the functions
under "rank 0 decides"), which reach the other ranks inside a ``RunForwards`` / ``RunUpdates`` command
(``role_worker``); then each rank issues the same commands in the same order, which on a worker rank means serving
its part of each (``roles.RoleHandle._start_on_replicas``: the scatter, the role's work where the rank hosts the
role, the gather at the wait) and on a rank outside a role nothing; each command is collective over its role's
controller ranks only.

Collective order, the same on every rank: the commands' own order (forwards: actor, ref, teacher, critic; updates:
critic, actor; ``commands.FORWARD_ORDER``, ``commands.UPDATE_ORDER``), except that the roles rank 0 hosts move to
the end, because rank 0 runs its own part of a role in place when it issues the command and would otherwise hold
back the scatters to the roles after it. All of a phase's commands are issued before any is waited on, so roles on
disjoint ranks compute at once and the phase costs about its busiest rank's moves, not their sum; the waits follow
the issue order. The order depends on the commands and the placement alone. No RNG is drawn here beyond what each
role's own work draws on its own ranks (the forwards draw none; an update's dropout, if any, is its ranks' own
stream, the same whichever order the roles run in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from hpc_rlhf.trainers.rl.commands import (
    FORWARD_ORDER,
    UPDATE_ORDER,
    Forward,
    ForwardReply,
    StepCommands,
    Update,
    UpdateReply,
)
from hpc_rlhf.trainers.rl.roles import (
    CONTROLLER,
    CriticRole,
    Pending,
    PendingForward,
    PendingUpdate,
    RoleHandles,
)
from hpc_rlhf.trainers.rl.step_batch import StepBatch
from hpc_rlhf.world.placement import Role


@dataclass
class ExperienceOutputs:
    """The forwards' outputs on rank 0, each (B, R) fp32 in the batch's row order, or None when the role is off (or
    on every other rank)."""

    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    compute_seconds: dict[str, float] = field(default_factory=dict)
    """Rank 0: per role, the slowest replica's seconds inside its forward (``timing/experience/<role>``)."""

    @classmethod
    def from_replies(cls, replies: Sequence[ForwardReply]) -> ExperienceOutputs:
        out = cls()
        for reply in replies:
            setattr(out, Forward(reply.role).output_field, reply.output)
            out.compute_seconds[reply.role] = reply.compute_seconds
        return out


# ---- rank 0 decides -------------------------------------------------------------------------------------------

def forward_commands(handles: RoleHandles, need_old_logprobs: bool) -> tuple[Forward, ...]:
    """The enabled make-experience forwards, in :data:`~hpc_rlhf.trainers.rl.commands.FORWARD_ORDER`; the actor's
    only when ``need_old_logprobs`` (else the rollout's log-probs stand in)."""
    return tuple(Forward(role) for role in FORWARD_ORDER
                 if handles.scoring(role) is not None and (role != Role.ACTOR or need_old_logprobs))


def update_commands(handles: RoleHandles, version: int, kl_coef: float) -> tuple[Update, ...]:
    """The trained roles' updates, in :data:`~hpc_rlhf.trainers.rl.commands.UPDATE_ORDER`."""
    return tuple(Update(role, version, kl_coef if role == Role.ACTOR else 0.0) for role in UPDATE_ORDER
                 if handles.trained(role) is not None)


# ---- every training rank issues (rank 0) or serves (the others) ------------------------------------------------

def _start_forward(handles: RoleHandles, command: Forward, batch: StepBatch | None) -> PendingForward:
    role = handles.scoring(command.role)
    if role is None:
        raise ValueError(f"{command}: the placement has no {command.role} role")
    return role.start_values(batch) if isinstance(role, CriticRole) else role.start_logprobs(batch)


def _start_update(handles: RoleHandles, command: Update, batch: StepBatch | None) -> PendingUpdate:
    role = handles.trained(command.role)
    if role is None:
        raise ValueError(f"{command}: the placement has no {command.role} role")
    return role.start_update(batch, command.version, command.kl_coef)


C = TypeVar("C", Forward, Update)
T = TypeVar("T")
R = TypeVar("R")  # a typed reply


def _issue(handles: RoleHandles, commands: Sequence[C], start: Callable[[C], Pending[T]],
           overlap: bool) -> list[tuple[C, Pending[T]]]:
    """Start ``commands`` in the collective order (rank 0's roles last); ``overlap=False`` waits on each before the
    next starts."""
    issued = []
    for command in issue_order(handles, commands):
        issued.append((command, start(command)))
        if not overlap:
            issued[-1][1].wait()
    return issued


def issue_order(handles: RoleHandles, commands: Sequence[C]) -> list[C]:
    """``commands`` with those of the roles rank 0 hosts moved to the end, order kept otherwise."""
    def hosted_by_controller(command: C) -> bool:
        return CONTROLLER in handles.membership(command.role).groups.ranks

    return [c for c in commands if not hosted_by_controller(c)] + [c for c in commands if hosted_by_controller(c)]


def _issue_and_wait(handles: RoleHandles, commands: Sequence[C], start: Callable[[C], Pending[T]], overlap: bool,
                    reply: Callable[[C, T, float], R]) -> list[R]:
    """:func:`_issue`, then wait on each command in issue order; ``reply(command, result, seconds)`` of each result
    that came back (rank 0's; none elsewhere)."""
    replies = []
    for command, pending in _issue(handles, commands, start, overlap):
        result = pending.wait()
        if result is not None:
            replies.append(reply(command, result, pending.compute_seconds))
    return replies


def run_forwards(handles: RoleHandles, commands: StepCommands, batch: StepBatch | None) -> list[ForwardReply]:
    """Issue ``commands.forwards`` over rank 0's ``batch`` (None elsewhere), then wait on each; the replies on rank 0
    (empty elsewhere), in issue order. Collective over the training ranks that host a scoring role and rank 0."""
    return _issue_and_wait(handles, commands.forwards, lambda c: _start_forward(handles, c, batch), commands.overlap,
                           lambda c, output, seconds: ForwardReply(c.role, output, seconds))


def run_updates(handles: RoleHandles, commands: StepCommands, batch: StepBatch | None) -> list[UpdateReply]:
    """Issue ``commands.updates`` over rank 0's ``batch``, then wait on each; the replies (the metrics) on rank 0
    (empty elsewhere), in issue order. Collective over the trained roles' ranks and rank 0."""
    return _issue_and_wait(handles, commands.updates, lambda c: _start_update(handles, c, batch), commands.overlap,
                           lambda c, metrics, seconds: UpdateReply(c.role, metrics, seconds))
