"""SFT, reward model, DPO and KTO end to end: 2 gloo ranks, DeepSpeed ZeRO-2, tiny model, seeded arithmetic.

Each test runs the real trainer (the same code path as ``python -m hpc_rlhf.cli.train_*``) from the CPU
recipe with a fresh output directory, then checks behaviour: SFT teaches the pattern, the RM ranks
held-out pairs, DPO widens the chosen-minus-rejected margin, KTO moves rewards apart, resume continues.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _overrides(base: Path, kind: str, *extra: str) -> list[str]:
    data = {"sft": "sft", "rm": "pref", "dpo": "pref", "kto": "kto"}[kind]
    return [f"model.pretrain={base / 'tiny-model'}", f"data.train_data=[{base / f'{data}_train.jsonl'}]",
            f"data.eval_data=[{base / f'{data}_eval.jsonl'}]", f"train.output_dir={base / kind}", *extra]


# The recipe each trainer runs, named in full (docs/recipes.md's "CI on CPU" labels point here).
RECIPES = {"sft": "sft_tiny_cpu.yaml", "rm": "rm_tiny_cpu.yaml", "dpo": "dpo_tiny_cpu.yaml", "kto": "kto_tiny_cpu.yaml"}


def _build(kind: str, overrides: list[str]):
    import importlib

    import torch.distributed as dist

    from hpc_rlhf.config.supervised import load_supervised_config
    from hpc_rlhf.data.synthetic_preference import prepare_supervised_assets

    cfg = load_supervised_config(kind, ROOT / "configs" / RECIPES[kind], overrides)
    if dist.get_rank() == 0:
        prepare_supervised_assets(cfg)
    dist.barrier()
    module, name = {"sft": ("sft", "SFTTrainer"), "rm": ("rm", "RewardModelTrainer"), "dpo": ("dpo", "DPOTrainer"),
                    "kto": ("kto", "KTOTrainer")}[kind]
    return getattr(importlib.import_module(f"hpc_rlhf.trainers.offline.{module}"), name)(cfg)


def _fit(rank, world_size, kind, overrides):
    trainer = _build(kind, overrides)
    start = {"step": trainer.step, "batches_consumed": trainer.stream.batches_consumed}
    trainer.fit()
    return start


def _greedy_accuracy(model_dir: Path, data: Path, limit: int = 64) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = [json.loads(line) for line in data.read_text().splitlines()][:limit]
    prompts = [tok.encode(r["input"], add_special_tokens=False) for r in rows]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = (ids != tok.pad_token_id).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    answers = tok.batch_decode(out[:, width:], skip_special_tokens=True)
    return sum(a.strip() == r["output"] for a, r in zip(answers, rows)) / len(rows)


def _evals(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def test_sft_learns_addition_and_resumes(tmp_path):
    overrides = _overrides(tmp_path, "sft", "ckpt.save_steps=64", "train.eval_steps=64")
    run_on_ranks(_fit, 2, "sft", overrides)
    rows = read_metrics(tmp_path / "sft")
    losses = _evals(rows, "eval_loss")
    assert losses[-1] < 0.3 * losses[0], losses
    before = _greedy_accuracy(tmp_path / "tiny-model", tmp_path / "sft_eval.jsonl")
    after = _greedy_accuracy(tmp_path / "sft" / "model", tmp_path / "sft_eval.jsonl")
    assert after > before + 0.3, (before, after)
    assert (tmp_path / "sft" / "ckpt" / "step_128" / "COMPLETE").is_file()
    assert (tmp_path / "sft" / "config.resolved.yaml").is_file()

    # Resume from the step-64 checkpoint: step and data position come back, the log continues.
    (tmp_path / "sft" / "ckpt" / "LATEST").write_text("step_64\n")
    starts = run_on_ranks(_fit, 2, "sft", [*overrides, "ckpt.load=true"])
    assert starts == [{"step": 64, "batches_consumed": 64}] * 2
    steps = [r["step"] for r in read_metrics(tmp_path / "sft") if "loss" in r]
    assert steps == list(range(1, 129)), steps
    assert _greedy_accuracy(tmp_path / "sft" / "model", tmp_path / "sft_eval.jsonl") > before + 0.3


def test_reward_model_ranks_held_out_pairs_and_exports_stats(tmp_path):
    run_on_ranks(_fit, 2, "rm", _overrides(tmp_path, "rm", "train.max_epochs=2"))
    accuracy = _evals(read_metrics(tmp_path / "rm"), "eval_accuracy")
    assert accuracy[0] < 0.65 and accuracy[-1] > 0.8, accuracy
    model_dir = tmp_path / "rm" / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["reward_std"] > 0 and isinstance(config["reward_mean"], float)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert model.score.weight.shape[0] == 1
    # The exported model itself prefers the correct sum on held-out pairs.
    tok = AutoTokenizer.from_pretrained(model_dir)
    pairs = [json.loads(line) for line in (tmp_path / "pref_eval.jsonl").read_text().splitlines()][:64]

    def score(text: str) -> float:
        ids = torch.tensor([tok.encode(text + tok.eos_token, add_special_tokens=False)])
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, 0])

    wins = sum(score(p["prompt"] + p["chosen"]) > score(p["prompt"] + p["rejected"]) for p in pairs)
    assert wins / len(pairs) > 0.75, wins


def test_dpo_widens_the_margin(tmp_path):
    run_on_ranks(_fit, 2, "dpo", _overrides(tmp_path, "dpo", "train.max_steps=40"))
    rows = read_metrics(tmp_path / "dpo")
    margins = _evals(rows, "eval_reward_margin")
    assert margins[0] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
    assert margins[-1] > 0.15, margins
    assert _evals(rows, "eval_reward_accuracy")[-1] > 0.7
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "dpo" / "model") is not None


def test_kto_moves_rewards_apart(tmp_path):
    run_on_ranks(_fit, 2, "kto", _overrides(tmp_path, "kto", "train.max_steps=40", "model.learning_rate=2e-3"))
    rows = read_metrics(tmp_path / "kto")
    good, bad = _evals(rows, "eval_desirable_reward"), _evals(rows, "eval_undesirable_reward")
    assert good[0] == pytest.approx(0.0, abs=1e-5) and bad[0] == pytest.approx(0.0, abs=1e-5)
    assert good[-1] - bad[-1] > 0.1, (good, bad)
    assert _evals(rows, "eval_reward_accuracy")[-1] > 0.6


def _fit_logging_warnings(rank, world_size, kind, overrides, log_file):
    import logging

    if rank == 0:
        handler = logging.FileHandler(log_file)
        handler.setLevel(logging.WARNING)
        logging.getLogger("hpc_rlhf").addHandler(handler)
    return _fit(rank, world_size, kind, overrides)


def test_offline_resume_skips_damaged_checkpoints(tmp_path):
    """Every rank resumes from the newest checkpoint that verifies, past a LATEST naming a deleted directory, with
    a warning naming each bad file."""
    overrides = _overrides(tmp_path, "sft", "train.max_steps=3", "ckpt.save_steps=1", "train.eval_steps=100",
                           "ckpt.load=true")
    assert run_on_ranks(_fit, 2, "sft", overrides) == [{"step": 0, "batches_consumed": 0}] * 2  # nothing to load
    root = tmp_path / "sft" / "ckpt"
    shard = next((root / "step_3").rglob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    state = root / "step_2" / "trainer_state.json"
    state.write_bytes(b"{" * state.stat().st_size)
    (root / "LATEST").write_text("step_7\n")  # a directory that does not exist
    log_file = tmp_path / "warnings.log"
    starts = run_on_ranks(_fit_logging_warnings, 2, "sft", overrides, str(log_file))
    assert starts == [{"step": 1, "batches_consumed": 1}] * 2
    warnings = log_file.read_text()
    assert str(shard) in warnings and str(state) in warnings, warnings
    assert "LATEST names step_7, which is not a complete checkpoint" in warnings
    assert [r["step"] for r in read_metrics(tmp_path / "sft") if "loss" in r] == [1, 2, 3]
