"""LoRA and QLoRA terms of ``hpc-rlhf plan``'s memory model: adapter parameters, NF4 bytes of a 4-bit base,
the dequantisation transient and the activations a LoRA layer saves. Pure Python.

LoRA (``ds.lora.rank > 0``, peft) on the trained roles (actor, critic; the offline trainers' model):

- the base weights stay as they are (replicated at stages 0-2, partitioned only at stage 3) and are frozen;
  the LoRA factors (``rank x (in + out)`` per targeted linear, ``rank x E x (in + out)`` per fused expert
  parameter, ``lora_params``) plus, for a value model, a trainable copy of its ``score`` head (peft
  ``modules_to_save``) are the only trainable parameters: only they have gradients, Adam states, a master
  copy and DeepSpeed buffers; they are stored next to the base weights;
- activations: the frozen norms no longer save their normalised inputs (``-2h`` per layer and token), the
  input of a targeted projection is saved once for its ``lora_A``, each targeted projection adds ``rank``
  (the ``lora_A`` output), and with ``ds.lora.dropout > 0`` each targeted projection saves its dropped input
  and the dropout mask instead (``lora_layer_elements``, counted with autograd's saved tensors);
- mixture-of-experts models (transformers 5 holds the routed experts as fused 3-D parameters, the router as a
  bare weight): which parts take adapters follows peft (:func:`expert_targets`, :func:`mlp_linear_targets`); an
  adapted fused parameter is merged (``W + scale B A``, peft's ``ParamWrapper``) in every forward, a new tensor
  the experts' matmuls save for the backward: per sparse layer a copy of the adapted expert weights and router,
  whatever the token count (``lora_merged_elements``), and the sparse layers save ``lora_sparse_layer_elements``.

QLoRA (``ds.lora.load_in_4bit``; refused with ZeRO-3 and tensor parallelism by the config) stores the linear
layers of the transformer blocks of the actor, critic and reference (and of the offline trainers' model and
reference) as bitsandbytes NF4 with double quantisation: ``NF4_BYTES_PER_PARAM`` (0.516) bytes a parameter
plus ``NF4_BYTES_PER_TENSOR`` a weight; embeddings, LM head, norms, biases and value heads keep the parameter
dtype, and so do an MoE model's fused experts and router (bitsandbytes replaces ``nn.Linear`` modules only),
and the RL reward model is not quantised. A 4-bit layer dequantises its whole weight to the compute dtype in
every forward and backward (bitsandbytes' ``gemm_4bit`` and ``MatMul4Bit.backward``): one layer's weight
(the largest projection) is added to the working set.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from dataclasses import dataclass

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.planning.model_shape import (
    LAYER_PROJECTIONS,
    MLA_PROJECTIONS,
    MLP_PROJECTIONS,
    ModelShape,
)

# bitsandbytes NF4 with double quantisation (``BitsAndBytesConfig(bnb_4bit_quant_type="nf4",
# bnb_4bit_use_double_quant=True)``, as hpc_rlhf.models.quantization loads QLoRA bases; bitsandbytes 0.50
# ``functional.quantize_4bit``): two 4-bit codes a byte (0.5 B); one absmax per block of 64 parameters,
# fp32 but double-quantised to one uint8 (1/64 B); those absmax are quantised in blocks of 256 with an fp32
# absmax each (4 / (64 x 256) B). = 0.515869 B/param (4.127 bits). Per quantised weight, a 16-entry fp32 NF4
# code, the 256-entry fp32 dynamic code of the absmax quantisation and an fp32 offset (the absmax mean):
# 1092 B. Checked on a loaded model: storage of Params4bit + quant_state equals these to the byte.
NF4_BLOCKSIZE, NF4_NESTED_BLOCKSIZE = 64, 256
NF4_BYTES_PER_PARAM = 0.5 + 1 / NF4_BLOCKSIZE + 4 / (NF4_BLOCKSIZE * NF4_NESTED_BLOCKSIZE)
NF4_BYTES_PER_TENSOR = (16 + 256 + 1) * 4
ROUTER_PROB_BYTES = 4  # transformers' routers softmax their logits in fp32 (Qwen2/3-MoE, Mixtral)

# Module names of the MoE blocks besides the layer projections: the router (``gate``), Qwen2-MoE's shared-expert
# gate, Mixtral's expert projections as transformers 4 named them (w1 gate, w3 up, w2 down).
MOE_MODULES = ("gate", "shared_expert_gate", "w1", "w2", "w3")
# The v4 names (gate and up, down) of the expert projections in the families converted like Qwen2-MoE.
_QWEN2_MOE_NAMES = (("gate_proj", "up_proj"), "down_proj")
FusedMoeNames = tuple[tuple[str, str], str]


@functools.cache
def peft_fused_moe_types() -> dict[str, FusedMoeNames]:
    """``{model_type: ((gate, up), down)}``: the MoE families whose LoRA config peft rewrites, read from peft.

    peft (0.17+) under transformers 5 rewrites a LoRA config for the MoE families whose v4 expert Linears
    transformers 5 fuses into 3-D parameters (``peft.utils.transformers_weight_conversion``: the model types
    transformers converts like ``mixtral`` or ``qwen2_moe``): the v4 names of the router and the expert
    projections, which ``"all-linear"`` also stands for, become ``target_parameters`` (``gate.weight``,
    ``gate_up_proj``, ``down_proj``) and leave ``target_modules``. Value: the v4 names of the gate and up, and of
    the down projection. qwen2_moe itself is not in peft's table: its experts and router take no adapters.

    The table grows with transformers' conversion table, so it is read at run time, not copied. Without that
    module (transformers 4, where experts are separate Linears, or a peft older than 0.17) nothing is fused: {}.
    Raises RuntimeError when the module is there but no longer has the tables read here.
    """
    try:
        conversion = importlib.import_module("peft.utils.transformers_weight_conversion")
    except ImportError:
        return {}
    try:
        patterns: dict[str, str] = conversion._MODEL_TO_CONVERSION_PATTERN
        renames: dict[str, dict[str, str]] = conversion._MOE_TARGET_MODULE_MAPPING
        fused: dict[str, dict[str, list[str]]] = conversion._MOE_FUSED_TARGETS
    except AttributeError as err:
        import peft

        raise RuntimeError(f"peft {peft.__version__}: peft.utils.transformers_weight_conversion has no {err.name}; "
                           "hpc-rlhf plan cannot tell which MoE families peft adapts as fused experts") from err
    table: dict[str, FusedMoeNames] = {}
    for model_type, pattern in patterns.items():
        if pattern not in renames or pattern not in fused:
            continue
        gate, up = fused[pattern]["gate_up_proj"]
        (down,) = (v4 for v4, v5 in renames[pattern].items() if v5 == "down_proj")
        table[model_type] = ((gate, up), down)
    return table


def lora_target_names(target_modules: list[str]) -> tuple[frozenset[str], tuple[str, ...]]:
    """``(module names adapted, entries not counted)`` of a ``ds.lora.target_modules`` list.

    ``"all-linear"`` is every projection of every decoder layer (peft leaves the output layer out), MLA's and
    the MoE blocks' included (:data:`MOE_MODULES`: peft's conversion adds the router and experts' v4 names for
    it); any other entry matches modules by its last name part, as peft matches suffixes (``"q_proj"``,
    ``"self_attn.q_proj"``). Besides the layer projections, ``"lm_head"`` and ``"embed_tokens"`` are counted; an
    entry naming nothing of the counted layouts comes back in the second element.
    """
    every = (*LAYER_PROJECTIONS, *MLA_PROJECTIONS, *MOE_MODULES)
    known = {*every, "lm_head", "embed_tokens"}
    names: set[str] = set()
    ignored: list[str] = []
    for entry in target_modules:
        if entry == "all-linear":
            names.update(every)
        elif entry.rsplit(".", 1)[-1] in known:
            names.add(entry.rsplit(".", 1)[-1])
        else:
            ignored.append(entry)
    return frozenset(names), tuple(ignored)


@dataclass(frozen=True)
class LoraSpec:
    """What memory depends on in ``ds.lora``: the rank, the adapted module names, dropout, a 4-bit base."""

    rank: int
    targets: frozenset[str]
    dropout: float = 0.0
    load_in_4bit: bool = False
    ignored: tuple[str, ...] = ()  # target_modules entries that name no module of the counted layout

    @classmethod
    def from_config(cls, lora: LoraConfig) -> LoraSpec | None:
        """None when LoRA is off (``rank == 0``)."""
        if lora.rank == 0:
            return None
        targets, ignored = lora_target_names(lora.target_modules)
        return cls(lora.rank, targets, lora.dropout, lora.load_in_4bit, ignored)


@dataclass(frozen=True)
class ExpertTarget:
    """A fused MoE parameter peft adapts through a ``ParamWrapper``: ``lora_A`` is ``(rank x experts, in)`` and
    ``lora_B`` ``(out, rank x experts)``, one rank-``rank`` factor pair per expert. ``in`` and ``out`` are the
    last two dimensions of the 3-D parameter (peft swaps them back for ``(E, out, in)`` layouts: the same sum), or
    ``(h, E)`` for the 2-D router weight (``experts`` 1). The fused gate-up projection gets twice the rank
    (peft's conversion keeps the rank of each of the two v4 projections it stands for)."""

    name: str
    experts: int
    in_features: int
    out_features: int
    rank: int

    @property
    def params(self) -> int:
        return self.rank * self.experts * (self.in_features + self.out_features)

    @property
    def largest_factor(self) -> int:
        return self.rank * self.experts * max(self.in_features, self.out_features)

    @property
    def weight_elements(self) -> int:
        """Elements of the adapted parameter itself (and of its merged copy)."""
        return self.experts * self.in_features * self.out_features


def peft_fuses_experts(shape: ModelShape) -> bool:
    """Whether peft maps LoRA targets onto this MoE model's fused experts and router
    (:func:`peft_fused_moe_types`)."""
    return shape.is_moe and shape.model_type in peft_fused_moe_types()


def expert_targets(shape: ModelShape, lora: LoraSpec) -> tuple[ExpertTarget, ...]:
    """The fused parameters of one sparse layer that LoRA adapts: the experts' ``gate_up_proj`` (its two v4 names
    targeted; peft refuses one without the other), ``down_proj`` and the router's ``gate.weight``; none for
    a dense model or an MoE family peft does not convert (Qwen2-MoE)."""
    if not peft_fuses_experts(shape):
        return ()
    (gate, up), down = peft_fused_moe_types()[shape.model_type]
    e, h, i, r = shape.num_experts, shape.hidden_size, shape.moe_intermediate_size, lora.rank
    out = []
    if {gate, up} <= lora.targets:
        out.append(ExpertTarget("gate_up_proj", e, h, 2 * i, 2 * r))
    if down in lora.targets:
        out.append(ExpertTarget("down_proj", e, i, h, r))
    if "gate" in lora.targets:
        out.append(ExpertTarget("gate.weight", 1, h, e, r))
    return tuple(out)


def attention_targets(shape: ModelShape, lora: LoraSpec) -> dict[str, tuple[int, int]]:
    """``{name: (in, out)}`` of the adapted attention linears of one layer."""
    return {m: d for m, d in shape.attention_projection_dims().items() if m in lora.targets}


def mlp_linear_targets(shape: ModelShape, lora: LoraSpec) -> tuple[str, ...]:
    """MLP projections adapted as ``nn.Linear``: those of the dense layers and of the shared experts. peft's MoE
    conversion turns ``gate_proj`` / ``up_proj`` / ``down_proj`` into the fused experts' parameters, so in the
    families it converts like Qwen2-MoE (Qwen3-MoE, DeepSeek) the dense layers' MLPs and the shared experts take
    no adapters."""
    if peft_fuses_experts(shape) and peft_fused_moe_types()[shape.model_type] == _QWEN2_MOE_NAMES:
        return ()
    return tuple(m for m in MLP_PROJECTIONS if m in lora.targets)


def _shared_expert_dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, s = shape.hidden_size, shape.shared_expert_intermediate_size
    return {"gate_proj": (h, s), "up_proj": (h, s), "down_proj": (s, h)} if s else {}


def _adapts_shared_gate(shape: ModelShape, lora: LoraSpec) -> bool:
    return shape.shared_expert_gate and "shared_expert_gate" in lora.targets


def lora_params(shape: ModelShape, lora: LoraSpec, value_model: bool = False) -> int:
    """Trainable parameters of a LoRA model: ``rank x (in + out)`` for each adapted linear of every layer
    (``lora_A`` is rank x in, ``lora_B`` out x rank: attention, dense MLPs, shared experts and their gate), the
    :class:`ExpertTarget` factors of every sparse layer; ``rank x (vocab + h)`` for an adapted embedding or LM
    head; plus a value model's ``score`` head (``h``), which peft trains whole (``modules_to_save``: a trainable
    copy next to the frozen original, whose ``h`` parameters are left out here)."""
    r, sparse = lora.rank, shape.num_sparse_layers if shape.is_moe else 0
    dims, mlp = shape.projection_dims(), mlp_linear_targets(shape, lora)
    n = shape.num_layers * r * sum(i + o for i, o in attention_targets(shape, lora).values())
    n += (shape.num_layers - sparse) * r * sum(sum(dims[m]) for m in mlp)
    shared = _shared_expert_dims(shape)
    per_sparse = r * sum(sum(shared[m]) for m in mlp if m in shared)
    per_sparse += r * (shape.hidden_size + 1) if _adapts_shared_gate(shape, lora) else 0
    n += sparse * (per_sparse + sum(t.params for t in expert_targets(shape, lora)))
    heads = ("embed_tokens",) if value_model else ("embed_tokens", "lm_head")
    n += sum(r * (shape.vocab_size + shape.hidden_size) for m in heads if m in lora.targets)
    return n + (shape.hidden_size if value_model else 0)


def largest_lora_tensor(shape: ModelShape, lora: LoraSpec, value_model: bool = False) -> int:
    """Elements of the largest trainable tensor of a LoRA model (a factor, or the value head)."""
    dims = [*attention_targets(shape, lora).values()]
    mlp = mlp_linear_targets(shape, lora)
    if shape.num_layers > (shape.num_sparse_layers if shape.is_moe else 0):
        dims += [shape.projection_dims()[m] for m in mlp]
    if shape.is_moe:
        dims += [d for m, d in _shared_expert_dims(shape).items() if m in mlp]
    largest = max((lora.rank * max(d) for d in dims), default=0)
    largest = max([largest, *(t.largest_factor for t in expert_targets(shape, lora))])
    if lora.targets & {"embed_tokens", "lm_head"}:
        largest = max(largest, lora.rank * shape.vocab_size)
    return max(largest, shape.hidden_size if value_model else 0)


def _quantized_linears(shape: ModelShape) -> list[tuple[int, int]]:
    """``(count, in x out)`` of the ``nn.Linear`` weights of the decoder layers: attention, dense MLPs, shared
    experts and Qwen2-MoE's shared-expert gate; an MoE model's fused experts and router are not ``nn.Linear``."""
    sparse = shape.num_sparse_layers if shape.is_moe else 0
    h, s = shape.hidden_size, shape.shared_expert_intermediate_size
    out = [(shape.num_layers, i * o) for i, o in shape.attention_projection_dims().values()]
    out += [(shape.num_layers - sparse, i * o) for m, (i, o) in shape.projection_dims().items() if m in MLP_PROJECTIONS]
    if sparse and s:
        out += [(sparse, h * s)] * 3
    if sparse and shape.shared_expert_gate:
        out.append((sparse, h))
    return [(n, size) for n, size in out if n > 0]


def quantized_linear_params(shape: ModelShape) -> int:
    """Parameters QLoRA stores in 4 bit: the weights of every ``nn.Linear`` of the transformer blocks
    (bitsandbytes replaces each except the modules transformers keeps whole: LM head, value head); biases, and an
    MoE model's fused 3-D experts and router weight (plain parameters), stay in the parameter dtype."""
    return sum(n * size for n, size in _quantized_linears(shape))


def quantized_linear_count(shape: ModelShape) -> int:
    """Weights QLoRA stores in 4 bit (each with its own quantisation state, ``NF4_BYTES_PER_TENSOR``)."""
    return sum(n for n, _ in _quantized_linears(shape))


def nf4_bytes(num_params: float, num_tensors: int) -> float:
    """Bytes of ``num_params`` stored as bitsandbytes NF4 with double quantisation in ``num_tensors`` weights."""
    return num_params * NF4_BYTES_PER_PARAM + num_tensors * NF4_BYTES_PER_TENSOR


def dequantize_transient_bytes(shape: ModelShape, act_bytes: int) -> float:
    """The working memory a 4-bit layer adds: bitsandbytes dequantises the whole weight to the compute dtype for
    each forward matmul (``gemm_4bit``) and again in ``MatMul4Bit.backward``, with the double-quantised absmax
    first expanded to fp32; one layer at a time, so the largest quantised linear counts."""
    largest = max(size for _, size in _quantized_linears(shape))
    return largest * act_bytes + largest / NF4_BLOCKSIZE * 4


def _lora_inputs(dims: Mapping[str, tuple[float, float]], shared_inputs: float, rank: int, dropout: float,
                 dropout_mask_elems: float) -> float:
    """What adapted linears save for their factors: their inputs (``shared_inputs``, each tensor once) or, with
    dropout, each its own dropped input plus the mask; and ``rank`` (``lora_A``'s output) each."""
    if dropout > 0:
        return sum(i for i, _ in dims.values()) * (1 + dropout_mask_elems) + rank * len(dims)
    return shared_inputs + rank * len(dims)


def _lora_attention_elements(shape: ModelShape, lora: LoraSpec, tp: int, dropout_mask_elems: float) -> float:
    """Per token, the attention half of a LoRA layer: both norms' inputs, roped q and k, v, the attention output,
    and what its adapted projections save (the normalised input once for q, k, v; o's input is the attention
    output, already kept). MLA is counted as multi-head attention of its head size."""
    h = shape.hidden_size
    targets = attention_targets(shape, lora)
    shared = h * any(m in targets for m in ("q_proj", "k_proj", "v_proj"))
    return 2 * h + (2 * shape.q_dim + 2 * shape.kv_dim) / tp \
        + _lora_inputs(targets, shared, lora.rank, lora.dropout, dropout_mask_elems)


def _swiglu_lora_elements(dims: Mapping[str, tuple[float, float]], adapted: tuple[str, ...], lora: LoraSpec,
                          dropout_mask_elems: float, input_kept: bool = False) -> float:
    """Per token, a frozen SwiGLU MLP (``dims``: its gate / up / down) with ``adapted`` projections: gate,
    activation and up (``3i``) for the input gradient, plus the adapted projections' inputs (the MLP input, shared
    by gate and up, unless ``input_kept``; the SwiGLU product for down) and ranks."""
    width = dims["gate_proj"][1]
    targets = {m: dims[m] for m in adapted}
    shared = dims["gate_proj"][0] * (not input_kept and any(m in targets for m in ("gate_proj", "up_proj")))
    shared += width if "down_proj" in targets else 0
    return 3 * width + _lora_inputs(targets, shared, lora.rank, lora.dropout, dropout_mask_elems)


def lora_layer_elements(shape: ModelShape, lora: LoraSpec, *, tp: int = 1, dropout_mask_elems: float = 1.0) -> float:
    """Elements (of the activation dtype) autograd saves per token in one dense decoder layer of a LoRA model:
    base weights and norms frozen.

    For the input gradient, whatever trains: both norms' inputs (``2h``; their normalised inputs only serve the
    norm weights' gradient, so a frozen norm does not keep them), roped q and k, v, the attention output
    (``2q + 2kv``) and SwiGLU's gate, activation and up (``3i``). For the LoRA factors: the input of each
    adapted projection, once per tensor (the attention's normalised input ``h`` shared by q, k, v; the MLP's
    ``h`` shared by gate and up; the attention output, already kept; the SwiGLU product ``i`` for down), and
    ``rank`` (``lora_A``'s output) per adapted projection. With ``dropout > 0`` every adapted projection keeps
    its own dropped input plus the dropout mask (``dropout_mask_elems`` per input element: 1 on CPU, where
    torch's dropout multiplies by a noise tensor of the input dtype; ``1 / act_bytes`` on GPU, whose fused
    dropout keeps a bool mask) instead of the shared input. Checked with ``torch.autograd.graph.saved_tensors_hooks``
    on transformers' Llama (SDPA, fp32, all-linear / q,v / dropout 0.1): exact up to two scalars a token
    (rsqrt of the norms) and the attention's logsumexp. The MLP of an MoE model's dense layers takes adapters
    only where :func:`mlp_linear_targets` says.
    """
    dims = {m: (i, o / tp) if m != "down_proj" else (i / tp, o) for m, (i, o) in shape.projection_dims().items()}
    return _lora_attention_elements(shape, lora, tp, dropout_mask_elems) \
        + _swiglu_lora_elements(dims, mlp_linear_targets(shape, lora), lora, dropout_mask_elems)


def lora_sparse_layer_elements(shape: ModelShape, lora: LoraSpec, act_bytes: int, *,
                               dropout_mask_elems: float = 1.0) -> float:
    """Elements (of the activation dtype) autograd saves per token in one sparse layer of a LoRA MoE model.

    The attention as in :func:`lora_layer_elements`. For each of the ``top_k`` routed experts a token runs: the
    fused gate-up output (``2 moe_i``), the activation (``moe_i``) and the expert's output, kept for the routing
    weight (``h``); with adapted (merged) expert weights also their matmuls' inputs: the gathered token (``h``,
    gate-up) and the SwiGLU product (``moe_i``, down). The router's fp32 probabilities (``E``); the normalised
    input (``h``, shared by router and shared expert) when the router or the shared expert takes adapters. A
    shared expert is a frozen SwiGLU MLP with :func:`mlp_linear_targets` adapted (Qwen2-MoE), plus for a gated one
    the gate value and the shared output (``h + 1``) and, adapted, ``rank``. The routing's index tensors are left
    out, as in the full-training count. Checked with ``torch.autograd.graph.saved_tensors_hooks`` on transformers'
    Mixtral and Qwen2-MoE with all-linear in ``tests/unit/test_plan_moe_lora.py``.
    """
    h, moe_i = shape.hidden_size, shape.moe_intermediate_size
    fused = {t.name for t in expert_targets(shape, lora)}
    routed = h + 3 * moe_i + h * ("gate_up_proj" in fused) + moe_i * ("down_proj" in fused)
    n = _lora_attention_elements(shape, lora, 1, dropout_mask_elems)
    n += shape.experts_per_token * routed + shape.num_experts * ROUTER_PROB_BYTES / act_bytes
    shared_dims, mlp = _shared_expert_dims(shape), mlp_linear_targets(shape, lora)
    gate = _adapts_shared_gate(shape, lora)
    shared_adapted = [m for m in mlp if m in shared_dims]
    norm_kept = "gate.weight" in fused or gate or any(m in shared_adapted for m in ("gate_proj", "up_proj"))
    n += h * norm_kept if lora.dropout == 0 else 0
    if shared_dims:
        n += _swiglu_lora_elements(shared_dims, tuple(shared_adapted), lora, dropout_mask_elems, input_kept=True)
    if shape.shared_expert_gate:
        n += h + 1 + (_lora_inputs({"shared_expert_gate": (h, 1)}, 0, lora.rank, lora.dropout, dropout_mask_elems)
                      if gate else 0)
    return n


def lora_merged_elements(shape: ModelShape, lora: LoraSpec) -> tuple[int, int]:
    """``(elements per sparse layer, largest tensor)`` of the merged copies of the adapted fused parameters:
    peft's ``ParamWrapper`` adds ``scale B A`` to the frozen weight in each forward and the experts' (and the
    router's) matmuls save that new tensor for the backward, whatever the token count; its gradient, as large,
    exists while the backward turns it into the factors' gradients."""
    targets = expert_targets(shape, lora)
    return sum(t.weight_elements for t in targets), max((t.weight_elements for t in targets), default=0)

