"""Optional GPU kernels: flash-attn 2 / 3 for attention (``ds.attn_implementation``) and Liger's Triton
kernels (``ds.use_liger_kernel``). Each is used when it is installed and can run here; otherwise the
model keeps SDPA / its plain modules and ONE log line per process says why.

Detection follows what transformers 5 itself checks before it accepts an implementation
(``transformers.modeling_flash_attention_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX``), and then imports the
module, once, since an installed package can still fail to load its CUDA extension:

- ``flash_attention_2``: module ``flash_attn`` owned by the ``flash-attn`` distribution (flash-attn 4
  ships the same module under ``flash-attn-4``, which transformers does not take for version 2), CUDA;
- ``flash_attention_3``: module ``flash_attn_interface`` owned by the ``flash-attn-3`` distribution (the
  ``hopper/`` build of Dao-AILab/flash-attention), CUDA, compute capability >= 8 (built for Hopper, sm90).

``auto`` takes flash-attn 2 when present (the kernel ring-flash-attn builds on), else flash-attn 3, else SDPA.

Liger (``liger_kernel.transformers``) is applied to a loaded model instance the way transformers'
Trainer does it (``_apply_liger_kernel_to_instance``), with RoPE, RMSNorm and SwiGLU kernels only: the
fused linear cross-entropy replaces ``model.forward`` by a causal-LM loss forward (wrong for a critic,
and useless here since logprobs are taken from logits, not from ``labels``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging

import torch

log = logging.getLogger(__name__)

FLASH_PACKAGES = {
    # implementation: (module, distribution, minimum CUDA compute capability major)
    "flash_attention_2": ("flash_attn", "flash-attn", 0),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3", 8),
}
LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                 "fused_linear_cross_entropy": False}

_said: set[str] = set()


def _log_once(level: int, message: str) -> None:
    """Every trainer resolves kernels for several roles; the reason is worth one line, not one per model."""
    if message not in _said:
        _said.add(message)
        log.log(level, message)


def _distributions(module: str) -> list[str]:
    names = importlib.metadata.packages_distributions().get(module, [])
    return [n.lower().replace("_", "-") for n in names]


def flash_unavailable_reason(implementation: str, on_gpu: bool) -> str | None:
    """None when ``implementation`` (flash_attention_2 / _3) can run here, else why not."""
    module, dist, min_major = FLASH_PACKAGES[implementation]
    if not on_gpu:
        return "no CUDA GPU"
    if importlib.util.find_spec(module) is None:
        return f"module {module!r} is not installed (pip install {dist})"
    if dist not in _distributions(module):
        return f"module {module!r} does not come from the {dist!r} distribution that transformers expects"
    if min_major and torch.cuda.get_device_capability()[0] < min_major:
        return f"needs CUDA compute capability >= {min_major}.0"
    error = import_error(module)
    if error is not None:
        # e.g. a flash-attn installed without its CUDA extension (FLASH_ATTENTION_SKIP_CUDA_BUILD) or built
        # for another torch: transformers checks only the metadata and would fail at the first forward.
        return f"module {module!r} is installed but does not import ({error}); reinstall it as docs/gpu.md says"
    return None


@functools.cache
def import_error(module: str) -> str | None:
    """None when ``module`` imports, else the error (tried once per process: it loads the CUDA extension)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - an ImportError, or an OSError / RuntimeError of a broken binary
        return f"{type(exc).__name__}: {exc}"
    return None


def resolve_attn_implementation(requested: str, on_gpu: bool) -> str:
    """The attention implementation to load models with: flash-attn where asked (or ``auto``) and usable,
    else ``sdpa``, saying once why."""
    if requested in ("eager", "sdpa"):
        return requested
    if requested == "auto":
        reasons = {}
        for implementation in FLASH_PACKAGES:
            reasons[implementation] = flash_unavailable_reason(implementation, on_gpu)
            if reasons[implementation] is None:
                _log_once(logging.INFO, f"ds.attn_implementation=auto: using {implementation}")
                return implementation
        why = "; ".join(f"{impl}: {reason}" for impl, reason in reasons.items())
        _log_once(logging.INFO, f"ds.attn_implementation=auto: using sdpa ({why})")
        return "sdpa"
    if requested not in FLASH_PACKAGES:
        raise ValueError(f"ds.attn_implementation={requested!r}: expected auto, eager, sdpa, "
                         f"{', '.join(FLASH_PACKAGES)}")
    reason = flash_unavailable_reason(requested, on_gpu)
    if reason is None:
        return requested
    _log_once(logging.WARNING, f"ds.attn_implementation={requested} unavailable ({reason}); falling back to sdpa")
    return "sdpa"


def liger_unavailable_reason() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if not torch.cuda.is_available():
        return "its Triton kernels need a CUDA GPU"
    return None


def apply_liger_kernel(model: torch.nn.Module) -> bool:
    """Swap Liger's RoPE / RMSNorm / SwiGLU kernels into ``model`` in place; True when applied.

    When Liger cannot run here, or has no kernels for this model type, the model keeps its plain modules
    and one line says so.
    """
    reason = liger_unavailable_reason()
    if reason is None:
        from liger_kernel.transformers import monkey_patch  # optional GPU extra, present when reason is None

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", {}):
            reason = f"it has no kernels for model type {model_type!r}"
        else:
            monkey_patch._apply_liger_kernel_to_instance(model=model, **LIGER_KERNELS)
            _log_once(logging.INFO, f"ds.use_liger_kernel: Liger kernels applied to {model_type} "
                                    f"({', '.join(k for k, on in LIGER_KERNELS.items() if on)})")
            return True
    _log_once(logging.WARNING, f"ds.use_liger_kernel=true but {reason}; continuing with plain modules")
    return False
