"""The controller channel on 4 gloo ranks: every layout's shards arrive intact (dtypes, shapes, Python leaves),
and the messages every rank sent are exactly the ones ``hpc_rlhf.world.traffic`` lists for the layout."""

from __future__ import annotations

import collections

import pytest
import torch

from hpc_rlhf.world.placement import Placement, RoleGrid
from hpc_rlhf.world.traffic import (
    ReplicaLayout,
    broadcast_messages,
    gather_messages,
    scatter_messages,
)
from tests.multiproc.spawn import run_on_ranks

Pair = collections.namedtuple("Pair", "left right")

# name -> (ranks, tp, sp): rank 0 inside (colocated) and outside (disaggregated) the role.
GRIDS = {
    "dp": ((0, 1, 2, 3), 1, 1),
    "tp2": ((0, 1, 2, 3), 2, 1),
    "sp2": ((0, 1, 2, 3), 1, 2),
    "tp2_sp2": ((0, 1, 2, 3), 2, 2),
    "apart_dp": ((1, 2, 3), 1, 1),
    "apart_tp2": ((2, 3), 2, 1),
}


def _placement() -> Placement:
    return Placement(4, "test", {name: RoleGrid(name, ranks, tp, sp) for name, (ranks, tp, sp) in GRIDS.items()})


def _shard(dp: int) -> dict:
    """A shard with every kind of leaf the trainer sends; values depend on ``dp``."""
    return {
        "sequences": torch.arange(12, dtype=torch.long).reshape(3, 4) + 100 * dp,
        "mask": torch.tensor([[True, False, True]]).repeat(dp + 1, 1),  # rows differ per replica
        "logprobs": torch.linspace(-1, 0, 5, dtype=torch.float32) * (dp + 1),
        "half": torch.full((2, 3), dp + 0.5, dtype=torch.bfloat16),
        "scalar": torch.tensor(dp, dtype=torch.int16),
        "empty": torch.zeros(0, 7),
        "pair": Pair(torch.ones(3, dtype=torch.uint8) * dp, f"replica {dp}"),
        "meta": {"dp": dp, "counts": [dp, dp + 1], "none": None},
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _moves(rank: int, world_size: int) -> dict:
    """Broadcast, scatter and gather on every role; returns what every rank saw and the messages it sent."""
    from hpc_rlhf.world.channel import (
        broadcast_to_role,
        count_traffic,
        gather_from_role,
        payload_of,
        scatter_to_role,
    )
    from hpc_rlhf.world.groups import build_world_groups

    placement = _placement()
    world = build_world_groups(placement)
    out: dict = {}
    for name, groups in world.roles.items():
        if rank not in groups.controller_ranks:
            continue
        grid = placement.roles[name]
        shards = [_shard(i) for i in range(grid.dp_size)]
        with count_traffic() as ledger:
            got_all = broadcast_to_role(_shard(7) if rank == 0 else None, groups)
            mine = scatter_to_role(shards if rank == 0 else None, groups)
            reply = None
            if rank in groups.ranks:
                dp = grid.dp_rank(rank)
                reply = {"doubled": mine["logprobs"] * 2, "from": rank, "dp": dp}
            gathered = gather_from_role(reply, groups)
        row = {"broadcast_ok": _same(got_all, _shard(7)), "messages": list(ledger.messages)}
        if rank in groups.ranks:
            row["scatter_ok"] = _same(mine, shards[grid.dp_rank(rank)])
        if rank == 0:
            row["gathered"] = [(g["from"], g["dp"], g["doubled"].tolist()) for g in gathered]
            row["payloads"] = {"broadcast": payload_of(_shard(7)), "scatter": [payload_of(s) for s in shards],
                               "gather": [payload_of(g) for g in gathered]}
        out[name] = row
    return out


@pytest.mark.slow
def test_every_layout_delivers_and_sends_what_the_model_lists():
    per_rank = run_on_ranks(_moves, 4)
    placement = _placement()
    for name, grid in placement.roles.items():
        members = sorted({0, *grid.ranks})
        for rank in members:
            row = per_rank[rank][name]
            assert row["broadcast_ok"], (name, rank)
            assert row.get("scatter_ok", rank not in grid.ranks), (name, rank)
        leaders = grid.dp_leaders()
        expected_back = [(leader, i, (torch.linspace(-1, 0, 5) * (i + 1) * 2).tolist()) for i, leader in
                         enumerate(leaders)]
        assert per_rank[0][name]["gathered"] == expected_back, name

        layout = ReplicaLayout.from_ranks({r: grid.dp_rank(r) for r in grid.ranks}, leaders)
        payloads = per_rank[0][name]["payloads"]
        expected = (broadcast_messages(layout, payloads["broadcast"]) + scatter_messages(layout, payloads["scatter"])
                    + gather_messages(layout, payloads["gather"]))
        sent = [m for rank in members for m in per_rank[rank][name]["messages"]]
        assert sorted(sent, key=repr) == sorted(expected, key=repr), name
