"""The weight-sync plan (pure) and the flat bucket format."""

import pytest
import torch

from hpc_rlhf.weight_sync.plan import (
    assign_engine_senders,
    bucket_size_for,
    pack_consecutive,
    plan_weight_sync,
)
from hpc_rlhf.weight_sync.transport import pack_bucket, unpack_bucket

MB = 1 << 20


def test_pack_consecutive_closes_a_run_at_the_limit():
    assert pack_consecutive([3, 3, 3, 10, 1, 1], 5) == [[0, 1], [2, 3], [4, 5]]
    assert pack_consecutive([10], 5) == [[0]]  # larger than the limit: a bucket of its own
    assert pack_consecutive([], 5) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        pack_consecutive([1], 0)


def test_plan_covers_every_name_once_and_spreads_bytes_over_replicas():
    entries = [(f"layer{i}.w", (i % 5 + 1) * MB) for i in range(40)]
    replicas = [(0,), (1,), (2,)]
    plan = plan_weight_sync(entries, replicas, 4 * MB)
    names = [n for b in plan.buckets for n in b.names]
    assert names == [n for n, _ in entries]  # every entry once, buckets in state-dict order
    sent = plan.bytes_per_sender()
    total = sum(n for _, n in entries)
    largest = max(b.nbytes for b in plan.buckets)
    assert set(sent) == {0, 1, 2} and sum(sent.values()) == total
    assert max(sent.values()) <= total / 3 + largest  # no sender carries more than its share plus one bucket
    for k, round_buckets in enumerate(plan.rounds):
        assert len({b.replica for b in round_buckets}) == len(round_buckets)  # one bucket per replica per round
        for b in round_buckets:
            assert plan.buckets_of_replica(b.replica)[k] == b


def test_tensor_parallel_replica_members_take_turns_sending():
    plan = plan_weight_sync([(f"w{i}", MB) for i in range(16)], [(0, 1), (2, 3)], MB)
    for replica in ((0, 1), (2, 3)):
        senders = [b.sender for b in plan.buckets_of_replica(replica)]
        assert senders == [replica[k % 2] for k in range(len(senders))] and len(senders) == 8
    assert plan.bytes_per_sender() == {0: 4 * MB, 1: 4 * MB, 2: 4 * MB, 3: 4 * MB}


def test_plan_rejects_bad_replicas():
    with pytest.raises(ValueError, match="two replicas"):
        plan_weight_sync([("w", 1)], [(0, 1), (1,)], 1)
    with pytest.raises(ValueError, match="non-empty replica"):
        plan_weight_sync([("w", 1)], [], 1)


def test_bucket_size_gives_each_replica_several_buckets_within_bounds():
    assert bucket_size_for(1200 * MB, 3, 256 * MB) == 100 * MB
    assert bucket_size_for(100 * 1024 * MB, 3, 256 * MB) == 256 * MB  # capped
    assert bucket_size_for(MB, 3, 256 * MB) == MB  # floor: one collective per bucket must stay cheap
    assert bucket_size_for(MB, 3, 16 * 1024) == 16 * 1024  # the cap wins over the floor


def test_flat_bucket_round_trips_mixed_dtypes_and_shapes():
    tensors = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)),
               ("c", torch.randn(2, 3).to(torch.bfloat16)), ("d", torch.randn(1, 3).t())]  # d is not contiguous
    header, flat = pack_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.numel() == header.nbytes
    assert all(offset % 16 == 0 for offset in header.offsets)
    out = unpack_bucket(header, flat)
    assert [n for n, _ in out] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(tensors, out, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize(("num_engines", "replicas"), [
    (2, [(0,), (1,)]), (3, [(0,), (1,)]), (2, [(0,), (1,), (2,)]), (7, [(0,), (1,), (2,)]),
    (5, [(0, 1), (2, 3)]), (1, [(0, 1)]), (8, [(0,), (1,), (2,), (3,)]),
])
def test_engine_senders_cover_every_engine_balanced_and_spare_the_controller(num_engines, replicas):
    actor_ranks = [r for g in replicas for r in g]
    engines = list(range(len(actor_ranks), len(actor_ranks) + num_engines))
    senders = assign_engine_senders(engines, replicas, controller_rank=0)
    assert sorted(senders) == engines  # every engine has exactly one sender, an actor rank
    assert set(senders.values()) <= set(actor_ranks)
    per_replica = [sum(senders[e] in g for e in engines) for g in replicas]
    assert max(per_replica) - min(per_replica) <= 1, per_replica  # round-robin: replicas feed engines evenly
    per_rank = {r: sum(s == r for s in senders.values()) for r in actor_ranks}
    busiest_share = -(-num_engines // len(actor_ranks))
    assert max(per_rank.values()) <= -(-num_engines // len(replicas)) and max(per_rank.values()) >= busiest_share
    # the controller feeds no more than any other rank, and nothing while another rank is idle
    assert per_rank[0] == min(per_rank.values())
    if num_engines < len(actor_ranks):
        assert per_rank[0] == 0


def test_engine_senders_refuse_bad_input():
    with pytest.raises(ValueError, match="also actor ranks"):
        assign_engine_senders([1, 2], [(0,), (1,)])
    with pytest.raises(ValueError, match="two replicas"):
        assign_engine_senders([3], [(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="engines and non-empty replicas"):
        assign_engine_senders([], [(0,)])
