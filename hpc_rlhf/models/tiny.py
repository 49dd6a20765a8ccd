"""Build a small Llama (or mixture-of-experts model) and a character-level tokenizer locally, saved like a real
checkpoint.

Used by the CPU recipes, the quickstart and the tests: nothing is downloaded. The folder holds
``config.json``, safetensors weights and a ``PreTrainedTokenizerFast``, so every code path loads it with
the same ``from_pretrained`` calls as a real model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from hpc_rlhf.models.tiny_tokenizer import TOOL_CALL_TOKEN as TOOL_CALL_TOKEN  # where the tests and recipes read it
from hpc_rlhf.models.tiny_tokenizer import build_char_tokenizer
from hpc_rlhf.models.tiny_vlm import VLM_FAMILIES, build_tiny_vlm

DEFAULT_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2}
# vLLM's CPU attention refuses head_dim 16 (DEFAULT_SIZES: 64 / 4 heads); head_dim 64 runs. Used when the rollout
# engine is vLLM (CPU recipes, tests).
VLLM_CPU_SIZES = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                  "num_attention_heads": 2, "num_key_value_heads": 1}


# Mixture-of-experts families of the tiny builder: transformers' config and model classes.
MOE_FAMILIES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM)}


def tiny_sizes(rollout_backend: str) -> dict[str, int]:
    """The tiny model's sizes for a rollout backend: one vLLM's CPU attention supports when it is ``vllm``."""
    return dict(VLLM_CPU_SIZES if rollout_backend == "vllm" else DEFAULT_SIZES)


def build_tiny_model(path: str | Path, seed: int = 0, max_position_embeddings: int = 512,
                     initializer_range: float = 0.02, tools: bool = False, **sizes: int) -> Path:
    """Create (once) a tiny Llama + tokenizer at ``path``; safe when several ranks call it at once.

    ``initializer_range`` is the init std. Llama's 0.02 keeps the tied embeddings so small that logits stay
    within about +-1: a model trained with a frozen embedding (LoRA) then never becomes confident, and which
    token wins greedy decoding turns on last-digit differences between CPUs. Tests that check a learned
    behaviour pass a larger value. ``tools``: the
    tool-calling tokenizer and template (:data:`TOOL_CALL_TOKEN`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
            return path
        tok = build_char_tokenizer(tools=tools)
        # LlamaConfig's size fields by name (hidden_size, ...): mypy cannot match a dict's keys to its keywords
        size_fields: dict[str, Any] = {**DEFAULT_SIZES, **sizes}
        config = LlamaConfig(
            vocab_size=len(tok), max_position_embeddings=max_position_embeddings,
            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True, initializer_range=initializer_range, **size_fields,
        )
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        recipe = {"seed": seed, "initializer_range": initializer_range, **({"tools": True} if tools else {}),
                  **sizes}
        (tmp / "hpc_rlhf_tiny.json").write_text(json.dumps(recipe))
        tmp.rename(path)
    return path


def _save_once(path: Path, make_model, recipe: dict) -> Path:
    """Write ``make_model()`` and the char tokenizer to ``path`` unless it is already there (file-locked)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
            return path
        model = make_model()
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        build_char_tokenizer().save_pretrained(tmp)
        (tmp / "hpc_rlhf_tiny.json").write_text(json.dumps(recipe))
        tmp.rename(path)
    return path


def build_tiny_moe_model(path: str | Path, family: str = "qwen3_moe", seed: int = 0, num_experts: int = 4,
                         top_k: int = 2, expert_intermediate_size: int = 64, max_position_embeddings: int = 512,
                         initializer_range: float = 0.02, **sizes: int) -> Path:
    """Create (once) a tiny mixture-of-experts model + char tokenizer at ``path``: transformers' Qwen3-MoE
    (``family="qwen3_moe"``) or Mixtral, every layer sparse, ``num_experts`` experts of which ``top_k`` run per
    token. ``sizes`` override :data:`DEFAULT_SIZES` (pass :data:`VLLM_CPU_SIZES` for head_dim 64, which vLLM's
    CPU attention supports); each expert's MLP width is ``expert_intermediate_size``."""
    if family not in MOE_FAMILIES:
        raise ValueError(f"unknown tiny MoE family {family!r}; choose one of {sorted(MOE_FAMILIES)}")
    config_cls, model_cls = MOE_FAMILIES[family]
    dims = {**DEFAULT_SIZES, **sizes}
    tok = build_char_tokenizer()
    # Qwen3-MoE sizes its experts by moe_intermediate_size, Mixtral by intermediate_size.
    experts = ({"num_experts": num_experts, "moe_intermediate_size": expert_intermediate_size,
                "decoder_sparse_step": 1, "norm_topk_prob": True} if family == "qwen3_moe"
               else {"num_local_experts": num_experts, "intermediate_size": expert_intermediate_size})
    config = config_cls(
        vocab_size=len(tok), max_position_embeddings=max_position_embeddings,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True, initializer_range=initializer_range, num_experts_per_tok=top_k,
        head_dim=dims["hidden_size"] // dims["num_attention_heads"], **{**dims, **experts},
    )

    def make_model():
        torch.manual_seed(seed)
        return model_cls(config)

    recipe = {"family": family, "seed": seed, "num_experts": num_experts, "top_k": top_k,
              "expert_intermediate_size": expert_intermediate_size, "initializer_range": initializer_range, **sizes}
    return _save_once(Path(path), make_model, recipe)


def build_tiny_for(path: str | Path, kind: bool | str, seed: int = 0, rollout_backend: str = "transformers") -> Path:
    """The tiny model a recipe's ``build_tiny`` asks for: ``true`` the Llama, ``margin`` the Llama drawn with std
    0.1, ``tools`` the Llama with the
    tool-calling tokenizer, a family name of :data:`MOE_FAMILIES` the mixture-of-experts model; sized for
    ``rollout_backend`` (:func:`tiny_sizes`). ``qwen2_5_vl`` / ``qwen3_vl``: the vision-language model of
    :mod:`hpc_rlhf.models.tiny_vlm` (one size, head_dim 64), drawn with std 0.1 so greedy answers have a margin."""
    if kind in VLM_FAMILIES:
        return build_tiny_vlm(path, str(kind), seed=seed, initializer_range=0.1)
    sizes = tiny_sizes(rollout_backend)
    if kind is True or kind == "tools":
        return build_tiny_model(path, seed=seed, tools=kind == "tools", **sizes)
    if kind == "margin":  # std 0.1: a logit margin for greedy decoding (see build_tiny_model)
        return build_tiny_model(path, seed=seed, initializer_range=0.1, tools=False, **sizes)
    return build_tiny_moe_model(path, family=str(kind), seed=seed, **sizes)


def build_tiny_reward_model(path: str | Path, seed: int = 1) -> Path:
    """Create (once) a tiny reward model at ``path``: the tiny Llama with a one-label ``score`` head, drawn with
    std 1 so different texts get clearly different scores (the server tests and the load test compare them)."""
    path = Path(path)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").is_file():
            return path
        base = build_tiny_model(path.with_name(path.name + ".base"))
        tok = AutoTokenizer.from_pretrained(base)
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
        with torch.no_grad():
            model.score.weight.normal_(std=1.0)
        model.config.pad_token_id = tok.pad_token_id
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        tmp.rename(path)
    return path
