"""Exports of mixture-of-experts models carry the per-expert checkpoint names (what save_pretrained writes), not
transformers' fused live parameter names; dense models pass through untouched."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hpc_rlhf.models.checkpoint_names import has_weight_conversions, to_checkpoint_names
from hpc_rlhf.models.tiny import build_tiny_model, build_tiny_moe_model


def test_fused_experts_become_per_expert_tensors(tmp_path):
    path = build_tiny_moe_model(tmp_path / "moe", "qwen3_moe", num_experts=4)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    live = dict(model.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in live and has_weight_conversions(model)
    converted = dict(to_checkpoint_names(model, live.items()))
    fused = live["model.layers.0.mlp.experts.gate_up_proj"]  # (E, 2I, H): gate rows then up rows
    half = fused.shape[1] // 2
    assert torch.equal(converted["model.layers.0.mlp.experts.2.gate_proj.weight"], fused[2, :half])
    assert torch.equal(converted["model.layers.0.mlp.experts.2.up_proj.weight"], fused[2, half:])
    assert torch.equal(converted["model.layers.1.mlp.experts.3.down_proj.weight"],
                       live["model.layers.1.mlp.experts.down_proj"][3])
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in converted)
    # Each split tensor owns its storage (safetensors refuses views of one buffer).
    assert converted["model.layers.0.mlp.experts.2.gate_proj.weight"].data_ptr() != fused.data_ptr()
    # What save_pretrained writes: the same names.
    model.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as saved:
        assert set(saved.keys()) == set(converted) - {"lm_head.weight"}


def test_dense_models_pass_through(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "dense"), dtype=torch.float32)
    items = list(model.state_dict().items())
    out = list(to_checkpoint_names(model, items))
    assert [n for n, _ in out] == [n for n, _ in items] and all(a is b for (_, a), (_, b) in zip(out, items))
