"""The step's typed commands and replies (``hpc_rlhf.trainers.rl.commands``)."""

from __future__ import annotations

import pickle

import pytest

from hpc_rlhf.trainers.rl.commands import (
    Forward,
    RoleWorkerError,
    StepCommands,
    Update,
    WorkerFailure,
)
from hpc_rlhf.world.placement import Role


def test_a_role_is_its_name_in_dicts_metrics_and_pickles():
    assert f"timing/experience/{Role.REF}" == "timing/experience/ref"
    assert {"critic": 1}[Role.CRITIC] == 1
    assert pickle.loads(pickle.dumps(Role.ACTOR)) is Role.ACTOR


def test_commands_name_only_roles_that_can_serve_them():
    assert Forward(Role.CRITIC).output_field == "values"
    with pytest.raises(ValueError, match="role 'reward' has no make-experience forward"):
        Forward(Role.REWARD)
    with pytest.raises(ValueError, match="role 'ref' is not trained"):
        Update(Role.REF, version=1)


def test_a_step_without_updates_does_not_train_and_commands_are_frozen():
    assert not StepCommands(forwards=(Forward(Role.ACTOR),)).trains
    step = StepCommands(updates=(Update(Role.ACTOR, version=3, kl_coef=0.1),))
    assert step.trains
    with pytest.raises(AttributeError):
        step.updates[0].version = 4  # type: ignore[misc]


def test_a_worker_failure_says_rank_role_and_traceback():
    error = RoleWorkerError([WorkerFailure(3, "critic", "ValueError: nan", "Traceback...\n  in forward_values\n")])
    assert "rank 3 failed in role 'critic'" in str(error)
    assert "ValueError: nan" in str(error) and "in forward_values" in str(error)
