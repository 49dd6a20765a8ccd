"""A step's make-experience forwards and updates as one call each, for tests that drive role handles directly.

The trainer issues the commands rank 0 decided and exchanged (``hpc_rlhf.trainers.rl.concurrent_moves``); these
helpers decide the same commands on every rank instead, which is only right where every rank passes the same
arguments, as the multi-process tests here do.
"""

from __future__ import annotations

from hpc_rlhf.trainers.rl.commands import StepCommands
from hpc_rlhf.trainers.rl.concurrent_moves import (
    ExperienceOutputs,
    forward_commands,
    issue_order,
    run_forwards,
    update_commands,
)
from hpc_rlhf.trainers.rl.roles import Pending, RoleHandles
from hpc_rlhf.trainers.rl.step_batch import StepBatch


def start_order(handles: RoleHandles, need_old_logprobs: bool) -> list[str]:
    """The output fields of the enabled forwards, in the order every rank starts them."""
    return [command.output_field for command in issue_order(handles, forward_commands(handles, need_old_logprobs))]


def experience_forwards(handles: RoleHandles, batch: StepBatch | None, need_old_logprobs: bool) -> ExperienceOutputs:
    """Issue every enabled forward over rank 0's ``batch`` (None elsewhere), then wait on each; the outputs on
    rank 0. Every rank must pass the same ``need_old_logprobs``."""
    commands = StepCommands(forward_commands(handles, need_old_logprobs), overlap=True)
    return ExperienceOutputs.from_replies(run_forwards(handles, commands, batch))


def role_updates(handles: RoleHandles, batch: StepBatch | None, version: int,
                 kl_coef: float) -> dict[str, Pending[dict[str, float]]]:
    """Issue the critic's update (if there is a critic) and the actor's over rank 0's ``batch``, then wait on each;
    the waited futures by role (their results: the metrics on rank 0, None elsewhere)."""
    issued = []
    for command in issue_order(handles, update_commands(handles, version, kl_coef)):
        role = handles.trained(command.role)
        assert role is not None, command
        issued.append((command.role, role.start_update(batch, command.version, command.kl_coef)))
    for _, pending in issued:
        pending.wait()
    return dict(issued)
