"""A command that fails on a worker rank reaches the controller with the worker's rank, role and traceback
(``hpc_rlhf.trainers.rl.commands.WorkerFailure``), and the worker raises its own error too.

Three gloo ranks: actor on rank 0, reference on 1, rollout on 2; the reference's forward is a fake that raises,
then the rollout rank's generation round raises. One spawn for both keeps the test's cost at one world.
"""

from __future__ import annotations

import pytest

from hpc_rlhf.config import load_config
from tests.multiproc.spawn import run_on_ranks
from tests.multiproc.test_experience_overlap import _batch, _FakeEngine

LAYOUT = ["train.colocate_all=false", "algo.kl.init_coef=0.01", "actor.num_ranks=1", "ref.num_ranks=1",
          "rollout.num_engines=1", "rollout.rollout_batch_size=3", "rollout.n_samples_per_prompt=2",
          "train.train_batch_size=6", "train.micro_train_batch_size=6"]


def _reference_then_rollout_fail(rank: int, world_size: int) -> tuple[tuple[str, str], tuple[str, str]]:
    import torch

    from hpc_rlhf.trainers.rl import roles as roles_module
    from hpc_rlhf.trainers.rl.roles import RoleHandles
    from hpc_rlhf.trainers.rl.setup import Roles
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement
    from tests.multiproc.role_moves import experience_forwards

    def nan_reference(engine, rows, *args, **kwargs):
        if engine.value == 2.0:
            raise ValueError("reference weights are NaN")
        return torch.full(rows.action_mask.shape, engine.value)

    roles_module.forward_logprobs = nan_reference  # this rank's process only
    world = build_world_groups(build_placement(load_config(None, LAYOUT), world_size))
    engines = Roles(actor=_FakeEngine(1.0) if rank == 0 else None, ref=_FakeEngine(2.0) if rank == 1 else None)
    handles = RoleHandles.build(load_config(None, LAYOUT), world, engines)  # type: ignore[arg-type]
    return _outcome(lambda: experience_forwards(handles, _batch() if rank == 0 else None, need_old_logprobs=True)), \
        _outcome(lambda: handles.rollout.collect(handles.rollout.serve(_engine_dies) if rank == 2 else None))


def _engine_dies():
    raise RuntimeError("the engine's process died")


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "no error", ""


@pytest.mark.slow
def test_a_worker_failure_reaches_the_controller_with_rank_role_and_traceback():
    results = run_on_ranks(_reference_then_rollout_fail, 3)
    forwards = [forward for forward, _ in results]
    kind, message = forwards[0]
    assert kind == "RoleWorkerError", forwards[0]
    assert "rank 1 failed in role 'ref'" in message
    assert "ValueError: reference weights are NaN" in message
    assert "in nan_reference" in message  # the worker's traceback, not only its message
    assert forwards[1] == ("ValueError", "reference weights are NaN")  # the worker fails loudly too
    assert forwards[2] == ("no error", "")  # the rollout rank takes no part
    # A generation round that fails on an engine's rank: the same, through the rollout role's collect.
    rollouts = [rollout for _, rollout in results]
    kind, message = rollouts[0]
    assert kind == "RoleWorkerError", rollouts[0]
    assert "rank 2 failed in role 'rollout'" in message and "in _engine_dies" in message
    assert rollouts[2] == ("RuntimeError", "the engine's process died")
    assert rollouts[1] == ("no error", "")  # the reference's rank takes no part
