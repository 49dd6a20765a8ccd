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
        assert row["agent/num_calls"] == 2 and row["agent/num_turns"] == 2 and row["agent/rows_per_episode"] == 1
        assert row["agent/error_fraction"] == 0
    assert "extra/accuracy" in rows[-1]
    first = sum(r["reward"] for r in rows[:5]) / 5
    last = sum(r["reward"] for r in rows[-5:]) / 5
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.1, (first, last)


UNEVEN_AGENT = str(ROOT / "tests/multiproc/agent_files/uneven_branching_openai_agent.py")


def test_branching_episodes_train_every_branch_with_a_reference_model(assets, tmp_path):
    """Episodes of 1 or 2 rows: odd row counts go through the ref / old-logprob forwards (padded to the dp size)
    and mini-batches of whole episodes padded with masked rows; every row trains and GRPO groups the episodes."""
    steps = 2
    overrides = grpo_overrides(
        assets, tmp_path, "reward.reward_func_path=null", f"train.agent_func_path={UNEVEN_AGENT}", "data.max_len=64",
        "rollout.n_samples_per_prompt=4", "rollout.rollout_batch_size=4", "train.train_batch_size=8",
        "train.micro_train_batch_size=4", f"train.max_steps={steps}", "train.agent_episode_timeout_s=120",
        f"ref.pretrain={assets['model']}", "algo.kl.use_loss=true", "algo.kl.init_coef=0.01")
    run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    per_episode = [r["agent/rows_per_episode"] for r in rows]
    for row in rows:
        assert row["num_episodes"] == 16 and row["agent/error_fraction"] == 0
        assert row["num_samples"] == row["num_trained_samples"] == row["agent/rows_per_episode"] * 16
        assert row["agent/num_branches"] == row["agent/rows_per_episode"]
        assert "skipped_update" not in row and row["policy_loss"] == row["policy_loss"]  # trained, finite
        assert row["kl"] == row["kl"]
    assert all(1 < x < 2 for x in per_episode), per_episode  # uneven episodes (1 or 2 rows) in every step
