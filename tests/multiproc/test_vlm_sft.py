"""SFT with images then GRPO, on a tiny Qwen2.5-VL and 2 gloo ranks (``configs/sft_vlm_tiny_cpu.yaml`` then
``configs/grpo_vlm_tiny_cpu.yaml`` from its export, shortened): the SFT loss falls, the export loads with
AutoModelForImageTextToText and its image processor, GRPO starts from it with held-out accuracy above the random
model's, and the RL exports (final and ckpt.save_hf) carry the processor too."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _sft_then_grpo(rank, world_size, sft_overrides, grpo_overrides):
    """Both stages in one spawn (starting the ranks costs more than 4 steps of either)."""
    _sft(rank, world_size, sft_overrides)
    _grpo(rank, world_size, grpo_overrides)


def _sft(rank, world_size, overrides):
    import torch.distributed as dist

    from hpc_rlhf.config.supervised import load_supervised_config
    from hpc_rlhf.data.synthetic_preference import prepare_supervised_assets
    from hpc_rlhf.trainers.offline.sft import SFTTrainer

    cfg = load_supervised_config("sft", ROOT / "configs" / "sft_vlm_tiny_cpu.yaml", overrides)
    if rank == 0:
        prepare_supervised_assets(cfg)
    dist.barrier()
    SFTTrainer(cfg).fit()


def _grpo(rank, world_size, overrides):
    import torch.distributed as dist

    from hpc_rlhf.cli.startup import prepare_local_assets
    from hpc_rlhf.config.loader import load_config
    from hpc_rlhf.trainers.rl.async_loop import trainer_class
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(str(ROOT / "configs" / "grpo_vlm_tiny_cpu.yaml"), overrides)
    if rank == 0:
        prepare_local_assets(cfg)
    dist.barrier()
    trainer_class(cfg)(cfg, build_world_groups(build_placement(cfg, world_size))).fit()


def _loads_with_processor(folder: Path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    assert (folder / "processor_config.json").is_file()
    assert type(AutoModelForImageTextToText.from_pretrained(folder)).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(folder).merge_size == 2


def test_sft_then_grpo_with_images(tmp_path):
    sft, grpo = tmp_path / "sft", tmp_path / "grpo"
    run_on_ranks(_sft_then_grpo, 2, [
        f"model.pretrain={tmp_path / 'model'}", f"train.output_dir={sft}",
        f"data.train_data=[{tmp_path / 'data' / 'sft.jsonl'}]", f"data.eval_data=[{tmp_path / 'data' / 'sft_eval.jsonl'}]",
        "data.synthetic_num_samples=128", "data.synthetic_eval_samples=32"], [
        f"actor.pretrain={sft / 'model'}", "actor.build_tiny=false", f"train.output_dir={grpo}",
        f"data.prompt_data=[{tmp_path / 'data' / 'train.jsonl'}]", f"eval.data=[{tmp_path / 'data' / 'heldout.jsonl'}]",
        f"reward.reward_func_path={ROOT / 'examples' / 'reward_funcs' / 'colour.py'}", "logger.use_tensorboard=false",
        "data.synthetic_num_samples=64", "eval.max_samples=32", "train.max_steps=2", "eval.steps=2",
        "ckpt.save_hf=true", "ckpt.save_steps=2"])
    evals = [r["eval_loss"] for r in read_metrics(sft) if "eval_loss" in r]
    assert evals[-1] < 0.5 * evals[0], evals
    _loads_with_processor(sft / "model")
    heldout = [r["eval/heldout/pass@1"] for r in read_metrics(grpo) if "eval/heldout/pass@1" in r]
    # the random tiny model answers no image right (0.000, docs/vlm.md); after 4 SFT steps most are right
    assert heldout[0] >= 0.5, heldout
    _loads_with_processor(grpo / "model")
    _loads_with_processor(grpo / "hf" / "step_2")


def _pairs(path: Path, num: int, seed: int) -> None:
    """Preference rows of the colour task: the right initial is chosen, another colour's rejected."""
    import json
    import random

    from hpc_rlhf.data.synthetic_images import colour_task_rows

    rng = random.Random(seed)
    rows = colour_task_rows(path, num, seed)
    path.write_text("".join(json.dumps({"prompt": r["messages"], "images": r["images"], "chosen": r["label"],
                                        "rejected": rng.choice([c for c in "rgby" if c != r["label"]])}) + "\n"
                            for r in rows))


def _dpo(rank, world_size, overrides, data_dir):
    import torch.distributed as dist

    from hpc_rlhf.config.supervised import load_supervised_config
    from hpc_rlhf.models.tiny import build_tiny_for
    from hpc_rlhf.trainers.offline.dpo import DPOTrainer

    cfg = load_supervised_config("dpo", ROOT / "configs" / "dpo_tiny_cpu.yaml", overrides)
    if rank == 0:
        build_tiny_for(cfg.model.pretrain, "qwen2_5_vl", seed=42)
        _pairs(data_dir / "pref.jsonl", 128, 0)
        _pairs(data_dir / "pref_eval.jsonl", 32, 1)
    dist.barrier()
    DPOTrainer(cfg).fit()


def test_dpo_with_images_prefers_the_right_colour(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    run_on_ranks(_dpo, 2, [
        f"model.pretrain={tmp_path / 'model'}", "model.build_tiny=false", f"train.output_dir={tmp_path / 'dpo'}",
        f"data.train_data=[{data / 'pref.jsonl'}]", f"data.eval_data=[{data / 'pref_eval.jsonl'}]",
        "data.synthetic_task=null", "data.apply_chat_template=true", "data.max_len=48", "data.max_pixels=3136",
        "data.min_pixels=3136", "train.max_steps=4", "train.eval_steps=4", "model.learning_rate=5e-4"], data)
    evals = [r["eval_reward_accuracy"] for r in read_metrics(tmp_path / "dpo") if "eval_reward_accuracy" in r]
    # the prompt text is the same in every row: only the image tells the chosen answer from the rejected one
    assert evals[0] == 0.0 and evals[-1] >= 0.8, evals
    _loads_with_processor(tmp_path / "dpo" / "model")
