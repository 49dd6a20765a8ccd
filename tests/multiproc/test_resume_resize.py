"""Resume on a different allocation: a checkpoint saved by one layout (number of ranks, ZeRO stage, AutoTP size)
loads into another through DeepSpeed's universal checkpoint, and training continues as if it had not moved.

RL: sampling seeds are per rollout engine, so a run on another number of engines samples other tokens after the
resume and its losses cannot be compared step by step. What must carry over is the trained state (weights, Adam
moments, optimizer step count, LR schedule): the test trains one update on the same fixed batch after loading the
checkpoint natively on the old layout and through the universal checkpoint on the new one, and compares the
updated weights and the update's statistics. A lost or mis-sliced Adam moment changes the update. SFT has no
sampling (the global batch is split over the ranks in order), so there the resumed run's losses are compared with
an uninterrupted run on the new number of ranks.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks, signal_after

pytestmark = pytest.mark.slow
# fp32; the same update summed in another order over another number of ranks
WEIGHT_TOL = 1e-5
STAT_REL = 1e-4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _overrides(assets, out, *extra):
    # 48 samples per step: whole micro-batches of 4 on 2, 3 or 4 data-parallel ranks.
    return grpo_overrides(assets, out, "rollout.rollout_batch_size=6", "train.train_batch_size=48",
                          "train.micro_train_batch_size=4", "train.max_steps=2", "ckpt.save_steps=2", *extra)


def _fixed_batch(trainer):
    """48 rows of the run's prompts with fixed responses and advantages (rank 0): the same update input on every
    layout."""
    from hpc_rlhf.trainers.rl.step_batch import StepBatch

    gen = torch.Generator().manual_seed(0)
    rows, prompt_len, resp_len = 48, 6, 4
    vocab = trainer.tokenizer.vocab_size
    sequences = torch.randint(4, vocab, (rows, prompt_len + resp_len), generator=gen)
    return StepBatch(sequences=sequences, attention_mask=torch.ones_like(sequences),
                     action_mask=torch.ones(rows, resp_len, dtype=torch.bool),
                     rollout_logprobs=torch.zeros(rows, resp_len), episode_index=torch.arange(rows),
                     rewards=torch.zeros(rows), advantages=torch.randn(rows, resp_len, generator=gen))


def _train_fixed_batch(trainer, export_dir):
    stats = trainer.train(_fixed_batch(trainer) if trainer.rank == 0 else None)
    trainer.roles.actor.save_hf(str(export_dir))
    return stats


def _save_then_update(rank, world_size, overrides, export_dir):
    """The source run: 2 RL steps, checkpoint at step 2; then (the reference) one update on the fixed batch."""
    trainer = run_trainer(rank, world_size, overrides)
    trainer.fit()
    return _train_fixed_batch(trainer, export_dir)


def _resume_then_update(rank, world_size, overrides, export_dir):
    trainer = run_trainer(rank, world_size, [*overrides, "ckpt.load=true"])
    assert trainer.resume() == 2
    return _train_fixed_batch(trainer, export_dir)


def _compare(reference, resumed, ref_dir, new_dir, before_dir):
    for key in ("policy_loss", "actor_grad_norm", "actor_lr"):
        assert resumed[key] == pytest.approx(reference[key], rel=STAT_REL), key
    want, got, before = (load_file(str(d / "model.safetensors")) for d in (ref_dir, new_dir, before_dir))
    assert want.keys() == got.keys()
    moved = max(float((want[k] - before[k]).abs().max()) for k in want)
    assert moved > 100 * WEIGHT_TOL  # the update is large enough for a wrong one to show
    for name in want:
        assert torch.allclose(got[name], want[name], atol=WEIGHT_TOL, rtol=0), name


# Each resharding path once. The universal checkpoint merges the N saved shards into whole tensors (whatever the
# new size) and slices them for the new data-parallel size (whatever the old one), so growing and shrinking need
# not be crossed with every stage: ZeRO-3 grows onto 3 ranks (odd partitions, padded per parameter), ZeRO-2
# shrinks from 4 shards, ZeRO-2 grows onto 3 ranks with LoRA (its flat partition holds only the adapters),
# ZeRO-1 with AutoTP shrinks from 4 ranks below (test_autotp_checkpoint_resumes_without_tensor_parallelism).
@pytest.mark.parametrize(("stage", "old", "new", "extra"), [
    (2, 4, 2, ()), (3, 2, 3, ()),
    (2, 2, 3, ("ds.lora.rank=4", "ds.lora.alpha=8")),  # LoRA: only the adapters and their moments are saved
    (0, 2, 3, ()),  # no ZeRO: whole states, loaded as saved on any number of ranks
], ids=["zero2-4to2", "zero3-2to3", "lora-zero2-2to3", "zero0-2to3"])
def test_rl_checkpoint_resumes_on_another_number_of_ranks(assets, tmp_path, stage, old, new, extra):
    source = tmp_path / "source"
    overrides = _overrides(assets, source, "ckpt.save_hf=true", f"ds.zero_stage={stage}", *extra)
    reference = run_on_ranks(_save_then_update, old, overrides, tmp_path / "reference")[0]
    resumed = run_on_ranks(_resume_then_update, new, overrides, tmp_path / "resumed")[0]
    _compare(reference, resumed, tmp_path / "reference", tmp_path / "resumed", source / "hf" / "step_2")
    layout = json.loads((source / "ckpt" / "step_2" / "layout.json").read_text())
    assert layout["world_size"] == old and layout["roles"]["actor"]["dp"] == old
    resharded = (source / "ckpt" / "universal" / "step_2" / "actor" / "ds" / "zero").is_dir()
    assert resharded == (stage != 0)


def test_autotp_checkpoint_resumes_without_tensor_parallelism(assets, tmp_path):
    """4 ranks as 2 AutoTP pairs (dp 2, tp 2) -> 2 ranks without tensor parallelism (dp 2)."""
    source = tmp_path / "source"
    overrides = _overrides(assets, source, "ckpt.save_hf=true", "ds.zero_stage=1")
    reference = run_on_ranks(_save_then_update, 4, [*overrides, "ds.tensor_parallel_size=2"], tmp_path / "reference")[0]
    resumed = run_on_ranks(_resume_then_update, 2, overrides, tmp_path / "resumed")[0]
    _compare(reference, resumed, tmp_path / "reference", tmp_path / "resumed", source / "hf" / "step_2")
    saved = json.loads((source / "ckpt" / "step_2" / "layout.json").read_text())["roles"]["actor"]
    assert (saved["tp"], saved["dp"]) == (2, 2)


# ---------------------------------------------------------------------------- SFT


def _sft(rank, world_size, overrides, stop_after=None):
    """The SFT trainer of configs/sft_tiny_cpu.yaml; behaves as if SLURM signalled after ``stop_after`` steps."""
    from tests.multiproc.test_supervised_trainers import _build

    signal_after(stop_after)
    _build("sft", overrides).fit()


@pytest.mark.parametrize(("old", "new"), [(2, 3)])
def test_sft_resumed_on_another_number_of_ranks_continues_the_uninterrupted_losses(tmp_path, old, new):
    common = [f"model.pretrain={tmp_path / 'tiny-model'}", "model.build_tiny=true",
              f"data.train_data=[{tmp_path / 'sft_train.jsonl'}]", f"data.eval_data=[{tmp_path / 'sft_eval.jsonl'}]",
              "train.train_batch_size=24", "train.micro_train_batch_size=4", "train.max_steps=4",
              "ckpt.save_steps=2", "train.eval_steps=100", "train.packing_samples=false",
              "logger.use_tensorboard=false"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    run_on_ranks(_sft, new, [*common, f"train.output_dir={whole}"])
    run_on_ranks(_sft, old, [*common, f"train.output_dir={cut}"], 2)
    assert [r["step"] for r in read_metrics(cut) if "loss" in r] == [1, 2]
    run_on_ranks(_sft, new, [*common, f"train.output_dir={cut}", "ckpt.load=true"])
    want = {r["step"]: r for r in read_metrics(whole) if "loss" in r}
    got = {r["step"]: r for r in read_metrics(cut) if "loss" in r}
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=STAT_REL), step
        assert got[step]["lr"] == pytest.approx(want[step]["lr"], rel=STAT_REL), step
