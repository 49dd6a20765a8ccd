"""4-bit base weights for QLoRA (``ds.lora.load_in_4bit``): loading them, and reading them back in full precision.

A QLoRA role loads its checkpoint with bitsandbytes' NF4 quantisation (double quantisation, compute in the
training dtype): each ``nn.Linear`` of the transformer blocks becomes a ``bnb.nn.Linear4bit`` whose
``weight`` is a packed ``Params4bit`` (uint8, shape ``(out * in / 2, 1)``) with its scales in
``weight.quant_state``. Only the LoRA factors train; the 4-bit weights are frozen.

Everything that leaves the training process (weight sync to the rollout engine, the HF export, the
optimizer-free gathers) must see plain tensors: ``plain_copy`` dequantises a ``Params4bit`` into the
``(out, in)`` weight the quantised model computes with (NF4 is lossy, so this is *not* the original checkpoint
weight; it is the one the trained policy actually used, which is what the rollout engine must generate with).

bitsandbytes runs 4-bit layers on CPU too (its torch backend; verified with 0.50), so QLoRA is tested on CPU.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from transformers import BitsAndBytesConfig

if TYPE_CHECKING:
    from bitsandbytes.functional import QuantState
    from bitsandbytes.nn import Params4bit

log = logging.getLogger(__name__)
QUANTIZED_WEIGHT_TYPES = ("Params4bit",)
# bitsandbytes' switch on a Linear4bit for its CPU inference kernel (see keep_cpu_numerics_exact)
_CPU_KERNEL_SWITCH = "support_avx512bf16_for_cpu"


def check_4bit_available() -> None:
    """``ds.lora.load_in_4bit`` needs bitsandbytes; fail before any model is loaded and say so."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError("ds.lora.load_in_4bit=true needs the bitsandbytes package (pip install bitsandbytes); "
                           "set ds.lora.load_in_4bit=false to train LoRA on unquantised weights")


def bnb_4bit_load_kwargs(compute_dtype: torch.dtype, on_gpu: bool) -> dict[str, Any]:
    """Extra ``from_pretrained`` kwargs for a QLoRA base model (NF4, double quantisation).

    On GPU the weights are quantised straight onto this process's device (``device_map``): bitsandbytes
    quantises when a ``Params4bit`` first moves to an accelerator, and a later ``.to(device)`` of the whole
    model by DeepSpeed then finds it already there.
    """
    check_4bit_available()
    kwargs: dict[str, Any] = {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype)}
    if on_gpu:
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    return kwargs


def keep_cpu_numerics_exact(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off bitsandbytes' CPU inference kernel in every 4-bit layer of ``model``; returns ``model``.

    In eval mode without grad, on a CPU with AVX512-BF16, bitsandbytes (0.50) repacks a ``Params4bit`` in
    place into a kernel layout and computes in bf16 (logits differ by ~3e-3 from its training path). The RL
    experience forwards run exactly so, and their logprobs would then differ from the training forward's:
    PPO's ratio would not be 1 on policy. The repacked weight also no longer dequantises correctly.
    """
    for module in model.modules():
        if hasattr(module, _CPU_KERNEL_SWITCH):
            setattr(module, _CPU_KERNEL_SWITCH, False)
    return model


def warn_unquantized_weights(model: torch.nn.Module, key: str = "ds.lora.load_in_4bit") -> int:
    """Log how many of a 4-bit model's parameters bitsandbytes left unquantised beyond embeddings, norms and heads:
    it quantises ``nn.Linear`` weights only, and transformers 5 holds a mixture-of-experts layer's experts (most of
    an MoE model) and its router as plain parameters, which then stay in the compute dtype. Returns that count."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    heads = {id(p) for name in ("lm_head", "score") for p in getattr(model, name, torch.nn.Module()).parameters()}
    left = {n: p for n, p in model.named_parameters()
            if p.dim() >= 2 and not is_quantized(p) and id(p) not in embeddings | heads}
    count = sum(p.numel() for p in left.values())
    if count:
        total = sum(p.numel() for p in model.parameters() if not is_quantized(p)) + sum(
            2 * p.numel() for p in model.parameters() if is_quantized(p))  # two 4-bit codes a byte
        log.warning("%s: bitsandbytes quantises nn.Linear weights only; %d parameters (%.0f%% of the model; e.g. %s) "
                    "stay in %s: size the memory for them (hpc-rlhf plan counts them)", key, count,
                    100 * count / max(total, 1), next(iter(left)), next(iter(left.values())).dtype)
    return count


def is_quantized(tensor: torch.Tensor) -> TypeGuard[Params4bit]:
    """Whether ``tensor`` is a bitsandbytes 4-bit weight (by class name: bitsandbytes is imported only by QLoRA)."""
    return type(tensor).__name__ in QUANTIZED_WEIGHT_TYPES


def quant_state(weight: Params4bit) -> QuantState:
    """The quantisation state (shape, dtype, scales) of a 4-bit weight.

    Raises:
        ValueError: the weight has none yet (bitsandbytes quantises when the weight is moved to its device).
    """
    if weight.quant_state is None:
        raise ValueError("a 4-bit weight has no quantisation state yet: bitsandbytes quantises it when the model is "
                         "moved to its device; load 4-bit models with hpc_rlhf.models.loading")
    return weight.quant_state


@torch.no_grad()
def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """The full-precision value of a weight, detached: a 4-bit weight dequantised to ``(out, in)`` into a new
    tensor, anything else as it is (no copy)."""
    if not is_quantized(tensor):
        return tensor.detach()
    from peft.utils.integrations import dequantize_bnb_weight  # peft: only QLoRA runs reach here (see models/lora)

    state = quant_state(tensor)
    if getattr(state, "packing_format_for_cpu", False):
        raise RuntimeError("a 4-bit weight was repacked for bitsandbytes' CPU inference kernel and cannot be "
                           "dequantised; load 4-bit models with hpc_rlhf.models.loading (keep_cpu_numerics_exact)")
    return dequantize_bnb_weight(tensor, state=state).detach()


def plain_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A detached full-precision copy that owns its memory (a dequantised 4-bit weight already does)."""
    return dequantized(tensor) if is_quantized(tensor) else tensor.detach().clone()


def plain_config(config: Any) -> Any:
    """A copy of a HF ``PretrainedConfig`` without ``quantization_config``: what a folder of dequantised
    (plain) weights must say, or ``from_pretrained`` would try to load it as a bitsandbytes checkpoint."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config
