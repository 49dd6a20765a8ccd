"""ckpt.save_hf + ckpt.best_metric on 2 gloo ranks: an HF export per checkpoint, hf/BEST at the best step (kept by
rotation), exports that load with from_pretrained; `hpc-rlhf export` rebuilds the last checkpoint's actor."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.cli.main import main as cli_main
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytestmark = pytest.mark.slow


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def _weights(path):
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_hf_exports_best_pointer_and_export_cli(tmp_path):
    assets = make_assets(tmp_path / "assets")
    out = tmp_path / "run"
    run_on_ranks(_fit, 2, grpo_overrides(
        assets, out, "train.max_steps=4", "ckpt.save_steps=1", "ckpt.max_num=1", "ckpt.save_hf=true",
        "ckpt.best_metric=reward"))
    rewards = {r["step"]: r["reward"] for r in read_metrics(out)}
    best_step = max(rewards, key=lambda s: (rewards[s], -s))  # the first step reaching the maximum
    best = json.loads((out / "hf" / "BEST").read_text())
    assert best == {"step": best_step, "path": f"step_{best_step}", "metric": "reward", "value": rewards[best_step]}
    assert {p.name for p in (out / "hf").iterdir()} == {"BEST", f"step_{best_step}", "step_4"}
    AutoModelForCausalLM.from_pretrained(out / "hf" / f"step_{best_step}")
    last = _weights(out / "hf" / "step_4")
    final = _weights(out / "model")
    assert all(torch.equal(last[k], final[k]) for k in final)

    cli_main(["export", "--ckpt", str(out / "ckpt"), "--output", str(tmp_path / "exported")])
    exported = _weights(tmp_path / "exported")
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final), "export differs from the run's own export"
    assert (tmp_path / "exported" / "tokenizer_config.json").is_file()


def test_export_cli_merges_lora(tmp_path):
    assets = make_assets(tmp_path / "assets")
    out = tmp_path / "run"
    run_on_ranks(_fit, 2, grpo_overrides(assets, out, "train.max_steps=1", "ckpt.save_steps=1", "ds.lora.rank=4",
                                         "actor.learning_rate=5e-2"))
    cli_main(["export", "--ckpt", str(out / "ckpt" / "step_1"), "--output", str(tmp_path / "exported")])
    exported, final = _weights(tmp_path / "exported"), _weights(out / "model")
    assert exported.keys() == final.keys()
    assert all(torch.allclose(exported[k], final[k], atol=1e-6) for k in final)
    assert not all(torch.equal(exported[k], v) for k, v in _weights(assets["model"]).items()), "adapter not merged"
    assert (tmp_path / "exported" / "adapter" / "adapter_config.json").is_file()
