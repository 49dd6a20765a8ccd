"""LoRA and QLoRA through the real trainers on 2 gloo ranks (ZeRO-2, CPU fp32): GRPO with weight sync to the
rollout engine, and SFT / DPO / RM / KTO exports.

What a user relies on: with ``ds.lora.rank > 0`` only adapters train, the rollout engine generates with the
*merged* policy (for QLoRA: the dequantised 4-bit base plus the adapter, exactly what was trained), and every
export is a plain HF folder plus ``adapter/``.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import grpo_overrides, make_assets, run_trainer
from tests.multiproc.spawn import run_each_on_ranks
from tests.multiproc.test_supervised_trainers import _fit as _fit_supervised
from tests.multiproc.test_supervised_trainers import _overrides as _supervised_overrides

pytestmark = pytest.mark.slow
pytest.importorskip("peft")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="QLoRA needs bitsandbytes (pip install bitsandbytes)")
LORA = ["ds.lora.rank=8", "ds.lora.alpha=16"]
QLORA = [*LORA, "ds.lora.load_in_4bit=true"]
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
ADAPTERS = {"lora": LORA, **({"qlora": QLORA} if HAS_BNB else {})}
VARIANTS = [pytest.param("lora"), pytest.param("qlora", marks=needs_bnb)]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _grpo_and_compare_rollout(rank, world_size, overrides):
    trainer = run_trainer(rank, world_size, overrides)
    trainer.fit()
    merged = {n: t for b in trainer.roles.actor.gathered_state_dict_items() for n, t in b}
    out = {"trainable": sorted(n for n, p in trainer.roles.actor.module.named_parameters() if p.requires_grad)}
    if trainer.roles.rollout is not None:
        rollout_sd = trainer.roles.rollout.engine.model.state_dict()
        out["max_sync_diff"] = max(float((rollout_sd[n] - t).abs().max()) for n, t in merged.items())
        out["synced_names"] = sorted(merged)
    return out


@pytest.fixture(scope="module")
def grpo_runs(assets, tmp_path_factory):
    """GRPO with every ADAPTERS kind, in one spawn; ``{kind: (output folder, per-rank results)}``."""
    base = tmp_path_factory.mktemp("grpo")
    runs = run_each_on_ranks(_grpo_and_compare_rollout, 2, {
        kind: (grpo_overrides(assets, base / kind, "train.max_steps=3", "actor.learning_rate=2e-2",
                              "algo.kl.init_coef=0.01", "algo.kl.use_loss=true", "ds.lora.sync=merged", *adapter),)
        for kind, adapter in ADAPTERS.items()})
    return {kind: (base / kind, results) for kind, results in runs.items()}


@pytest.mark.parametrize("lora", VARIANTS)
def test_grpo_with_lora_syncs_the_merged_policy(assets, grpo_runs, lora):
    tmp_path, results = grpo_runs[lora]
    r0 = results[0]
    assert r0["trainable"] and all(".lora_A." in n or ".lora_B." in n for n in r0["trainable"])
    # The colocated rollout engine holds exactly the merged weights the actor trained with.
    assert r0["max_sync_diff"] < 1e-6, r0["max_sync_diff"]
    rows = read_metrics(tmp_path)
    assert len(rows) == 3 and all(r["actor_grad_norm"] > 0 for r in rows)
    # QLoRA's reference loads the same 4-bit base: policy == reference before the first update.
    assert rows[0]["kl_loss"] == pytest.approx(0.0, abs=1e-6)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()  # plain HF, no bitsandbytes
    initial = AutoModelForCausalLM.from_pretrained(assets["model"]).state_dict()
    changed = [n for n, t in exported.state_dict().items() if not torch.allclose(t, initial[n])]
    assert any("layers.0.self_attn.q_proj" in n for n in changed), changed[:5]
    assert (tmp_path / "model" / "adapter" / "adapter_config.json").is_file()
    assert "quantization_config" not in json.loads((tmp_path / "model" / "config.json").read_text())


# Each trainer once, LoRA and QLoRA spread over them; the reference of DPO / KTO is 4-bit too.
SUPERVISED = {"sft-lora": ("sft", "lora"), "rm-qlora": ("rm", "qlora"), "dpo-qlora": ("dpo", "qlora"),
              "kto-lora": ("kto", "lora")}


@pytest.fixture(scope="module")
def supervised_runs(tmp_path_factory):
    """Every SUPERVISED run its adapter kind is installed for, in one spawn, each in a folder of its own (model,
    data, output); ``{id: folder}``."""
    base = tmp_path_factory.mktemp("supervised")
    runs = {run_id: (kind, _supervised_overrides(base / run_id, kind, "train.max_steps=4", "train.eval_steps=4",
                                                 *ADAPTERS[adapter]))
            for run_id, (kind, adapter) in SUPERVISED.items() if adapter in ADAPTERS}
    run_each_on_ranks(_fit_supervised, 2, runs)
    return {run_id: base / run_id for run_id in runs}


@pytest.mark.parametrize("run_id", [pytest.param(run_id, marks=needs_bnb) if adapter == "qlora" else run_id
                                    for run_id, (_, adapter) in SUPERVISED.items()])
def test_supervised_trainers_train_adapters_and_export_merged(supervised_runs, run_id):
    kind = SUPERVISED[run_id][0]
    tmp_path = supervised_runs[run_id]
    rows = read_metrics(tmp_path / kind)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    model_dir = tmp_path / kind / "model"
    adapter = load_file(model_dir / "adapter" / "adapter_model.safetensors")
    lora_b = [t for n, t in adapter.items() if "lora_B" in n]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b)  # lora_B starts at 0: the adapters trained
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    auto = AutoModelForSequenceClassification if kind == "rm" else AutoModelForCausalLM
    exported = auto.from_pretrained(model_dir).state_dict()
    initial = auto.from_pretrained(tmp_path / "tiny-model").state_dict()
    changed = {n for n, t in exported.items() if n in initial and not torch.allclose(t, initial[n])}
    assert any("self_attn" in n for n in changed), sorted(changed)[:5]
