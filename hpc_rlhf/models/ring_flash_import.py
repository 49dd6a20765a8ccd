"""Import ``ring_flash_attn`` (the ``ring_flash`` sequence-parallel backend) under transformers 5, once.

ring-flash-attn 0.1.8 (the newest release) imports, at the top of ``ring_flash_attn/adapters/hf_adapter.py``,
``is_flash_attn_greater_or_equal_2_10`` from ``transformers.modeling_flash_attention_utils`` in both branches
of a try/except; transformers 5 no longer defines that name there, so ``import ring_flash_attn`` raises
``ImportError`` although the package is installed and the kernels we call (``llama3_flash_attn_varlen_func``,
``llama3_flash_attn_prepare_cu_seqlens``) do not use it. In transformers 4 the name was the function
``transformers.utils.is_flash_attn_greater_or_equal_2_10`` (flash-attn >= 2.1.0), which the adapter only
tests for truth. ``load_ring_flash_attn`` puts an equivalent function there when it is missing, then imports.

The outcome is cached per process: ``ring_flash_attn_status`` says whether the package is usable and, when it
is not, why, telling "not installed" apart from "installed but its import fails" (then with the error).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass
from types import ModuleType

from packaging.version import Version

MISSING_NAME = "is_flash_attn_greater_or_equal_2_10"
UTILS_MODULE = "transformers.modeling_flash_attention_utils"
INSTALL_HINT = ("ring-flash-attn (pip install ring-flash-attn) and flash-attn (docs/gpu.md, section Install) "
                "on a CUDA machine")


@dataclass(frozen=True)
class RingFlashAttnStatus:
    """``module`` when ``import ring_flash_attn`` works here; else ``installed`` and ``reason`` say why not."""

    module: ModuleType | None
    installed: bool
    reason: str | None = None

    @property
    def usable(self) -> bool:
        return self.module is not None


def _flash_attn_at_least_2_1() -> bool:
    """transformers 4's ``is_flash_attn_greater_or_equal_2_10()``: flash-attn >= 2.1.0 (bottom-right causal mask)."""
    try:
        return Version(importlib.metadata.version("flash-attn")) >= Version("2.1.0")
    except importlib.metadata.PackageNotFoundError:
        return False


def add_missing_transformers_name() -> bool:
    """Define ``is_flash_attn_greater_or_equal_2_10`` in transformers' flash-attention utils when it is missing
    (transformers 5). True when it was added, False when it was there already."""
    utils = importlib.import_module(UTILS_MODULE)
    if hasattr(utils, MISSING_NAME):
        return False
    setattr(utils, MISSING_NAME, _flash_attn_at_least_2_1)
    return True


@functools.cache
def ring_flash_attn_status() -> RingFlashAttnStatus:
    """Try the real import once per process (with the transformers 5 shim); never raises."""
    if importlib.util.find_spec("ring_flash_attn") is None:
        return RingFlashAttnStatus(None, installed=False,
                                   reason=f"ring-flash-attn is not installed; needs {INSTALL_HINT}")
    try:
        add_missing_transformers_name()
        module = importlib.import_module("ring_flash_attn")
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party import means "unusable", with its cause
        sys.modules.pop("ring_flash_attn", None)  # no half-imported package left behind
        return RingFlashAttnStatus(None, installed=True,
                                   reason=f"ring-flash-attn is installed but `import ring_flash_attn` fails: "
                                          f"{type(exc).__name__}: {exc}")
    return RingFlashAttnStatus(module, installed=True)


def load_ring_flash_attn() -> ModuleType:
    """The ``ring_flash_attn`` module, or ``ImportError`` saying why it cannot be used here."""
    status = ring_flash_attn_status()
    if status.module is None:
        raise ImportError(f"the ring_flash sequence-parallel backend cannot run: {status.reason} "
                          "(backend='auto' falls back to the exact `ring` backend)")
    return status.module
