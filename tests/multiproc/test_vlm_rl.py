"""GRPO on a tiny Qwen2.5-VL on 2 gloo ranks (the ``configs/grpo_vlm_tiny_cpu.yaml`` recipe, shortened): images go
through the data, the transformers rollout engine and every training forward; the rollout-vs-trainer KL stays at
rounding level; held-out accuracy on unseen images rises. Packed and ZeRO-3 with a frozen vision tower too. PPO with
a critic built from the VLM (GAE), padded and packed; the KL reference and the distillation teacher score image rows
through forwards that take the images."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hpc_rlhf.config.loader import load_config
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.spawn import run_each_on_ranks, run_on_ranks

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


PPO = ("algo.advantage_estimator=gae", "rollout.n_samples_per_prompt=1", "rollout.rollout_batch_size=64",
       "critic.learning_rate=1e-3", "critic.lr_warmup_ratio=0", "critic.min_lr_ratio=1.0", "eval.at_start=false")


def test_ppo_gae_with_a_vlm_critic_updates_and_the_critic_learns(tmp_path):
    runs = {"padded": _overrides(tmp_path / "padded", "train.max_steps=8", "eval.steps=100", *PPO),
            "packed_zero3": _overrides(tmp_path / "packed", "train.max_steps=2", "eval.steps=100", *PPO,
                                       "train.packing_samples=true", "ds.zero_stage=3", "ckpt.save_steps=2",
                                       "ckpt.save_hf=true", "ckpt.save_critic_hf=true")}
    run_each_on_ranks(_fit, 2, {name: (overrides,) for name, overrides in runs.items()})
    for name, steps in (("padded", 8), ("packed", 2)):
        rows = [r for r in read_metrics(tmp_path / name / "run") if "critic_loss" in r]
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), name
        for r in rows:
            assert math.isfinite(r["critic_loss"]) and math.isfinite(r["actor_grad_norm"]) and r["actor_grad_norm"] > 0
            assert abs(r["is/rollout_kl_k3"]) < 1e-6, (name, r["is/rollout_kl_k3"])
    # the critic's HF export (gathered from ZeRO-3) loads back with its trained head, processor beside it
    from hpc_rlhf.models.loading import load_value_model

    export = tmp_path / "packed" / "run" / "hf" / "step_2" / "critic"
    critic = load_value_model(str(export), torch.float32, "sdpa", require_head=True)
    assert critic.score.weight.abs().sum() > 0 and (export / "preprocessor_config.json").is_file()
    rows = [r for r in read_metrics(tmp_path / "padded" / "run") if "critic_loss" in r]
    losses = [r["critic_loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < 0.5 * losses[0], losses  # the critic fits the returns of the images it sees
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.05, rewards


def _frozen_scores(rank, world_size, overrides):
    """Before any update: the actor's, the reference's and the teacher's log-probs of one step's image rows, and the
    reference's and the teacher's with every pixel zeroed (rank 0; None elsewhere). Then the run trains a few
    steps."""
    from dataclasses import replace

    import torch.distributed as dist

    from hpc_rlhf.cli.startup import prepare_local_assets
    from hpc_rlhf.trainers.rl.async_loop import trainer_class
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(str(RECIPE), overrides)
    if rank == 0:
        prepare_local_assets(cfg)
    dist.barrier()
    trainer = trainer_class(cfg)(cfg, build_world_groups(build_placement(cfg, world_size)))
    prompts = trainer.controller.next_prompts() if trainer.world.is_controller else None
    batch = trainer._training_batch(trainer.score(trainer.generate(prompts, 1)))
    handles = trainer.handles
    assert handles.ref is not None and handles.teacher is not None
    zeroed = None if batch is None else replace(batch, pixel_values=torch.zeros_like(batch.pixel_values))
    scores = {"actor": handles.actor.logprobs(batch), "ref": handles.ref.logprobs(batch),
              "teacher": handles.teacher.logprobs(batch), "ref_zeroed": handles.ref.logprobs(zeroed),
              "teacher_zeroed": handles.teacher.logprobs(zeroed)}
    trainer.fit()
    if batch is None:
        return None
    return {"mask": batch.action_mask, "image_rows": int((batch.image_grid_thw.prod(-1) > 0).any(-1).sum()),
            **{k: v.clone() for k, v in scores.items()}}


def test_kl_reference_and_distillation_teacher_read_the_images(tmp_path):
    from hpc_rlhf.models.tiny_vlm import build_tiny_vlm

    model = tmp_path / "model"
    other = build_tiny_vlm(tmp_path / "teacher", "qwen2_5_vl", seed=1, initializer_range=0.1)  # same tokenizer
    common = ("eval.at_start=false", "eval.steps=100", "algo.kl.init_coef=0.01", f"actor.pretrain={model}")
    runs = {
        # the KL reference (GRPO's KL loss) and, as teacher, the initial actor adding its distillation advantage
        "kl": _overrides(tmp_path / "kl", "train.max_steps=3", *common, f"teacher.pretrain={model}",
                         "algo.distill_coef=0.5"),
        # on-policy distillation alone, from a teacher of other weights
        "distill": _overrides(tmp_path / "distill", "train.max_steps=2", *common, f"teacher.pretrain={other}",
                              "algo.advantage_estimator=distill"),
    }
    results = run_each_on_ranks(_frozen_scores, 2, {name: (overrides,) for name, overrides in runs.items()})
    for name, per_rank in results.items():
        out = per_rank[0]
        mask = out["mask"]
        assert out["image_rows"] == mask.shape[0], name  # every row of the colour task holds an image
        # step 0: the reference is the actor's initial weights, and sees the same images
        torch.testing.assert_close(out["ref"][mask], out["actor"][mask], atol=1e-5, rtol=0)
        # the frozen forwards read the pixels: zeroing them moves the log-probs
        assert (out["ref_zeroed"][mask] - out["ref"][mask]).abs().max() > 1e-3, name
        assert (out["teacher_zeroed"][mask] - out["teacher"][mask]).abs().max() > 1e-3, name
        rows = [r for r in read_metrics(tmp_path / name / "run") if "policy_loss" in r]
        assert rows and all(math.isfinite(r["actor_grad_norm"]) and abs(r["is/rollout_kl_k3"]) < 1e-6 for r in rows)
        assert "distill/teacher_logprob" in rows[0] and rows[0]["kl"] == pytest.approx(0.0, abs=1e-6), rows[0]
    kl, distill = results["kl"][0], results["distill"][0]
    torch.testing.assert_close(kl["teacher"][kl["mask"]], kl["actor"][kl["mask"]], atol=1e-5, rtol=0)
    assert (distill["teacher"] - distill["actor"])[distill["mask"]].abs().max() > 1e-2
    # the teacher's per-token scores alone move the student from the first step
    assert read_metrics(tmp_path / "distill" / "run")[0]["actor_grad_norm"] > 0
