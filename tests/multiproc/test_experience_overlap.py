"""The make-experience forwards of roles on disjoint ranks run at once (``hpc_rlhf.trainers.rl.concurrent_moves``).

Four gloo ranks: actor on rank 0, reference on 1, critic on 2, rollout on 3. The forwards are replaced by fakes
that return a known value per row; the reference's fake waits until the critic's forward has started, which can
only happen when the controller starts the critic's forward before it waits on the reference's. Forwards run one
after another (the reference's gathered before the critic's is started) make the reference's fake give up.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hpc_rlhf.config import load_config
from tests.multiproc.spawn import run_on_ranks

LAYOUT = ["train.colocate_all=false", "algo.advantage_estimator=gae", "algo.kl.init_coef=0.01",
          "actor.num_ranks=1", "ref.num_ranks=1", "critic.num_ranks=1", "rollout.num_engines=1",
          "rollout.rollout_batch_size=6", "rollout.n_samples_per_prompt=1", "train.train_batch_size=6",
          "train.micro_train_batch_size=6"]
WAIT_FOR_OTHER_S = 60.0  # a generous bound for the other role's rank to start; only a sequential phase runs out


class _FakeEngine:
    """A role's engine: a value per row, and the states a colocated run would move."""

    def __init__(self, value: float) -> None:
        self.value = value

    def reload_states(self) -> None: ...

    def offload_states(self) -> None: ...


def _batch(rows: int = 6, prompt: int = 3, response: int = 4):
    from hpc_rlhf.trainers.rl.step_batch import StepBatch

    sequences = torch.arange(rows * (prompt + response)).reshape(rows, prompt + response) % 50 + 4
    return StepBatch(sequences=sequences, attention_mask=torch.ones_like(sequences),
                     action_mask=torch.ones(rows, response, dtype=torch.bool),
                     rollout_logprobs=torch.zeros(rows, response), episode_index=torch.arange(rows),
                     rewards=torch.zeros(rows), advantages=torch.zeros(rows, response),
                     values=torch.zeros(rows, response), returns=torch.zeros(rows, response))


def _wait_for(marker: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_FOR_OTHER_S
    while not marker.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)


def _forwards(rank: int, world_size: int, folder: str) -> dict:
    from hpc_rlhf.trainers.rl import roles as roles_module
    from hpc_rlhf.trainers.rl.roles import RoleHandles
    from hpc_rlhf.trainers.rl.setup import Roles
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement
    from tests.multiproc.role_moves import experience_forwards, role_updates, start_order

    started = Path(folder)

    def fake_logprobs(engine, rows, *args, **kwargs):
        if engine.value == 2.0:  # the reference: hold on until the critic has started
            _wait_for(started / "critic", "the critic's forward did not start while the reference's ran")
        return torch.full(rows.action_mask.shape, engine.value)

    def fake_values(engine, rows, *args, **kwargs):
        (started / "critic").touch()
        return torch.full(rows.action_mask.shape, engine.value)

    def fake_train_critic(engine, shard, *args):
        _wait_for(started / "actor_update", "the actor's update did not start while the critic's ran")
        return {"critic_loss": engine.value}

    def fake_train_actor(engine, shard, *args):
        (started / "actor_update").touch()
        return {"policy_loss": engine.value + shard.kl_coef}

    roles_module.forward_logprobs = fake_logprobs  # this rank's process only
    roles_module.forward_values = fake_values
    roles_module.train_critic = fake_train_critic
    roles_module.train_actor = fake_train_actor
    cfg = load_config(None, LAYOUT)
    world = build_world_groups(build_placement(cfg, world_size))
    engines = Roles(actor=_FakeEngine(1.0) if rank == 0 else None, ref=_FakeEngine(2.0) if rank == 1 else None,
                    critic=_FakeEngine(3.0) if rank == 2 else None)
    handles = RoleHandles.build(cfg, world, engines)  # type: ignore[arg-type]
    order = start_order(handles, need_old_logprobs=True)
    if rank == 3:  # the rollout rank hosts no scoring role
        return {"order": order}
    batch = _batch() if rank == 0 else None
    out = experience_forwards(handles, batch, need_old_logprobs=True)
    updates = role_updates(handles, batch, version=1, kl_coef=0.5)
    return {"order": order, "old": out.old_logprobs, "ref": out.ref_logprobs, "values": out.values,
            "seconds": out.compute_seconds, "updates": {role: u.wait() for role, u in updates.items()}}


@pytest.mark.slow
def test_moves_of_disjoint_roles_overlap_and_return_in_row_order(tmp_path):
    results = run_on_ranks(_forwards, 4, str(tmp_path))
    # The actor lives on rank 0, which runs its share in place: its forward starts last, on every rank alike.
    assert {tuple(r["order"]) for r in results} == {("ref_logprobs", "values", "old_logprobs")}
    controller = results[0]
    for name, value in (("old", 1.0), ("ref", 2.0), ("values", 3.0)):
        assert torch.equal(controller[name], torch.full((6, 4), value)), name
    assert set(controller["seconds"]) == {"actor", "ref", "critic"}
    assert all(results[rank]["ref"] is None for rank in (1, 2))  # outputs live on the controller only
    # the critic's update started first (its ranks do not include rank 0), the actor's (kl_coef 0.5) in place
    assert controller["updates"] == {"critic": {"critic_loss": 3.0}, "actor": {"policy_loss": 1.5}}
    assert results[2]["updates"] == {"critic": None, "actor": None}


def _failing_forward(rank: int, world_size: int) -> str:
    from hpc_rlhf.trainers.rl import roles as roles_module
    from hpc_rlhf.trainers.rl.roles import RoleHandles
    from hpc_rlhf.trainers.rl.setup import Roles
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement
    from tests.multiproc.role_moves import experience_forwards

    def broken(engine, rows, *args, **kwargs):
        raise ValueError("reference weights are NaN")

    roles_module.forward_logprobs = broken
    cfg = load_config(None, ["algo.kl.init_coef=0.01"])  # colocated: the one rank hosts actor and ref
    world = build_world_groups(build_placement(cfg, world_size))
    handles = RoleHandles.build(cfg, world, Roles(actor=_FakeEngine(1.0), ref=_FakeEngine(2.0)))  # type: ignore[arg-type]
    try:
        experience_forwards(handles, _batch(), need_old_logprobs=False)
    except ValueError as exc:
        return "\n".join([str(exc), *getattr(exc, "__notes__", [])])
    return "no error"


@pytest.mark.slow
def test_a_failing_move_names_its_rank_and_role():
    message = run_on_ranks(_failing_forward, 1)[0]
    assert "reference weights are NaN" in message
    assert "rank 0: failed in role 'ref'" in message
