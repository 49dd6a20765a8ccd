"""Shared pieces of the RL end-to-end tests: a tiny local model, prompt data and run configs."""

from __future__ import annotations

from pathlib import Path

from hpc_rlhf.config import load_config
from hpc_rlhf.data.synthetic import write_task_if_missing
from hpc_rlhf.models.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
SHAPED_REWARD = str(ROOT / "examples/reward_funcs/arithmetic_shaped.py")


def make_assets(base: Path) -> dict[str, str]:
    model = build_tiny_model(base / "tiny-model", seed=0)
    data = write_task_if_missing("arithmetic", base / "arith.jsonl", 256, seed=0)
    return {"model": str(model), "data": str(data)}


def grpo_overrides(assets: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    return [
        f"actor.pretrain={assets['model']}", "actor.learning_rate=2e-3", "actor.lr_warmup_ratio=0",
        "actor.min_lr_ratio=1", f"reward.reward_func_path={SHAPED_REWARD}",
        "rollout.n_samples_per_prompt=8", "rollout.rollout_batch_size=8", "rollout.micro_rollout_batch_size=32",
        "rollout.generate_max_len=4", "ds.zero_stage=2", "algo.advantage_estimator=group_norm",
        f"train.output_dir={output_dir}", "train.num_episodes=8", "train.train_batch_size=64",
        "train.micro_train_batch_size=32", f"data.prompt_data=[{assets['data']}]", "data.input_key=input",
        "data.label_key=label", "data.prompt_max_len=16", "logger.use_tensorboard=false", *extra,
    ]


def run_trainer(rank: int, world_size: int, overrides: list[str]):
    """Build the world groups and a PPOTrainer from overrides (inside a spawned rank)."""
    from hpc_rlhf.trainers.rl.loop import PPOTrainer
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, overrides)
    world = build_world_groups(build_placement(cfg, world_size))
    return PPOTrainer(cfg, world)
