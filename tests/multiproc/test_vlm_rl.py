"""GRPO on a tiny Qwen2.5-VL on 2 gloo ranks (the ``configs/grpo_vlm_tiny_cpu.yaml`` recipe, shortened): images go
through the data, the transformers rollout engine and every training forward; the rollout-vs-trainer KL stays at
rounding level; held-out accuracy on unseen images rises. Packed and ZeRO-3 with a frozen vision tower too."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rlhf.config.loader import load_config
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "grpo_vlm_tiny_cpu.yaml"


def _fit(rank, world_size, overrides):
    from hpc_rlhf.cli.startup import prepare_local_assets
    from hpc_rlhf.trainers.rl.async_loop import trainer_class
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(str(RECIPE), overrides)
    if rank == 0:
        prepare_local_assets(cfg)
    import torch.distributed as dist

    dist.barrier()
    trainer = trainer_class(cfg)(cfg, build_world_groups(build_placement(cfg, world_size)))
    trainer.fit()
    return None


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    root = Path(__file__).resolve().parents[2]
    return [f"actor.pretrain={tmp_path / 'model'}", f"train.output_dir={tmp_path / 'run'}",
            f"data.prompt_data=[{tmp_path / 'data' / 'train.jsonl'}]",
            f"eval.data=[{tmp_path / 'data' / 'heldout.jsonl'}]",
            f"reward.reward_func_path={root / 'examples' / 'reward_funcs' / 'colour.py'}",
            "logger.use_tensorboard=false", *extra]


def test_grpo_vlm_learns_the_colour_task(tmp_path):
    run_on_ranks(_fit, 2, _overrides(tmp_path, "train.max_steps=40", "eval.steps=40"))
    metrics = read_metrics(tmp_path / "run")
    evals = [r["eval/heldout/pass@1"] for r in metrics if "eval/heldout/pass@1" in r]
    assert evals[0] <= 0.25 and evals[-1] >= evals[0] + 0.4, evals
    trained = [r for r in metrics if "is/rollout_kl_k3" in r]
    assert trained and max(abs(r["is/rollout_kl_k3"]) for r in trained) < 1e-6


def test_grpo_vlm_packed_zero3_frozen_tower_trains(tmp_path):
    run_on_ranks(_fit, 2, _overrides(tmp_path, "train.max_steps=3", "eval.steps=3", "train.packing_samples=true",
                                     "ds.zero_stage=3", "actor.freeze_vision_tower=true"))
    metrics = read_metrics(tmp_path / "run")
    trained = [r for r in metrics if "is/rollout_kl_k3" in r]
    assert len(trained) == 3 and max(abs(r["is/rollout_kl_k3"]) for r in trained) < 1e-6
