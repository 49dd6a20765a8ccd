"""Exact resume with image rollouts on a tiny Qwen2.5-VL (the colour task of ``configs/grpo_vlm_tiny_cpu.yaml``):
a run interrupted by a signal and resumed in fresh processes continues as the uninterrupted run, synchronous
(2 colocated ranks) and asynchronous (3 ranks: the ready queue's image rollouts go into the checkpoint, and
nothing is generated twice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks, signal_after

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("reward", "score", "response_length", "policy_loss", "actor_grad_norm", "actor_lr", "is/rollout_kl_k3")


def _fit(rank, world_size, overrides, stop_after=None):
    import torch.distributed as dist

    from hpc_rlhf.cli.startup import prepare_local_assets
    from hpc_rlhf.config.loader import load_config
    from hpc_rlhf.trainers.rl.async_loop import trainer_class
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    signal_after(stop_after)
    cfg = load_config(str(ROOT / "configs" / "grpo_vlm_tiny_cpu.yaml"), overrides)
    if rank == 0:
        prepare_local_assets(cfg)
    dist.barrier()
    trainer = trainer_class(cfg)(cfg, build_world_groups(build_placement(cfg, world_size)))
    trainer.fit()
    return getattr(trainer, "generated", None)


def _overrides(assets: Path, out: Path, *extra: str) -> list[str]:
    return [f"actor.pretrain={assets / 'model'}", f"train.output_dir={out}",
            f"data.prompt_data=[{assets / 'data' / 'train.jsonl'}]", "eval.data=[]",
            f"reward.reward_func_path={ROOT / 'examples' / 'reward_funcs' / 'colour.py'}",
            "logger.use_tensorboard=false", "train.max_steps=4", "ckpt.save_steps=3", "data.synthetic_num_samples=64",
            "rollout.rollout_batch_size=4", "train.train_batch_size=32", "train.micro_train_batch_size=16", *extra]


def _assert_same_rows(full: Path, cut: Path, steps) -> None:
    expected, got = read_metrics(full), read_metrics(cut)
    assert [r["step"] for r in got] == [r["step"] for r in expected] == [1, 2, 3, 4]
    for step in steps:
        a, b = expected[step - 1], got[step - 1]
        for key in COMPARED:
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (step, key, a[key], b[key])


def test_sync_resume_with_image_rollouts(tmp_path):
    assets = tmp_path / "assets"
    full, cut = _overrides(assets, tmp_path / "full"), _overrides(assets, tmp_path / "cut")
    run_each_on_ranks(_fit, 2, {"full": (full,), "cut": (cut, 2)})  # signal in step 2: checkpoint at 2, stop
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == [1, 2]
    run_on_ranks(_fit, 2, [*cut, "ckpt.load=true"])
    _assert_same_rows(tmp_path / "full", tmp_path / "cut", steps=(3, 4))


def test_async_resume_keeps_the_image_rollouts_of_the_queue(tmp_path):
    assets = tmp_path / "assets"
    extra = ("train.colocate_all=false", "train.async_train=true", "actor.num_ranks=2", "rollout.num_engines=1",
             "algo.is_correction=tis")
    full, cut = _overrides(assets, tmp_path / "full", *extra), _overrides(assets, tmp_path / "cut", *extra)
    # Stop after step 2: the ready queue holds batch 3 (image rollouts, generated, not trained): it goes into the
    # checkpoint, and the resumed run trains on it without generating it again.
    generated = run_each_on_ranks(_fit, 3, {"full": (full,), "cut": (cut, 2)})
    assert generated == {"full": [4, 4, 4], "cut": [3, 3, 3]}
    assert run_on_ranks(_fit, 3, [*cut, "ckpt.load=true"]) == [4, 4, 4]
    _assert_same_rows(tmp_path / "full", tmp_path / "cut", steps=(3, 4))
