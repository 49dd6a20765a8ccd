"""The reasoning-gym recipe (configs/grpo_reasoning_gym_tiny_cpu.yaml) runs a few GRPO steps on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.config import load_config
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
pytest.importorskip("reasoning_gym", reason="reasoning-gym not installed (extra `tasks`)")


def _fit(rank, world_size, overrides):
    from hpc_rlhf.trainers.rl.loop import PPOTrainer
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(ROOT / "configs/grpo_reasoning_gym_tiny_cpu.yaml", overrides)
    PPOTrainer(cfg, build_world_groups(build_placement(cfg, world_size))).fit()


def test_reasoning_gym_recipe_runs(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    out = tmp_path / "run"
    run_on_ranks(_fit, 2, [f"actor.pretrain={model}", f"train.output_dir={out}", "train.max_steps=2",
                           "data.reasoning_gym.size=64", "logger.dump_rollouts_every=2",
                           "logger.use_tensorboard=false"])
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows)
    dumped = [json.loads(line) for line in (out / "rollouts" / "step_2.jsonl").read_text().splitlines()]
    assert len(dumped) == 64
    assert all(d["label"]["task"] == "basic_arithmetic" and d["prompt"].startswith("Calculate") for d in dumped)
