"""``plan`` for vision-language models: the vision tower's parameters (hand counts, and the real tiny models),
tokens and activations per image at data.max_pixels (hand numbers, and what autograd saves), the plan lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_rlhf.cli.plan import plan
from hpc_rlhf.planning.model_shape import ModelShape, count_params_from_hf_config
from hpc_rlhf.planning.vision_memory import (
    VisionShape,
    vision_lines,
    vllm_encoder_cache_bytes,
    vllm_encoder_cache_tokens,
    vllm_multimodal_lines,
)

ROOT = Path(__file__).resolve().parents[2]


def _config(family: str) -> dict:
    """The tiny models' config.json (hpc_rlhf.models.tiny_vlm): vision h=64, i=128, depth 2, merge 2, out 128."""
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "out_hidden_size": 128, "in_channels": 3,
              "spatial_merge_size": 2, "temporal_patch_size": 2}
    if family == "qwen2_5_vl":
        vision["patch_size"] = 14
    else:
        vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0])
    text = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "vocab_size": 87, "head_dim": 64, "tie_word_embeddings": True}
    return {"model_type": family, "image_token_id": 3, "vision_config": vision, "text_config": text}


def test_vision_params_by_hand():
    # Qwen2.5-VL: patch 3*2*14*14*64 = 75264 (no bias); block: norms 2*64 + qkv 64*192+192 + proj 64*64+64
    # + gate/up 2*(64*128+128) + down 128*64+64 = 41664, x2 = 83328; merger: ln_q 64 + 256*256+256 + 256*128+128
    # = 98752. Total 257344.
    assert VisionShape.from_hf_config(_config("qwen2_5_vl")).num_params == 75264 + 83328 + 98752 == 257344
    # Qwen3-VL: patch 3*2*16*16*64+64 = 98368; pos 64*64 = 4096; block: LayerNorms 4*64 + qkv 12480 + proj 4160
    # + fc1 64*128+128 + fc2 128*64+64 = 33472, x2 = 66944; merger: LayerNorm 2*64 + 65792 + 32896 = 98816;
    # deepstack merger: LayerNorm 2*256 + 65792 + 32896 = 99200. Total 367424.
    shape = VisionShape.from_hf_config(_config("qwen3_vl"))
    assert shape.num_params == 98368 + 4096 + 66944 + 98816 + 99200 == 367424
    assert shape.merger_params == 98816 + 99200
    # the role's size counts the language model and the tower
    text = ModelShape.from_hf_config(_config("qwen3_vl")).num_params
    assert count_params_from_hf_config(_config("qwen3_vl")) == text + 367424
    assert VisionShape.from_hf_config({"hidden_size": 8}) is None


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_vision_params_match_the_built_models(family, tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    from hpc_rlhf.models.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / family, family)
    config = json.loads((path / "config.json").read_text())
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    assert VisionShape.from_hf_config(config).num_params == sum(p.numel() for p in model.model.visual.parameters())
    assert count_params_from_hf_config(config) == sum(p.numel() for p in model.parameters())


def test_tokens_and_activations_per_image_by_hand():
    shape = VisionShape.from_hf_config(_config("qwen2_5_vl"))
    # 56x56 = 3136 pixels: 16 patches of 14x14, merged 2x2 into 4 tokens; 1280 x 784 = 1003520: 5120 patches
    assert (shape.patches_per_image(3136), shape.tokens_per_image(3136)) == (16, 4)
    assert (shape.patches_per_image(1003520), shape.tokens_per_image(1003520)) == (5120, 1280)
    assert shape.pixel_bytes_per_image(3136) == 4 * 16 * 1176
    # 16 patches: input 16*1176 + 2 blocks * 16 * (12*64 + 4*128) + merger 4 tokens * 2 * 256 = 61824 values
    assert shape.activation_bytes_per_image(3136, 2) == 2 * (16 * 1176 + 2 * 16 * 1280 + 4 * 2 * 256) == 2 * 61824


@pytest.mark.parametrize("family,side", [("qwen2_5_vl", 448), ("qwen3_vl", 512)])
def test_activation_estimate_is_what_autograd_saves(family, side, tmp_path):
    """The estimate against the bytes of the tensors the vision tower's forward saves for its backward (1024
    patches, fp32, SDPA), parameters excluded: within 15%."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from hpc_rlhf.models.tiny_vlm import build_tiny_vlm

    path = build_tiny_vlm(tmp_path / family, family)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    pixels = side * side
    out = AutoImageProcessor.from_pretrained(path)(images=[Image.new("RGB", (side, side), (200, 10, 10))],
                                                   size={"shortest_edge": pixels, "longest_edge": pixels},
                                                   return_tensors="pt")
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[tuple, int] = {}

    def keep(t):
        if t.data_ptr() not in params:
            saved[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
    shape = VisionShape.from_hf_config(json.loads((path / "config.json").read_text()))
    assert out["pixel_values"].shape[0] == shape.patches_per_image(pixels) == 1024
    estimate = shape.activation_bytes_per_image(pixels, 4)
    assert abs(estimate / sum(saved.values()) - 1) < 0.15, (estimate, sum(saved.values()))


def test_lines_and_frozen_tower():
    lines = vision_lines(_config("qwen2_5_vl"), 3136, 8, 2, frozen=True, role="actor")
    assert "0.26M params" in lines[0] and "frozen except the projector (0.10M params)" in lines[0]
    assert "<= 16 patches -> 4 tokens" in lines[1]
    assert vision_lines({"hidden_size": 8}, 3136, 8, 2, frozen=False, role="actor") == []
    assert "set data.max_pixels" in vision_lines(_config("qwen3_vl"), None, 8, 2, False, "model")[1]


def test_vllm_encoder_cache_by_hand():
    qwen25 = VisionShape.from_hf_config(_config("qwen2_5_vl"))
    assert qwen25 is not None
    # max(max_num_batched_tokens, one image's tokens): 1003520 px / 28^2 = 1280 tokens < 16384
    assert vllm_encoder_cache_tokens(qwen25, 1003520, 16384) == 16384
    # an image of 20000 tokens (28^2 * 20000 px) needs the cache to hold it whole
    assert vllm_encoder_cache_tokens(qwen25, 784 * 20000, 16384) == 20000
    # each token: out_hidden_size 128 values, bf16: 16384 * 128 * 2 bytes
    assert vllm_encoder_cache_bytes(qwen25, 1003520, 16384, 2) == 16384 * 128 * 2
    # Qwen3-VL: one deepstack level is concatenated to each token: 2 x 128 values
    qwen3 = VisionShape.from_hf_config(_config("qwen3_vl"))
    assert qwen3 is not None and vllm_encoder_cache_bytes(qwen3, 1003520, 8192, 2) == 8192 * 256 * 2
    # Qwen2.5-VL-7B's widths (out_hidden_size 3584): 16384 * 3584 * 2 bytes = 0.11 GiB on an H100, 56 MiB at 8192
    big = dict(_config("qwen2_5_vl"), vision_config=dict(_config("qwen2_5_vl")["vision_config"], out_hidden_size=3584))
    lines = vllm_multimodal_lines(big, 1003520, 2)
    assert "GPU only" in lines[0]
    assert "16384 image tokens, ~0.11 GiB on H100 / H200" in lines[1] and "~56.00 MiB at 8192" in lines[1], lines
    assert "estimate" in lines[1] and "4 GiB of host memory" in lines[1]
    assert "set data.max_pixels" in vllm_multimodal_lines(big, None, 2)[1]
    assert vllm_multimodal_lines({"hidden_size": 8}, 1003520, 2) == []


def test_plan_prints_the_vision_tower_and_vllms_caveat(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = plan(["--config", str(ROOT / "configs" / "grpo_vlm_tiny_cpu.yaml"), "--nodes", "1", "--gpus-per-node",
                 "2", "rollout.backend=vllm", "data.max_pixels=1003520"])
    out = capsys.readouterr().out
    assert code == 0
    assert "actor vision tower (qwen2_5_vl): 0.26M params" in out
    assert "per image at data.max_pixels=1003520: <= 5120 patches -> 1280 tokens" in out
    assert "vLLM with images: GPU only" in out and "hypothesis" in out
    assert "vLLM multimodal encoder cache (estimate, GPU only, unmeasured): 16384 image tokens" in out
    code = plan(["--config", str(ROOT / "configs" / "sft_vlm_tiny_cpu.yaml"), "--nodes", "1", "--gpus-per-node", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "model vision tower (qwen2_5_vl)" in out and "vLLM" not in out


def test_plan_stays_torch_free():
    code = "import sys, hpc_rlhf.cli.plan, hpc_rlhf.planning.vision_memory; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout.strip() == "False"
