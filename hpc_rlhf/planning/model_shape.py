"""Model shapes and parameter counts for ``hpc-rlhf plan``, without loading any model. Pure Python.

A role's size is the recipe's ``<role>.num_params_b`` or the count of its local ``config.json``; its layer sizes
(hidden, layers, intermediate, vocabulary, heads) come from that ``config.json``, else from the public reference
shape nearest in size. ``hpc_rlhf.planning.memory_estimate`` turns them into bytes per rank.

Mixture-of-experts models (Qwen3-MoE, Mixtral: ``num_experts`` / ``num_local_experts`` and
``num_experts_per_tok`` in ``config.json``) have two sizes: the *total* parameters, which weights, gradients
and optimizer states occupy, and the *active* ones (attention, routers, the ``top_k`` experts a token runs),
which set the FLOPs per token (``ModelShape.active_fraction``). Shared experts (Qwen2-MoE, DeepSeek) are not
counted.
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
    num_experts: int = 0
    """Experts per MoE layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Experts each token runs (``num_experts_per_tok``)."""
    moe_intermediate_size: int = 0
    """MLP width of one expert."""
    num_sparse_layers: int = 0
    """Layers whose MLP is a mixture of experts (the others are dense, ``intermediate_size`` wide)."""

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> ModelShape:
        try:
            hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
            heads = cfg["num_attention_heads"]
        except KeyError as err:
            raise ModelSizeError(f"config.json lacks {err.args[0]!r}; set <role>.num_params_b instead") from None
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
        top_k = cfg.get("num_experts_per_tok") or 0 if experts else 0
        intermediate = cfg.get("intermediate_size", 4 * hidden)
        moe = {}
        if experts and top_k:
            # Qwen3-MoE: experts moe_intermediate_size wide, sparse every decoder_sparse_step-th layer outside
            # mlp_only_layers (transformers' Qwen3MoeDecoderLayer); Mixtral: every layer, intermediate_size wide.
            step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
            sparse = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
            moe = {"num_experts": int(experts), "experts_per_token": int(top_k), "num_sparse_layers": sparse,
                   "moe_intermediate_size": cfg.get("moe_intermediate_size") or intermediate}
        return cls(hidden_size=hidden, num_layers=layers, intermediate_size=intermediate,
                   vocab_size=vocab, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or hidden // heads,
                   tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), source=source, **moe)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """q/k/v/o projections of one layer."""
        return 2 * self.hidden_size * (self.q_dim + self.kv_dim)

    def _mlp_params(self, experts: int) -> int:
        """MLP parameters of all layers with ``experts`` experts per sparse layer (and its router)."""
        h = self.hidden_size
        dense = (self.num_layers - self.num_sparse_layers) * 3 * h * self.intermediate_size
        sparse = self.num_sparse_layers * (experts * 3 * h * self.moe_intermediate_size + self.num_experts * h)
        return dense + sparse

    @property
    def layer_linear_params(self) -> int:
        """Attention and MLP projections of one layer (averaged over the layers of an MoE model, experts
        included): what tensor parallelism shards in a dense model."""
        return self.attention_params + self._mlp_params(self.num_experts) // self.num_layers

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
        """Every parameter (all experts of an MoE model): what weights and optimizer states occupy."""
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        return self.num_layers * self.attention_params + self._mlp_params(self.num_experts) + self.embedding_params \
            + norms

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: :attr:`num_params` with ``experts_per_token`` experts per sparse
        layer (the routers whole); the same as :attr:`num_params` for a dense model."""
        if not self.is_moe:
            return self.num_params
        return self.num_params - self._mlp_params(self.num_experts) + self._mlp_params(self.experts_per_token)

    @property
    def active_fraction(self) -> float:
        """Active share of the decoder's parameters (embeddings excluded): scales a size's FLOPs per token."""
        body = self.num_params - self.embedding_params
        return (self.active_params - self.embedding_params) / body if body > 0 else 1.0

    def params_per_tp_rank(self, num_params: int, tp: int) -> float:
        """``num_params`` on one tensor-parallel rank: layer projections split, embeddings and norms not."""
        if tp == 1:
            return float(num_params)
        sharded = num_params * (self.num_layers * self.layer_linear_params / self.num_params)
        return num_params - sharded + sharded / tp

    def describe(self) -> str:
        moe = ""
        if self.is_moe:
            moe = (f" MoE {self.num_experts} experts (top-{self.experts_per_token}, i={self.moe_intermediate_size}, "
                   f"{self.num_sparse_layers} sparse layers): {_billions(self.num_params)} total / "
                   f"{_billions(self.active_params)} active params (memory counts total, FLOPs active)")
        return (f"h={self.hidden_size} L={self.num_layers} i={self.intermediate_size} V={self.vocab_size} "
                f"heads={self.num_heads}/{self.num_kv_heads}{moe} ({self.source})")


def _billions(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e7 else f"{n / 1e6:.2f}M"


def check_moe_tensor_parallel(hf_config: dict | None, tp: int, key: str) -> None:
    """Refuse DeepSpeed AutoTP (``ds.tensor_parallel_size`` > 1) for a mixture-of-experts model (``key``: the
    config key of its folder).

    DeepSpeed 0.19.8's AutoTP shards by the model's HF ``base_model_tp_plan``, and the Qwen3-MoE / Mixtral
    plans of transformers 5 name the experts ``packed_colwise`` / ``moe_tp_experts``, styles its
    ``TPPlanConverter`` rejects (``deepspeed.initialize`` raises); the experts themselves are 3-D parameters,
    not ``nn.Linear``, which its name-based fallback would leave replicated on every tp rank anyway.
    """
    if tp > 1 and hf_config is not None and ModelShape.from_hf_config(hf_config).is_moe:
        raise ModelSizeError(f"ds.tensor_parallel_size={tp} with a mixture-of-experts model ({key}): DeepSpeed "
                             "0.19.8's AutoTP cannot shard its experts; use ds.tensor_parallel_size=1 (ZeRO-3 "
                             "partitions the experts)")


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
    """Parameter count of a decoder-only transformer from its ``config.json`` (Llama/Qwen/Mistral shape; every
    expert of an MoE model: :attr:`ModelShape.active_params` counts those a token runs)."""
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

