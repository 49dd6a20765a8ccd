"""The make-experience forwards of roles on disjoint ranks run at once (``hpc_rlhf.trainers.rl.experience``).

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
          "actor.num_ranks=1", "ref.num_ranks=1", "critic.num_ranks=1", "rollout.num_engines=1"]
WAIT_FOR_CRITIC_S = 60.0  # a generous bound for the critic's rank to start; only a sequential phase runs out of it


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
                     rewards=torch.zeros(rows))


def _forwards(rank: int, world_size: int, folder: str) -> dict:
    from hpc_rlhf.trainers.rl import roles as roles_module
    from hpc_rlhf.trainers.rl.experience import experience_forwards, start_order
    from hpc_rlhf.trainers.rl.roles import RoleHandles
    from hpc_rlhf.trainers.rl.setup import Roles
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    started = Path(folder)

    def fake_logprobs(engine, rows, *args, **kwargs):
        if engine.value == 2.0:  # the reference: hold on until the critic has started
            deadline = time.monotonic() + WAIT_FOR_CRITIC_S
            while not (started / "critic").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the critic's forward did not start while the reference's ran")
                time.sleep(0.05)
        return torch.full(rows.action_mask.shape, engine.value)

    def fake_values(engine, rows, *args, **kwargs):
        (started / "critic").touch()
        return torch.full(rows.action_mask.shape, engine.value)

    roles_module.forward_logprobs = fake_logprobs  # this rank's process only
    roles_module.forward_values = fake_values
    cfg = load_config(None, LAYOUT)
    world = build_world_groups(build_placement(cfg, world_size))
    engines = Roles(actor=_FakeEngine(1.0) if rank == 0 else None, ref=_FakeEngine(2.0) if rank == 1 else None,
                    critic=_FakeEngine(3.0) if rank == 2 else None)
    handles = RoleHandles.build(cfg, world, engines)  # type: ignore[arg-type]
    order = [name for name, _, _ in start_order(handles, need_old_logprobs=True)]
    if rank == 3:  # the rollout rank hosts no scoring role
        return {"order": order}
    out = experience_forwards(handles, _batch() if rank == 0 else None, need_old_logprobs=True)
    return {"order": order, "old": out.old_logprobs, "ref": out.ref_logprobs, "values": out.values,
            "seconds": out.compute_seconds}


@pytest.mark.slow
def test_forwards_of_disjoint_roles_overlap_and_return_in_row_order(tmp_path):
    results = run_on_ranks(_forwards, 4, str(tmp_path))
    # The actor lives on rank 0, which runs its share in place: its forward starts last, on every rank alike.
    assert {tuple(r["order"]) for r in results} == {("ref_logprobs", "values", "old_logprobs")}
    controller = results[0]
    for name, value in (("old", 1.0), ("ref", 2.0), ("values", 3.0)):
        assert torch.equal(controller[name], torch.full((6, 4), value)), name
    assert set(controller["seconds"]) == {"actor", "ref", "critic"}
    assert all(results[rank]["ref"] is None for rank in (1, 2))  # outputs live on the controller only
