"""Asynchronous RL on 3 gloo ranks (actor 2, rollout 1): bounded staleness, agents that fail, exact resume."""

from __future__ import annotations

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks, signal_after
from tests.multiproc.test_resume import _assert_same_rows

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _async(assets, out, *extra):
    return grpo_overrides(assets, out, "train.colocate_all=false", "train.async_train=true", "actor.num_ranks=2",
                          "rollout.num_engines=1", "algo.is_correction=tis", *extra)


def _fit_async(rank, world_size, overrides, stop_after=None):
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.async_loop import AsyncPPOTrainer
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    signal_after(stop_after)
    cfg = load_config(None, overrides)
    trainer = AsyncPPOTrainer(cfg, build_world_groups(build_placement(cfg, world_size)))
    trainer.fit()
    return trainer.generated


RUNS = {  # independent runs that share one spawn (starting 3 ranks costs more than a run): id -> overrides
    "queue1": ("train.async_queue_size=1", "train.max_staleness=1", "train.max_steps=8"),
    "queue2": ("train.async_queue_size=2", "train.max_staleness=2", "train.max_steps=8"),
    "drop": ("train.async_queue_size=2", "train.max_staleness=1", "train.staleness_policy=drop", "train.max_steps=5"),
    "partial": ("train.partial_rollout=true", "rollout.partial_chunk_tokens=2", "train.max_staleness=2",
                "rollout.generate_max_len=6", "train.max_steps=5"),
}


@pytest.fixture(scope="module")
def runs(assets, tmp_path_factory):
    """``{id: (output folder, batches generated per rank)}`` for every RUNS entry, one after another in one
    spawn; each builds its own trainer and groups."""
    base = tmp_path_factory.mktemp("runs")
    generated = run_each_on_ranks(_fit_async, 3, {run_id: (_async(assets, base / run_id, *extra),)
                                                  for run_id, extra in RUNS.items()})
    return {run_id: (base / run_id, generated[run_id]) for run_id in RUNS}


@pytest.mark.parametrize("queue_size", [1, 2])
def test_async_run_keeps_staleness_within_the_bound(runs, queue_size):
    tmp_path, generated = runs[f"queue{queue_size}"]
    assert generated == [8, 8, 8]  # one batch per step, no more
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for row in rows:
        assert row["async/staleness_max"] <= queue_size
        assert 0 < row["entropy"] < float("inf")  # the actor update of the async trainer logs it too
        assert row["reward/arith"] == pytest.approx(row["reward"], abs=1e-6)  # one source: the prompt file's stem
    # The pipeline is full after the first steps: samples are exactly queue_size versions old.
    assert rows[-1].get(f"async/staleness_{queue_size}") == 64.0
    assert rows[0].get("async/staleness_0") == 64.0
    assert (tmp_path / "model" / "config.json").is_file()


def test_drop_policy_drops_and_counts_stale_samples(runs):
    rows = read_metrics(runs["drop"][0])
    assert sum(r["async/dropped_stale"] for r in rows) > 0
    assert all(r["async/staleness_max"] <= 1 for r in rows)
    assert any(r.get("skipped_update") == 1.0 for r in rows)  # a fully dropped batch trains nothing


def test_failing_and_hanging_agents_do_not_stall_async_training(assets, tmp_path):
    agent = tmp_path / "flaky_agent.py"
    agent.write_text(
        "import asyncio\n"
        "from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def reset(self, states, **kw):\n"
        "        return {'observation': states['observation']}\n"
        "    async def step(self, states, **kw):\n"
        "        if states['observation_text'].startswith('1+'):\n"
        "            raise RuntimeError('environment crashed')\n"
        "        if states['observation_text'].startswith('2+'):\n"
        "            await asyncio.sleep(30)\n"
        "        return {'rewards': 1.0, 'scores': 1.0, 'environment_feedback': '', 'done': True}\n"
        "class AgentExecutor(MultiTurnAgentExecutor):\n"
        "    pass\n")
    overrides = _async(assets, tmp_path / "run", "reward.reward_func_path=null", f"train.agent_func_path={agent}",
                       "train.agent_step_timeout_s=0.5", "data.max_len=32", "train.max_steps=3")
    run_on_ranks(_fit_async, 3, overrides)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.parametrize("partial", [False, True])
def test_async_resume_restores_the_buffer(assets, tmp_path, partial):
    extra = ["train.partial_rollout=true", "rollout.partial_chunk_tokens=2", "train.max_staleness=2"] if partial else []
    full = _async(assets, tmp_path / "full", "train.max_steps=4", "ckpt.save_steps=3", *extra)
    cut = _async(assets, tmp_path / "cut", "train.max_steps=4", "ckpt.save_steps=3", *extra)
    # The uninterrupted run, then the cut one, in one spawn. Stop after step 2: the queue holds batch 3
    # (generated, not trained) and, with partial rollouts, the rollout rank holds batch 4 cut short; both go
    # into the checkpoint.
    expected_at_cut = 4 if partial else 3
    generated = run_each_on_ranks(_fit_async, 3, {"full": (full,), "cut": (cut, 2)})
    assert generated == {"full": [4, 4, 4], "cut": [expected_at_cut] * 3}
    # Resumed in fresh processes, as a requeued job: no batch is generated twice; the buffered ones come from
    # the checkpoint.
    assert run_on_ranks(_fit_async, 3, [*cut, "ckpt.load=true"]) == [4, 4, 4]
    got = read_metrics(tmp_path / "cut")
    assert [r["step"] for r in got] == list(range(1, 5))
    assert [r["async/generated_batches"] for r in got] == [r["async/generated_batches"]
                                                            for r in read_metrics(tmp_path / "full")]
    _assert_same_rows(read_metrics(tmp_path / "full"), got, steps=(3, 4))


def test_partial_rollouts_span_weight_updates(runs):
    tmp_path, generated = runs["partial"]
    assert generated == [5, 5, 5]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 2 for r in rows)
    # Batches started before a sync and finished after it carry two policy versions.
    assert sum(r["async/mixed_version_samples"] for r in rows[2:]) > 0
