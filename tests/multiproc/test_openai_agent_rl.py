"""GRPO with an agent written against the OpenAI API (two-turn chat), 2 gloo ranks, real endpoint and client."""

from __future__ import annotations

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytest.importorskip("openai")
pytestmark = pytest.mark.slow
AGENT = str(ROOT / "examples/agents/openai_math_agent.py")
STEPS = 30


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _fit(rank, world_size, overrides):
    trainer = run_trainer(rank, world_size, overrides)
    trainer.fit()
    endpoint = trainer.roles.rollout.executor.endpoint if trainer.roles.rollout else None
    return {"endpoint_closed": endpoint is None}


def test_openai_agent_two_turn_grpo_reward_rises(assets, tmp_path):
    overrides = grpo_overrides(
        assets, tmp_path, "reward.reward_func_path=null", f"train.agent_func_path={AGENT}", "data.max_len=64",
        "rollout.n_samples_per_prompt=8", "train.train_batch_size=64", "train.micro_train_batch_size=32",
        f"train.max_steps={STEPS}", "train.agent_episode_timeout_s=120")
    results = run_on_ranks(_fit, 2, overrides)
    assert all(r["endpoint_closed"] for r in results)  # the servers stop when training ends
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert row["agent/num_calls"] == 2 and row["agent/num_turns"] == 2 and row["agent/dropped_calls"] == 0
        assert row["agent/error_fraction"] == 0
    assert "extra/accuracy" in rows[-1]
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.1, (first, last)
