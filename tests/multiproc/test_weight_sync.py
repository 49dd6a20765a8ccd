"""Sharded actor -> rollout weight sync on 5 gloo ranks: 3 actor replicas send, 2 rollout engines receive.

The actor side runs the real gathering code (``state_gather.ModuleWeights``, ZeRO 0-2: every replica holds full
weights) behind the two methods ``ShardedWeightSync`` needs from a ``TrainEngine``; the rollout side is the
transformers engine.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.spawn import run_on_ranks

BUCKET_BYTES = 16 << 10  # a ~350 KB model: about two dozen buckets, so every replica sends several


def _model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


# 5 ranks each: 3 data-parallel replicas -> 2 engines; 2 tensor-parallel replicas of 2 ranks (taking turns) -> 1
LAYOUTS = {"dp3": ["actor.num_ranks=3", "rollout.num_engines=2"],
           "tp2": ["actor.num_ranks=4", "ds.tensor_parallel_size=2", "rollout.num_engines=1"]}


def _sync_twice(rank: int, world_size: int, overrides: list[str]) -> dict:
    from hpc_rlhf.config import load_config
    from hpc_rlhf.engines.state_gather import ModuleWeights
    from hpc_rlhf.engines.transformers_rollout import TransformersRolloutEngine
    from hpc_rlhf.trainers.rl.weight_sync import ShardedWeightSync
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, ["train.colocate_all=false", *overrides])
    world = build_world_groups(build_placement(cfg, world_size))
    sync = ShardedWeightSync(world, bucket_bytes=BUCKET_BYTES)
    actor_ranks = world.placement.roles["actor"].ranks
    result: dict = {"role": "actor" if rank in actor_ranks else "rollout"}
    if rank in actor_ranks:
        actor = _model(seed=1)  # every replica holds the same weights, as data-parallel ranks do
        sync.send(ModuleWeights(actor))
        with torch.no_grad():  # a training step's change; the second sync reuses the plan and cached headers
            for p in actor.parameters():
                p.add_(0.5)
        sync.send(ModuleWeights(actor))
        result.update(bytes_sent=sync.bytes_sent, plan_sent=sync.plan.bytes_per_sender())
    else:
        engine = TransformersRolloutEngine(_model(seed=2), eos_token_id=1, pad_token_id=0)
        expected = _model(seed=1)
        sync.receive(engine)
        first = all(torch.equal(engine.model.state_dict()[k], v) for k, v in expected.state_dict().items())
        with torch.no_grad():
            for p in expected.parameters():
                p.add_(0.5)
        sync.receive(engine)
        second = all(torch.equal(engine.model.state_dict()[k], v) for k, v in expected.state_dict().items())
        result.update(first=first, second=second, num_buckets=len(sync.plan.buckets),
                      total=sum(b.nbytes for b in sync.plan.buckets),
                      largest=max(b.nbytes for b in sync.plan.buckets),
                      padding=15 * sum(len(b.names) for b in sync.plan.buckets))  # 16-byte alignment, at most
    return result


def _every_layout(rank: int, world_size: int) -> dict:
    # One world for both layouts: each builds its own groups, as a fresh run would.
    return {name: _sync_twice(rank, world_size, overrides) for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def synced():
    per_rank = run_on_ranks(_every_layout, 5)
    return {name: [r[name] for r in per_rank] for name in LAYOUTS}


def test_sharded_sync_reaches_every_engine_and_rank0_sends_only_its_share(synced):
    results = synced["dp3"]
    actors, rollouts = results[:3], results[3:]
    assert [r["role"] for r in results] == ["actor"] * 3 + ["rollout"] * 2
    for r in rollouts:  # both engines end with the actor's weights, after the first and the second sync
        assert r["first"] and r["second"], r
    total, largest, padding = rollouts[0]["total"], rollouts[0]["largest"], rollouts[0]["padding"]
    assert rollouts[0]["num_buckets"] >= 9
    # Each bucket left exactly one rank, twice (payload bytes counted by the transport, alignment padding included)
    sent = [r["bytes_sent"] for r in actors]
    assert 2 * total <= sum(sent) <= 2 * (total + padding)
    # ... and every replica sent: rank 0 carries about a third, never the whole model.
    assert all(s > 0 for s in sent)
    assert sent[0] <= 2 * (total / 3 + largest + padding), (sent, total)
    assert actors[0]["plan_sent"] == actors[1]["plan_sent"] == actors[2]["plan_sent"]  # one plan on every rank


def test_tensor_parallel_ranks_take_turns_sending(synced):
    results = synced["tp2"]
    actors, rollout = results[:4], results[4]
    assert rollout["role"] == "rollout" and rollout["first"] and rollout["second"], rollout
    sent = [r["bytes_sent"] for r in actors]
    assert all(s > 0 for s in sent), sent  # both ranks of each tp replica send, not only its leader
    assert 2 * rollout["total"] <= sum(sent) <= 2 * (rollout["total"] + rollout["padding"])
