"""LoRA and QLoRA terms of ``hpc-rlhf plan``'s memory model: adapter parameters, NF4 bytes of a 4-bit base,
the dequantisation transient and the activations a LoRA layer saves. Pure Python.

LoRA (``ds.lora.rank > 0``, peft) on the trained roles (actor, critic; the offline trainers' model):

- the base weights stay as they are (replicated at stages 0-2, partitioned only at stage 3) and are frozen;
  the LoRA factors (``rank x (in + out)`` per targeted linear, ``lora_params``) plus, for a value model, a
  trainable copy of its ``score`` head (peft ``modules_to_save``) are the only trainable parameters: only they
  have gradients, Adam states, a master copy and DeepSpeed buffers; they are stored next to the base weights;
- activations: the frozen norms no longer save their normalised inputs (``-2h`` per layer and token), the
  input of a targeted projection is saved once for its ``lora_A``, each targeted projection adds ``rank``
  (the ``lora_A`` output), and with ``ds.lora.dropout > 0`` each targeted projection saves its dropped input
  and the dropout mask instead (``lora_layer_elements``, counted with autograd's saved tensors).

QLoRA (``ds.lora.load_in_4bit``; refused with ZeRO-3 and tensor parallelism by the config) stores the linear
layers of the transformer blocks of the actor, critic and reference (and of the offline trainers' model and
reference) as bitsandbytes NF4 with double quantisation: ``NF4_BYTES_PER_PARAM`` (0.516) bytes a parameter
plus ``NF4_BYTES_PER_TENSOR`` a weight; embeddings, LM head, norms and value heads keep the parameter dtype,
and the RL reward model is not quantised. A 4-bit layer dequantises its whole weight to the compute dtype in
every forward and backward (bitsandbytes' ``gemm_4bit`` and ``MatMul4Bit.backward``): one layer's weight
(the largest projection) is added to the working set.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_rlhf.config.schema import LoraConfig
from hpc_rlhf.planning.model_shape import LAYER_PROJECTIONS, ModelShape

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


def lora_target_names(target_modules: list[str]) -> tuple[frozenset[str], tuple[str, ...]]:
    """``(module names adapted, entries not counted)`` of a ``ds.lora.target_modules`` list.

    ``"all-linear"`` is every projection of every decoder layer (peft leaves the output layer out); any other
    entry matches modules by its last name part, as peft matches suffixes (``"q_proj"``,
    ``"self_attn.q_proj"``). Besides the layer projections, ``"lm_head"`` and ``"embed_tokens"`` are counted;
    an entry naming nothing of the Llama layout comes back in the second element.
    """
    known = {*LAYER_PROJECTIONS, "lm_head", "embed_tokens"}
    names: set[str] = set()
    ignored: list[str] = []
    for entry in target_modules:
        if entry == "all-linear":
            names.update(LAYER_PROJECTIONS)
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

    def layer_targets(self) -> tuple[str, ...]:
        return tuple(m for m in LAYER_PROJECTIONS if m in self.targets)


def lora_params(shape: ModelShape, lora: LoraSpec, value_model: bool = False) -> int:
    """Trainable parameters of a LoRA model: ``rank x (in + out)`` for each adapted linear of every layer
    (``lora_A`` is rank x in, ``lora_B`` out x rank); ``rank x (vocab + h)`` for an adapted embedding or LM
    head; plus a value model's ``score`` head (``h``), which peft trains whole (``modules_to_save``: a trainable
    copy next to the frozen original, whose ``h`` parameters are left out here)."""
    dims = shape.projection_dims()
    n = shape.num_layers * lora.rank * sum(sum(dims[m]) for m in lora.layer_targets())
    heads = ("embed_tokens",) if value_model else ("embed_tokens", "lm_head")
    n += sum(lora.rank * (shape.vocab_size + shape.hidden_size) for m in heads if m in lora.targets)
    return n + (shape.hidden_size if value_model else 0)


def largest_lora_tensor(shape: ModelShape, lora: LoraSpec, value_model: bool = False) -> int:
    """Elements of the largest trainable tensor of a LoRA model (a factor, or the value head)."""
    dims = shape.projection_dims()
    largest = max((lora.rank * max(dims[m]) for m in lora.layer_targets()), default=0)
    if lora.targets & {"embed_tokens", "lm_head"}:
        largest = max(largest, lora.rank * shape.vocab_size)
    return max(largest, shape.hidden_size if value_model else 0)


def quantized_linear_params(shape: ModelShape) -> int:
    """Parameters QLoRA stores in 4 bit: every linear layer of the transformer blocks (bitsandbytes replaces each
    ``nn.Linear`` except the modules transformers keeps whole: LM head, value head)."""
    return shape.num_layers * shape.layer_linear_params


def nf4_bytes(num_params: float, num_tensors: int) -> float:
    """Bytes of ``num_params`` stored as bitsandbytes NF4 with double quantisation in ``num_tensors`` weights."""
    return num_params * NF4_BYTES_PER_PARAM + num_tensors * NF4_BYTES_PER_TENSOR


def dequantize_transient_bytes(shape: ModelShape, act_bytes: int) -> float:
    """The working memory a 4-bit layer adds: bitsandbytes dequantises the whole weight to the compute dtype for
    each forward matmul (``gemm_4bit``) and again in ``MatMul4Bit.backward``, with the double-quantised absmax
    first expanded to fp32; one layer at a time, so the largest projection counts."""
    largest = max(i * o for i, o in shape.projection_dims().values())
    return largest * act_bytes + largest / NF4_BLOCKSIZE * 4


def lora_layer_elements(shape: ModelShape, lora: LoraSpec, *, tp: int = 1, dropout_mask_elems: float = 1.0) -> float:
    """Elements (of the activation dtype) autograd saves per token in one decoder layer of a LoRA model: base
    weights and norms frozen.

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
    (rsqrt of the norms) and the attention's logsumexp.
    """
    h, q, kv, i = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    targets = lora.layer_targets()
    n = 2 * h + (2 * q + 2 * kv + 3 * i) / tp
    if lora.dropout > 0:
        dims = shape.projection_dims()
        n += sum(dims[m][0] for m in targets) * (1 + dropout_mask_elems)
    else:
        n += h * (any(m in targets for m in ("q_proj", "k_proj", "v_proj"))
                  + any(m in targets for m in ("gate_proj", "up_proj")))
        n += i / tp if "down_proj" in targets else 0
    return n + lora.rank * len(targets)
