"""Model shapes and parameter counts for ``hpc-rlhf plan``, without loading any model. Pure Python.

A role's size is the recipe's ``<role>.num_params_b`` or the count of its local ``config.json``; its layer sizes
(hidden, layers, intermediate, vocabulary, heads) come from that ``config.json``, else from the public reference
shape nearest in size. ``hpc_rlhf.planning.memory_estimate`` turns them into bytes per rank.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hpc_rlhf.config.schema import ModelRole, RunConfig

# The projections of a Llama / Qwen / Mistral decoder layer, by module name (what peft's target_modules match).
LAYER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ModelSizeError(ValueError):
    """No way to know a role's model size."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer (Llama / Qwen / Mistral layout) that memory depends on."""

    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    source: str = "config.json"

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> ModelShape:
        try:
            hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
            heads = cfg["num_attention_heads"]
        except KeyError as err:
            raise ModelSizeError(f"config.json lacks {err.args[0]!r}; set <role>.num_params_b instead") from None
        return cls(hidden_size=hidden, num_layers=layers, intermediate_size=cfg.get("intermediate_size", 4 * hidden),
                   vocab_size=vocab, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or hidden // heads,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), source=source)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """Attention and MLP projections of one layer: what tensor parallelism shards."""
        h = self.hidden_size
        return 2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate_size

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """``{module name: (in_features, out_features)}`` of the linear layers of one decoder layer."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def lm_head_params(self) -> int:
        """Parameters of the LM head that are not the input embedding's (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus LM head (one matrix when tied): replicated under tensor parallelism."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    def largest_tensor_params(self, tp: int = 1) -> float:
        """Elements of the largest single weight on a tensor-parallel rank: the embedding / LM head
        (whole on every rank), or an MLP projection (split)."""
        return max(self.vocab_size, self.intermediate_size / tp) * self.hidden_size

    @property
    def num_params(self) -> int:
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return self.num_layers * self.layer_linear_params + self.embedding_params + norms

    def params_per_tp_rank(self, num_params: int, tp: int) -> float:
        """``num_params`` on one tensor-parallel rank: layer projections split, embeddings and norms not."""
        if tp == 1:
            return float(num_params)
        sharded = num_params * (self.num_layers * self.layer_linear_params / self.num_params)
        return num_params - sharded + sharded / tp

    def describe(self) -> str:
        return (f"h={self.hidden_size} L={self.num_layers} i={self.intermediate_size} V={self.vocab_size} "
                f"heads={self.num_heads}/{self.num_kv_heads} ({self.source})")


def _ref(name: str, h: int, layers: int, inter: int, vocab: int, heads: int, kv: int, tied: bool) -> ModelShape:
    return ModelShape(h, layers, inter, vocab, heads, kv, h // heads, tied, source=f"assumed {name}-like shape")


# Public config.json shapes used when a recipe gives only num_params_b: the nearest in size is assumed.
REFERENCE_SHAPES = (
    _ref("Qwen2.5-0.5B", 896, 24, 4864, 151936, 14, 2, True),
    _ref("Qwen2.5-1.5B", 1536, 28, 8960, 151936, 12, 2, True),
    _ref("Qwen2.5-3B", 2048, 36, 11008, 151936, 16, 2, True),
    _ref("Qwen2.5-7B", 3584, 28, 18944, 152064, 28, 4, False),
    _ref("Llama-3-8B", 4096, 32, 14336, 128256, 32, 8, False),
    _ref("Qwen2.5-14B", 5120, 48, 13824, 152064, 40, 8, False),
    _ref("Qwen2.5-32B", 5120, 64, 27648, 152064, 40, 8, False),
    _ref("Llama-3-70B", 8192, 80, 28672, 128256, 64, 8, False),
)


def nearest_reference_shape(num_params: int) -> ModelShape:
    return min(REFERENCE_SHAPES, key=lambda s: abs(math.log(s.num_params / num_params)))


def count_params_from_hf_config(cfg: dict) -> int:
    """Parameter count of a decoder-only transformer from its ``config.json`` (Llama/Qwen/Mistral shape)."""
    return ModelShape.from_hf_config(cfg).num_params


def local_hf_config(section: ModelRole) -> dict | None:
    """The ``config.json`` of a config section's ``pretrain`` when it is a local folder, else None."""
    if section.pretrain is not None:
        path = Path(section.pretrain) / "config.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


def section_num_params(section: ModelRole) -> int | None:
    """A config section's model size: its ``num_params_b``, else the count of its local config.json; None if
    it has neither."""
    if section.num_params_b is not None:
        return int(section.num_params_b * 1e9)
    hf = local_hf_config(section)
    return count_params_from_hf_config(hf) if hf is not None else None


def role_num_params(cfg: RunConfig, role: str) -> int:
    """Parameter count of a role's model: the recipe's ``num_params_b``, else the local config.json.

    The critic, ref and reward default to the actor's size when they name no model of their own; the
    distillation teacher is another model, usually larger, so it never does.
    """
    num_params = section_num_params(getattr(cfg, role))
    if num_params is not None:
        return num_params
    if role not in ("actor", "teacher"):
        return role_num_params(cfg, "actor")
    raise ModelSizeError(
        f"cannot size the {role}: set {role}.pretrain to a local model folder with config.json "
        f"or set {role}.num_params_b"
    )


def role_shape(cfg: RunConfig, role: str) -> ModelShape:
    """The role's layer sizes: its local config.json; the actor's shape when the role names no model of its
    own (like ``role_num_params``); else the reference shape nearest to its size."""
    section = getattr(cfg, role)
    hf = local_hf_config(section)
    if hf is not None:
        return ModelShape.from_hf_config(hf)
    if role != "actor" and section.pretrain is None and section.num_params_b is None:
        return role_shape(cfg, "actor")
    return nearest_reference_shape(role_num_params(cfg, role))

