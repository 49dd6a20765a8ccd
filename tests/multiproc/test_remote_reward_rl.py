"""The RL loop scores rollouts through a real reward-model HTTP server on loopback."""

from __future__ import annotations

import pytest
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hpc_rlhf.serving.rm_server import BackgroundServer, RewardScorer, create_app
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def test_grpo_trains_against_the_reward_server(tmp_path):
    assets = make_assets(tmp_path / "assets")
    rm_dir = tmp_path / "rm"
    rm = AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1)
    rm.config.pad_token_id = rm.config.eos_token_id
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(assets["model"]).save_pretrained(rm_dir)
    scorer = RewardScorer(str(rm_dir), max_len=64, batch_size=64)
    with BackgroundServer(create_app(scorer)) as server:
        overrides = grpo_overrides(assets, tmp_path / "run", "reward.reward_func_path=null",
                                   f"reward.remote_url=[{server.url}/get_reward]", "train.max_steps=2")
        run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert scorer.num_forwards >= 2  # every step's 64 samples went through the server
    assert all(r["reward"] == pytest.approx(r["score"]) for r in rows)
    assert len({round(r["reward"], 6) for r in rows}) == 2
