"""Model shapes and parameter counts for ``hpc-rlhf plan``, without loading any model. Pure Python.

A role's size is the recipe's ``<role>.num_params_b`` or the count of its local ``config.json``; its layer sizes
(hidden, layers, intermediate, vocabulary, heads) come from that ``config.json``, else from the public reference
shape nearest in size. ``hpc_rlhf.planning.memory_estimate`` turns them into bytes per rank.

Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3: ``num_experts`` /
``num_local_experts`` / ``n_routed_experts`` and ``num_experts_per_tok`` in ``config.json``) have two sizes: the
*total* parameters, which weights, gradients and optimizer states occupy, and the *active* ones (attention,
routers, the ``top_k`` experts a token runs, and the shared experts, which run for every token), which set the
FLOPs per token (``ModelShape.active_fraction``). Which layers are sparse and how wide the shared experts are
follow transformers' modeling code, which is what the trainers load (:func:`sparse_layer_count`,
:func:`shared_expert_width`). DeepSeek's multi-head latent attention (MLA: ``kv_lora_rank`` set) is counted
projection by projection (:meth:`ModelShape.attention_params`).

Counts are exact (checked against transformers' models in ``tests/unit/test_plan_moe.py``) for the Llama,
Mistral, Qwen2, Qwen3 (per-head q/k norms), Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V2/V3 layouts; multi-token
prediction layers (DeepSeek-V3's ``num_nextn_predict_layers``), which transformers does not build, are not.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from hpc_rlhf.config.schema import ModelRole, RunConfig
from hpc_rlhf.planning.vision_memory import vision_params

# The projections of a Llama / Qwen / Mistral decoder layer, by module name (what peft's target_modules match).
LAYER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_PROJECTIONS, MLP_PROJECTIONS = LAYER_PROJECTIONS[:4], LAYER_PROJECTIONS[4:]
# DeepSeek's multi-head latent attention (``q_proj`` instead of the first two without a query rank).
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


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
    shared_expert_intermediate_size: int = 0
    """MLP width of the shared expert(s) of a sparse layer, which every token runs besides its routed experts
    (Qwen2-MoE's ``shared_expert_intermediate_size``; DeepSeek's ``n_shared_experts x moe_intermediate_size``,
    one MLP that wide); 0 without."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by a sigmoid gate, a ``hidden -> 1`` linear (Qwen2-MoE)."""
    qkv_bias: bool = False
    """q, k and v projections have biases (Qwen2, Qwen2-MoE; ``attention_bias`` of Llama / Qwen3)."""
    o_bias: bool = False
    """The output projection has a bias (``attention_bias``; under MLA also ``q_a_proj`` and ``kv_a_proj``)."""
    qk_norm: bool = False
    """Per-head RMSNorm on queries and keys, ``head_dim`` weights each (Qwen3, Qwen3-MoE)."""
    q_lora_rank: int = 0
    """MLA: rank of the query compression (``q_a_proj``); 0 for a plain ``q_proj``."""
    kv_lora_rank: int = 0
    """MLA: rank of the key-value latent (``kv_a_proj_with_mqa``); 0 for standard attention."""
    qk_rope_head_dim: int = 0
    """MLA: the rotary part of ``head_dim`` (``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim``)."""
    v_head_dim: int = 0
    """MLA: value head size (``head_dim`` otherwise)."""
    model_type: str = ""
    """``config.json``'s ``model_type``: which MoE blocks peft adapts under LoRA depends on it
    (``hpc_rlhf.planning.lora_memory``)."""

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> ModelShape:
        if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
            # a vision-language model (Qwen-VL): its language model; the vision tower: planning.vision_memory
            cfg = {"model_type": cfg.get("model_type", ""), **cfg["text_config"]}
        try:
            hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
            heads = cfg["num_attention_heads"]
        except KeyError as err:
            raise ModelSizeError(f"config.json lacks {err.args[0]!r}; set <role>.num_params_b instead") from None
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
        top_k = cfg.get("num_experts_per_tok") or 0 if experts else 0
        intermediate = cfg.get("intermediate_size", 4 * hidden)
        moe = {}
        if experts and top_k:
            expert_width = cfg.get("moe_intermediate_size") or intermediate  # Mixtral: intermediate_size wide
            moe = {"num_experts": int(experts), "experts_per_token": int(top_k),
                   "num_sparse_layers": sparse_layer_count(cfg, layers), "moe_intermediate_size": expert_width,
                   "shared_expert_intermediate_size": shared_expert_width(cfg, expert_width),
                   # Qwen2-MoE gates its shared expert; DeepSeek adds its shared experts' output as it is.
                   "shared_expert_gate": bool(cfg.get("shared_expert_intermediate_size"))}
        model_type = cfg.get("model_type", "")
        attention_bias = bool(cfg.get("attention_bias", False))
        # transformers' Qwen2 attention always has q/k/v biases; Qwen2-MoE's follow qkv_bias (default true).
        # A vision-language model's text model is its family's (Qwen2.5-VL: Qwen2's biases, Qwen3-VL: Qwen3's norms).
        family = model_type.removesuffix("_text")
        qkv_bias = bool(cfg.get("qkv_bias", family in ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"))) \
            or attention_bias
        attention = {"qkv_bias": qkv_bias, "o_bias": attention_bias,
                     "qk_norm": family in ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"),
                     "num_kv_heads": cfg.get("num_key_value_heads") or heads,
                     "head_dim": cfg.get("head_dim") or hidden // heads}
        if cfg.get("kv_lora_rank"):
            attention = {**attention, **_mla_fields(cfg, heads)}
        return cls(hidden_size=hidden, num_layers=layers, intermediate_size=intermediate, vocab_size=vocab,
                   num_heads=heads, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), source=source,
                   model_type=model_type, **attention, **moe)

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
    def is_mla(self) -> bool:
        """DeepSeek's multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank > 0

    @property
    def attention_params(self) -> int:
        """q/k/v/o projections of one layer, biases included."""
        if self.is_mla:
            return self._mla_params()
        bias = (self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)
        return 2 * self.hidden_size * (self.q_dim + self.kv_dim) + bias

    def _mla_params(self) -> int:
        """MLA projections of one layer (transformers' ``DeepseekV3Attention``): queries through a rank
        ``q_lora_rank`` bottleneck (or one ``q_proj``); keys and values from a ``kv_lora_rank`` latent plus a
        rotary key part shared by the heads (``kv_a_proj_with_mqa``), expanded per head by ``kv_b_proj`` into the
        non-rotary key (``head_dim - qk_rope_head_dim``) and the value (``v_head_dim``); ``o_proj`` from the values.
        ``attention_bias`` puts biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``."""
        h, n, qk, rope, v = self.hidden_size, self.num_heads, self.head_dim, self.qk_rope_head_dim, self.v_head_dim
        qr, kvr, bias = self.q_lora_rank, self.kv_lora_rank, int(self.o_bias)
        q = qr * (h + n * qk + bias) if qr else h * n * qk
        kv = (kvr + rope) * (h + bias) + kvr * n * (qk - rope + v)
        return q + kv + n * v * h + bias * h

    @property
    def layer_norm_params(self) -> int:
        """Norm weights of one decoder layer: the two RMSNorms around attention and MLP, plus Qwen3's per-head q/k
        norms and MLA's norms of its query and key-value latents."""
        return 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0) \
            + (self.q_lora_rank + self.kv_lora_rank if self.is_mla else 0)

    @property
    def shared_expert_params(self) -> int:
        """Shared-expert parameters of one sparse layer: a SwiGLU MLP ``shared_expert_intermediate_size`` wide
        and Qwen2-MoE's ``hidden -> 1`` gate. Every token runs them: total and active alike."""
        h = self.hidden_size
        return 3 * h * self.shared_expert_intermediate_size + (h if self.shared_expert_gate else 0)

    def _mlp_params(self, experts: int) -> int:
        """MLP parameters of all layers with ``experts`` routed experts per sparse layer (plus its router and
        shared experts)."""
        h = self.hidden_size
        dense = (self.num_layers - self.num_sparse_layers) * 3 * h * self.intermediate_size
        per_sparse = experts * 3 * h * self.moe_intermediate_size + self.num_experts * h + self.shared_expert_params
        return dense + self.num_sparse_layers * per_sparse

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

    def attention_projection_dims(self) -> dict[str, tuple[int, int]]:
        """``{module name: (in_features, out_features)}`` of one layer's attention linears: q/k/v/o, or MLA's
        ``q_a_proj`` / ``q_b_proj`` (``q_proj`` without a query rank), ``kv_a_proj_with_mqa``, ``kv_b_proj``,
        ``o_proj`` (see :meth:`_mla_params`)."""
        if not self.is_mla:
            return {m: d for m, d in self.projection_dims().items() if m in ATTENTION_PROJECTIONS}
        h, n, qk, rope, v = self.hidden_size, self.num_heads, self.head_dim, self.qk_rope_head_dim, self.v_head_dim
        qr, kvr = self.q_lora_rank, self.kv_lora_rank
        q = {"q_a_proj": (h, qr), "q_b_proj": (qr, n * qk)} if qr else {"q_proj": (h, n * qk)}
        return {**q, "kv_a_proj_with_mqa": (h, kvr + rope), "kv_b_proj": (kvr, n * (qk - rope + v)),
                "o_proj": (n * v, h)}

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
        (whole on every rank), an MLP projection (split), or an MoE layer's fused expert weight (transformers 5
        holds the gate and up projections of all experts as one ``num_experts x 2 moe_i x h`` parameter)."""
        fused_experts = self.num_experts * 2 * self.moe_intermediate_size if self.is_moe else 0
        return max(self.vocab_size, self.intermediate_size / tp, fused_experts) * self.hidden_size

    @property
    def num_params(self) -> int:
        """Every parameter (all experts of an MoE model): what weights and optimizer states occupy."""
        norms = self.num_layers * self.layer_norm_params + self.hidden_size
        return self.num_layers * self.attention_params + self._mlp_params(self.num_experts) + self.embedding_params \
            + norms

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: :attr:`num_params` with ``experts_per_token`` routed experts per
        sparse layer (the routers and shared experts whole); the same as :attr:`num_params` for a dense model."""
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
            shared = f", shared expert i={self.shared_expert_intermediate_size}" \
                if self.shared_expert_intermediate_size else ""
            moe = (f" MoE {self.num_experts} experts (top-{self.experts_per_token}, i={self.moe_intermediate_size}"
                   f"{shared}, {self.num_sparse_layers} sparse layers): {_billions(self.num_params)} total / "
                   f"{_billions(self.active_params)} active params (memory counts total, FLOPs active)")
        heads = f"heads={self.num_heads}/{self.num_kv_heads}"
        if self.is_mla:
            heads = f"heads={self.num_heads} MLA(q_lora={self.q_lora_rank}, kv_lora={self.kv_lora_rank})"
        return (f"h={self.hidden_size} L={self.num_layers} i={self.intermediate_size} V={self.vocab_size} "
                f"{heads}{moe} ({self.source})")


def sparse_layer_count(cfg: dict, layers: int) -> int:
    """Decoder layers of an MoE ``config.json`` whose MLP is a mixture of experts, as transformers builds them.

    DeepSeek-V2/V3 (``first_k_dense_replace``): every layer from that index on; transformers does not read
    ``moe_layer_freq`` (DeepSeek's own modeling code does; every published checkpoint has 1). Qwen2-MoE /
    Qwen3-MoE: every ``decoder_sparse_step``-th layer outside ``mlp_only_layers``. Mixtral (neither key): all.
    """
    if cfg.get("first_k_dense_replace") is not None:
        first = int(cfg["first_k_dense_replace"])
        if not 0 <= first <= layers:
            raise ModelSizeError(f"config.json's first_k_dense_replace={first} is outside 0..num_hidden_layers="
                                 f"{layers}")
        return layers - first
    step, dense = cfg.get("decoder_sparse_step") or 1, set(cfg.get("mlp_only_layers") or ())
    return sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def shared_expert_width(cfg: dict, expert_width: int) -> int:
    """MLP width of a sparse layer's shared experts: Qwen2-MoE's ``shared_expert_intermediate_size``, or
    DeepSeek's ``n_shared_experts`` experts ``expert_width`` wide (transformers builds them as one MLP of the
    summed width: the same parameters and FLOPs); 0 when the config names none."""
    if cfg.get("shared_expert_intermediate_size"):
        return int(cfg["shared_expert_intermediate_size"])
    return int(cfg.get("n_shared_experts") or 0) * expert_width


def _mla_fields(cfg: dict, heads: int) -> dict:
    """The :class:`ModelShape` fields of a DeepSeek MLA attention (``kv_lora_rank`` set): queries and keys are
    ``qk_nope_head_dim + qk_rope_head_dim`` a head, values ``v_head_dim``, one key-value head per query head (the
    latent is expanded per head). The parameter counts are exact; activations (and ``step_time``'s KV cache) then
    see MLA as multi-head attention of that head size, values included: the expanded keys and values transformers
    computes, not the compressed latent (``kv_lora_rank + qk_rope_head_dim`` a token) vLLM caches."""
    missing = [k for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if not cfg.get(k)]
    if missing:
        raise ModelSizeError(f"config.json sets kv_lora_rank (multi-head latent attention) but lacks "
                             f"{', '.join(missing)}; set <role>.num_params_b instead")
    return {"num_kv_heads": heads, "head_dim": cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
            "q_lora_rank": int(cfg.get("q_lora_rank") or 0), "kv_lora_rank": int(cfg["kv_lora_rank"]),
            "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]), "v_head_dim": int(cfg["v_head_dim"])}


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
    expert of an MoE model: :attr:`ModelShape.active_params` counts those a token runs); a vision-language model's
    vision tower is added (:mod:`hpc_rlhf.planning.vision_memory`)."""
    return ModelShape.from_hf_config(cfg).num_params + vision_params(cfg)


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

