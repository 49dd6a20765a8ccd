"""Build a tiny vision-language model (Qwen2.5-VL or Qwen3-VL) locally, saved like a real checkpoint.

The folder holds ``config.json``, safetensors weights, the char tokenizer of :mod:`hpc_rlhf.models.tiny` with
Qwen's four vision special tokens added, a chat template that renders OpenAI-style image content parts as
``<|vision_start|><|image_pad|><|vision_end|>``, and the image processor's ``preprocessor_config.json``.

The image processor is saved from transformers' PIL class (``Qwen2VLImageProcessorPil``): transformers picks its
torchvision class only when torchvision is installed, and the CPU environment has none. The composite
``Qwen2_5_VLProcessor`` cannot be built here at all without torchvision (its video-processor slot resolves through
a mapping that is empty then), so ``processor_config.json`` is written by hand: on a machine with torchvision,
``AutoProcessor.from_pretrained`` of this folder gives the model's own processor.

Sizes: the text model has head_dim 64 (hidden 128, 2 heads, 1 KV head), which vLLM's CPU attention supports; the
vision tower has 2 blocks of width 64 (head_dim 32). A 56x56 image is 4x4 patches of 14 (Qwen3-VL: 64x64, patches
of 16), merged 2x2 into 4 image tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import PreTrainedTokenizerFast

from hpc_rlhf.models.tiny_tokenizer import build_char_tokenizer

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
# The char template of the tiny Llama, with content parts: an image part (``{"type": "image"}`` or
# ``{"type": "image_url", ...}``) becomes one placeholder that the processor expands to the image's tokens.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}Q: {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' or p['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% elif m['role'] == 'assistant' %}A: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)
VLM_FAMILIES = ("qwen2_5_vl", "qwen3_vl")
TEXT_SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1}
# pixels of one side of the default tiny image (4x4 patches); min/max pixels of the saved image processor
TINY_IMAGE_SIDE = {"qwen2_5_vl": 56, "qwen3_vl": 64}


def build_vlm_tokenizer() -> PreTrainedTokenizerFast:
    """The char tokenizer plus Qwen's vision special tokens and :data:`VLM_CHAT_TEMPLATE`."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = VLM_CHAT_TEMPLATE
    return tok


def _configs(family: str, tok: PreTrainedTokenizerFast, initializer_range: float,
             max_position_embeddings: int) -> tuple[Any, type]:
    """(config, model class) of the tiny ``family``."""
    # config keywords by name (mypy cannot match a dict's keys to the config classes' keywords)
    ids: dict[str, Any] = {name: tok.convert_tokens_to_ids(t) for name, t in
           (("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END),
            ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD))}
    text: dict[str, Any] = {**TEXT_SIZES, "vocab_size": len(tok), "max_position_embeddings": max_position_embeddings,
            "pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "tie_word_embeddings": True, "initializer_range": initializer_range, "head_dim": 64}
    # M-RoPE splits the head's 32 rotary frequencies over (temporal, height, width)
    vision: dict[str, Any] = {
        "depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "out_hidden_size": 128,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
              "initializer_range": initializer_range}
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]}
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
        return (Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids),
                Qwen2_5_VLForConditionalGeneration)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                               "mrope_interleaved": True}
    vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0])
    return (Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids),
            Qwen3VLForConditionalGeneration)


def _image_processor(family: str) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    side = TINY_IMAGE_SIDE[family]
    patch = 14 if family == "qwen2_5_vl" else 16
    # min_pixels: images smaller than 4x4 patches are scaled up, max_pixels: larger ones down (to 16 patches)
    return Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                    min_pixels=side * side, max_pixels=side * side)


def build_tiny_vlm(path: str | Path, family: str = "qwen2_5_vl", seed: int = 0, initializer_range: float = 0.02,
                   max_position_embeddings: int = 1024) -> Path:
    """Create (once) a tiny ``family`` model (:data:`VLM_FAMILIES`) + tokenizer + image processor at ``path``; safe
    when several ranks call it at once. ``initializer_range``: as :func:`hpc_rlhf.models.tiny.build_tiny_model`."""
    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown tiny vision-language family {family!r}; choose one of {list(VLM_FAMILIES)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").is_file() and (path / "preprocessor_config.json").is_file():
            return path
        tok = build_vlm_tokenizer()
        config, model_cls = _configs(family, tok, initializer_range, max_position_embeddings)
        torch.manual_seed(seed)
        model = model_cls(config)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _image_processor(family).save_pretrained(tmp)
        processor = "Qwen2_5_VLProcessor" if family == "qwen2_5_vl" else "Qwen3VLProcessor"
        (tmp / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
        (tmp / "hpc_rlhf_tiny.json").write_text(json.dumps({"family": family, "seed": seed,
                                                            "initializer_range": initializer_range}))
        tmp.rename(path)
    return path
