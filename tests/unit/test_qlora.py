"""QLoRA (``ds.lora.load_in_4bit``): 4-bit base weights on CPU through bitsandbytes' torch backend.

What matters for RL is that the plain weights leaving the process (sync to the rollout engine, HF export)
make a plain model compute exactly what the quantised LoRA model computes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytest.importorskip("peft")

from hpc_rlhf.config.schema import DeepSpeedConfig, LoraConfig  # noqa: E402
from hpc_rlhf.models import quantization  # noqa: E402
from hpc_rlhf.models.loading import load_causal_lm, load_value_model  # noqa: E402
from hpc_rlhf.models.lora import apply_lora, merged_named_tensors  # noqa: E402
from hpc_rlhf.models.tiny import build_tiny_model  # noqa: E402

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                               reason="bitsandbytes is not installed (pip install bitsandbytes)")
QLORA = LoraConfig(rank=4, alpha=8, load_in_4bit=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("qlora") / "tiny", seed=0))


def _randomize_lora(model: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _plain_with(path: str, state: dict[str, torch.Tensor], value: bool = False) -> torch.nn.Module:
    model = (load_value_model if value else load_causal_lm)(path, torch.float32)
    model.load_state_dict(state, strict=True)
    return model.eval()


@needs_bnb
def test_causal_qlora_merged_weights_reproduce_the_quantised_model(tiny_path):
    model = apply_lora(load_causal_lm(tiny_path, torch.float32, load_in_4bit=True), QLORA)
    assert model.is_loaded_in_4bit
    assert any(quantization.is_quantized(p) for p in model.parameters())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    _randomize_lora(model)

    merged = dict(merged_named_tensors(model))
    plain = load_causal_lm(tiny_path, torch.float32)
    assert set(merged) == set(plain.state_dict())
    assert all(merged[k].shape == v.shape and merged[k].dtype == torch.float32 for k, v in plain.state_dict().items())
    # NF4 is lossy: the merged weight is the dequantised one plus the LoRA delta, not the checkpoint's.
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(merged[q], plain.state_dict()[q])

    ids = torch.randint(4, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        got = _plain_with(tiny_path, merged)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_bnb
def test_value_qlora_keeps_full_precision_score_head(tiny_path):
    model = apply_lora(load_value_model(tiny_path, torch.float32, load_in_4bit=True), QLORA)
    assert not quantization.is_quantized(model.score.modules_to_save["default"].weight)
    assert any(n.startswith("score.") for n, p in model.named_parameters() if p.requires_grad)
    _randomize_lora(model)
    merged = dict(merged_named_tensors(model))
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        got = _plain_with(tiny_path, merged, value=True)(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_bnb
def test_plain_config_drops_quantization(tiny_path):
    model = load_causal_lm(tiny_path, torch.float32, load_in_4bit=True)
    assert "quantization_config" in model.config.to_dict()
    assert "quantization_config" not in quantization.plain_config(model.config).to_dict()
    assert "quantization_config" in model.config.to_dict()  # the model's own config is untouched


def test_lora_4bit_on_an_unquantised_model_is_refused(tiny_path):
    with pytest.raises(ValueError, match="not loaded in 4 bit"):
        apply_lora(load_causal_lm(tiny_path, torch.float32), QLORA)


def test_missing_bitsandbytes_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(RuntimeError, match="pip install bitsandbytes"):
        quantization.bnb_4bit_load_kwargs(torch.float32, on_gpu=False)


@pytest.mark.parametrize("ds, key", [
    ({"lora": {"load_in_4bit": True}}, "rank > 0"),
    ({"zero_stage": 3, "lora": {"rank": 4, "load_in_4bit": True}}, "zero_stage=3"),
    ({"zero_stage": 2, "tensor_parallel_size": 2, "lora": {"rank": 4, "load_in_4bit": True}}, "tensor_parallel"),
])
def test_qlora_layouts_that_cannot_work_are_refused(ds, key):
    with pytest.raises(ValueError, match=key):
        DeepSpeedConfig(**ds)


@needs_bnb
def test_lora_merge_cli_reproduces_a_qlora_policy_with_load_in_4bit(tiny_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from hpc_rlhf.cli.lora_merge import main
    from hpc_rlhf.models.lora import save_adapter

    model = apply_lora(load_causal_lm(tiny_path, torch.float32, load_in_4bit=True), QLORA)
    _randomize_lora(model)
    save_adapter(model, str(tmp_path / "adapter"))
    ids = torch.randint(4, 60, (2, 10), generator=torch.Generator().manual_seed(2))
    logits = {}
    for name, flags in (("dequantised", ["--load_in_4bit"]), ("full", [])):
        out = tmp_path / name
        main(["--base", tiny_path, "--adapter", str(tmp_path / "adapter"), "--output", str(out), *flags])
        with torch.no_grad():
            logits[name] = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(input_ids=ids).logits
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
    torch.testing.assert_close(logits["dequantised"], expected, rtol=1e-4, atol=1e-4)
    # merged into the full-precision base instead: close, not the trained policy
    assert (logits["full"] - expected).abs().max() > 1e-3


@needs_bnb
def test_gather_buckets_size_4bit_weights_as_dequantised(tiny_path):
    from hpc_rlhf.weight_sync import state_gather

    model = load_causal_lm(tiny_path, torch.float32, load_in_4bit=True)
    weight = model.model.layers[0].mlp.up_proj.weight  # (128, 64) packed into 4096 bytes
    assert quantization.is_quantized(weight) and weight.numel() * weight.element_size() == 128 * 64 // 2
    assert state_gather._numel_bytes(weight) == 128 * 64 * 4  # what plain_copy hands to the bucket
    plain = quantization.plain_copy(weight)
    assert plain.numel() * plain.element_size() == state_gather._numel_bytes(weight)


@needs_bnb
def test_a_4bit_moe_model_says_which_weights_stay_unquantised(tiny_path, tmp_path, caplog):
    """bitsandbytes quantises nn.Linear weights only: an MoE model's fused experts and router stay in the compute
    dtype, and loading says so (a dense model: nothing to say)."""
    import logging

    from hpc_rlhf.models.tiny import build_tiny_moe_model

    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.models.quantization"):
        load_causal_lm(tiny_path, torch.float32, load_in_4bit=True)
    assert "stay in" not in caplog.text
    moe = build_tiny_moe_model(tmp_path / "moe", family="qwen3_moe")
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.models.quantization"):
        model = load_causal_lm(str(moe), torch.float32, load_in_4bit=True)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp." in n)  # experts and router
    assert f"{experts} parameters" in caplog.text and "stay in torch.float32" in caplog.text
    assert quantization.warn_unquantized_weights(model) == experts
