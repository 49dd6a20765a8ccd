"""Build the role groups of each layout on 2 and 4 gloo ranks and move a batch through them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpc_rlhf.config import load_config
from hpc_rlhf.world.placement import build_placement
from tests.multiproc.spawn import run_on_ranks

LAYOUTS = {
    "colocated": ["algo.advantage_estimator=gae", "algo.kl.init_coef=0.01"],
    "disaggregated": [
        "train.colocate_all=false", "algo.kl.init_coef=0.01", "actor.num_ranks=2", "ref.num_ranks=1",
        "rollout.num_engines=1",
    ],
    "partial": [
        "train.colocate_all=false", "train.colocate_actor_ref=true", "train.colocate_critic_reward=true",
        "algo.advantage_estimator=gae", "algo.kl.init_coef=0.01", "reward.pretrain=/models/rm",
        "actor.num_ranks=2", "critic.num_ranks=1", "rollout.num_engines=1",
    ],
    "tensor_parallel": ["train.colocate_all=false", "ds.tensor_parallel_size=2", "actor.num_ranks=2",
                        "rollout.num_engines=1", "rollout.tensor_parallel_size=2"],
}


def _round_trip(rank: int, world_size: int, overrides: list[str]) -> dict:
    """Controller -> each role: broadcast, scatter per dp rank, gather back. Returns what rank 0 saw."""
    from hpc_rlhf.world.channel import broadcast_to_role, gather_from_role, scatter_to_role
    from hpc_rlhf.world.groups import build_world_groups

    cfg = load_config(None, overrides)
    placement = build_placement(cfg, world_size)
    world = build_world_groups(placement)
    seen: dict = {}
    for name, groups in world.roles.items():
        if rank not in groups.controller_ranks:
            continue
        grid = placement.roles[name]
        batch = {"tokens": torch.arange(12).reshape(3, 4), "meta": {"role": name}} if rank == 0 else None
        got = broadcast_to_role(batch, groups)
        assert got["meta"]["role"] == name and torch.equal(got["tokens"], torch.arange(12).reshape(3, 4))
        shards = [{"dp": i, "x": torch.full((2,), float(i))} for i in range(grid.dp_size)] if rank == 0 else None
        mine = scatter_to_role(shards, groups)
        reply = None
        if rank in groups.ranks:
            assert mine["dp"] == grid.dp_rank(rank), (name, rank, mine)
            # Each replica doubles its shard and reports which global rank did the work.
            reply = {"x2": mine["x"] * 2, "from": rank, "group_size": dist.get_world_size(groups.group)}
        gathered = gather_from_role(reply, groups)
        if rank == 0:
            seen[name] = [(g["from"], g["x2"].tolist(), g["group_size"]) for g in gathered]
    return seen


def _every_layout(rank: int, world_size: int) -> dict:
    # One world for all layouts: each builds its own groups, as a fresh run would.
    return {layout: _round_trip(rank, world_size, overrides) for layout, overrides in sorted(LAYOUTS.items())}


@pytest.mark.slow
def test_round_trip_4_ranks_every_layout():
    seen_by_layout = run_on_ranks(_every_layout, 4)[0]
    assert set(seen_by_layout) == set(LAYOUTS)
    for layout, overrides in LAYOUTS.items():
        placement = build_placement(load_config(None, overrides), 4)
        seen = seen_by_layout[layout]
        assert set(seen) == set(placement.roles), layout
        for name, grid in placement.roles.items():
            expected = [(leader, [2.0 * i, 2.0 * i], len(grid.ranks)) for i, leader in enumerate(grid.dp_leaders())]
            assert seen[name] == expected, (layout, name)


@pytest.mark.slow
def test_round_trip_2_ranks_colocated():
    seen = run_on_ranks(_round_trip, 2, LAYOUTS["colocated"])[0]
    assert set(seen) == {"actor", "critic", "ref", "rollout"}
    assert seen["actor"] == [(0, [0.0, 0.0], 2), (1, [2.0, 2.0], 2)]
