"""The moves of several roles in one phase, started together and then waited on: the make-experience forwards and
the updates of the trained roles.

Runs on the training ranks (the actor's, critic's, reference's and teacher's ranks, and rank 0); each role's move
is collective over that role's controller ranks only (``roles.RoleHandle._start_on_replicas``).

The controller starts every move of a phase before it waits on any: the forwards (old log-probs, reference,
teacher, critic values), then, in the training phase, the critic's and the actor's updates. Roles on disjoint ranks
compute at once, and the phase costs about its busiest rank's moves, not their sum. Start order: the roles rank 0
does not host come first, because rank 0 runs its own share of a role in place when it starts it, and would
otherwise hold back the scatters to the roles after it; then the roles rank 0 hosts. Within each kind the order is
fixed (forwards: actor, ref, teacher, critic; updates: critic, actor). The order depends on the placement alone, so
every rank computes the same one: the scatters and gathers of each role's group meet in the same order on all of
its ranks (``roles`` module docstring). The waits follow the start order. No RNG is drawn here beyond what each
role's own work draws on its own ranks (the forwards draw none; an update's dropout, if any, is its ranks' own
stream, the same whichever order the roles run in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from hpc_rlhf.trainers.rl.roles import CONTROLLER, Pending, PendingForward, PendingUpdate, RoleHandles, RoleMembership
from hpc_rlhf.trainers.rl.step_batch import StepBatch


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


Starter = Callable[[StepBatch | None], PendingForward]


def start_order(handles: RoleHandles, need_old_logprobs: bool) -> list[tuple[str, RoleMembership, Starter]]:
    """``(output field, role, its forward's start)`` of the enabled forwards, in the order every rank starts them."""
    enabled: list[tuple[str, RoleMembership, Starter]] = []
    if need_old_logprobs:
        enabled.append(("old_logprobs", handles.actor, handles.actor.start_logprobs))
    if handles.ref is not None:
        enabled.append(("ref_logprobs", handles.ref, handles.ref.start_logprobs))
    if handles.teacher is not None:
        enabled.append(("teacher_logprobs", handles.teacher, handles.teacher.start_logprobs))
    if handles.critic is not None:
        enabled.append(("values", handles.critic, handles.critic.start_values))
    return _controller_last(enabled)


S = TypeVar("S")  # how a move starts


def _controller_last(entries: list[tuple[str, RoleMembership, S]]) -> list[tuple[str, RoleMembership, S]]:
    """``entries`` (``(name, role, start)``) with the roles rank 0 hosts moved to the end, order kept otherwise."""
    elsewhere = [entry for entry in entries if CONTROLLER not in entry[1].groups.ranks]
    in_place = [entry for entry in entries if CONTROLLER in entry[1].groups.ranks]
    return elsewhere + in_place


def experience_forwards(handles: RoleHandles, batch: StepBatch | None, need_old_logprobs: bool, *,
                        overlap: bool = True) -> ExperienceOutputs:
    """Start every enabled forward over rank 0's ``batch``, then wait on each. Collective over the training ranks
    that host a scoring role and rank 0; ``batch`` is rank 0's (None elsewhere). ``overlap=False`` waits on each
    forward before starting the next (one role after another: the baseline ``benchmarks/experience_overlap.py``
    measures against); every rank of the world must pass the same value."""
    pending: list[tuple[str, PendingForward]] = []
    for name, _, start in start_order(handles, need_old_logprobs):
        pending.append((name, start(batch)))
        if not overlap:
            pending[-1][1].wait()
    out = ExperienceOutputs()
    for name, forward in pending:
        setattr(out, name, forward.wait())
        out.compute_seconds[forward.role] = forward.compute_seconds
    return out


def role_updates(handles: RoleHandles, batch: StepBatch | None, version: int, kl_coef: float, *,
                 overlap: bool = True) -> dict[str, Pending[dict[str, float]]]:
    """Start the critic's update (if there is a critic) and the actor's over rank 0's ``batch``, then wait on each;
    returns the waited futures by role (their results: the metrics on rank 0). ``version``: the policy version the
    updates make; ``kl_coef``: the actor's KL loss coefficient (rank 0's). ``overlap=False``: one after the other.
    Collective over the trained roles' ranks and rank 0."""
    entries: list[tuple[str, RoleMembership, Callable[[], PendingUpdate]]] = []
    if handles.critic is not None:
        critic = handles.critic
        entries.append(("critic", critic, lambda: critic.start_update(batch, version)))
    entries.append(("actor", handles.actor, lambda: handles.actor.start_update(batch, version, kl_coef)))
    started: dict[str, PendingUpdate] = {}
    for name, _, start in _controller_last(entries):
        started[name] = start()
        if not overlap:
            started[name].wait()
    for pending in started.values():
        pending.wait()
    return started
