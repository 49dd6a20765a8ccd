"""The ring_flash backend's import: transformers 5 shim, "not installed" vs "installed but broken", fallback.

No GPU and no ring-flash-attn needed: small stand-in packages named ``ring_flash_attn`` are written to a
temporary directory. ``test_real_package_imports_with_the_shim`` runs the real ring-flash-attn source when it
is installed here (with flash-attn's interface stubbed where flash-attn itself is missing).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

import pytest
import torch

from hpc_rlhf.models import ring_flash_import
from hpc_rlhf.models import sequence_parallel as sp

# What ring-flash-attn 0.1.8's adapters/hf_adapter.py does at import time (both branches of its try/except
# import the same name), followed by the kernel entry point the backend calls.
TRANSFORMERS_4_STYLE_IMPORT = """
import transformers.modeling_flash_attention_utils
from transformers.modeling_flash_attention_utils import is_flash_attn_greater_or_equal_2_10

def llama3_flash_attn_varlen_func(*args, **kwargs):
    return "kernel"
"""


def _without_the_transformers_4_name(monkeypatch) -> None:
    """transformers 5's state; undone after the test (setattr first so that monkeypatch records the original)."""
    utils = importlib.import_module(ring_flash_import.UTILS_MODULE)
    monkeypatch.setattr(utils, ring_flash_import.MISSING_NAME, None, raising=False)
    monkeypatch.delattr(utils, ring_flash_import.MISSING_NAME)


@pytest.fixture
def fresh_import(monkeypatch, tmp_path):
    """A clean import state; yields a function that installs a stand-in ``ring_flash_attn`` package."""
    _without_the_transformers_4_name(monkeypatch)
    monkeypatch.delitem(sys.modules, "ring_flash_attn", raising=False)
    ring_flash_import.ring_flash_attn_status.cache_clear()
    sp._FALLBACKS_LOGGED.clear()

    def install(init_source: str) -> None:
        package = tmp_path / "ring_flash_attn"
        package.mkdir()
        (package / "__init__.py").write_text(init_source)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()

    yield install
    sys.modules.pop("ring_flash_attn", None)
    ring_flash_import.ring_flash_attn_status.cache_clear()


def _packed_shard():
    return sp.shard_for_sp(torch.ones(1, 4, dtype=torch.long), sp_rank=0, sp_size=1, pack=True)


def test_shim_makes_a_transformers_4_style_import_work(fresh_import):
    fresh_import(TRANSFORMERS_4_STYLE_IMPORT)
    with pytest.raises(ImportError, match="is_flash_attn_greater_or_equal_2_10"):
        importlib.import_module("ring_flash_attn")  # what users hit without the shim
    sys.modules.pop("ring_flash_attn", None)

    status = ring_flash_import.ring_flash_attn_status()
    assert status.usable and status.installed and status.reason is None, status
    assert ring_flash_import.load_ring_flash_attn().llama3_flash_attn_varlen_func() == "kernel"
    # A CUDA device object needs no GPU: auto picks the fast backend once the import works.
    assert sp.resolve_backend("auto", _packed_shard(), torch.device("cuda")) == "ring_flash"
    assert sp.resolve_backend("auto", _packed_shard(), torch.device("cpu")) == "ring"
    # The shim keeps transformers 4's meaning (flash-attn >= 2.1.0): False here, without flash-attn.
    injected = getattr(importlib.import_module(ring_flash_import.UTILS_MODULE), ring_flash_import.MISSING_NAME)
    assert injected() is (importlib.util.find_spec("flash_attn") is not None)
    assert ring_flash_import.add_missing_transformers_name() is False  # present now: left alone


def test_installed_but_broken_falls_back_on_auto_and_fails_when_asked_for(fresh_import, caplog):
    fresh_import("import flash_attn_is_not_here_either\n")
    status = ring_flash_import.ring_flash_attn_status()
    assert status.installed and not status.usable
    assert "installed but `import ring_flash_attn` fails" in status.reason
    assert "flash_attn_is_not_here_either" in status.reason
    assert "ring_flash_attn" not in sys.modules

    with caplog.at_level(logging.INFO, logger=sp.__name__):
        for _ in range(3):
            assert sp.resolve_backend("auto", _packed_shard(), torch.device("cuda")) == "ring"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "flash_attn_is_not_here_either" in warnings[0].getMessage()

    model = types.SimpleNamespace(config=types.SimpleNamespace(
        num_key_value_heads=2, num_attention_heads=4, _attn_implementation="sdpa"))
    with pytest.raises(ImportError, match="installed but .*flash_attn_is_not_here_either"):
        with sp.sequence_parallel_attention(model, None, _packed_shard(), backend="ring_flash"):
            pass
    assert model.config._attn_implementation == "sdpa"


def test_status_is_cached(fresh_import):
    fresh_import(TRANSFORMERS_4_STYLE_IMPORT)
    first = ring_flash_import.ring_flash_attn_status()
    assert ring_flash_import.ring_flash_attn_status() is first


FLASH_INTERFACE_NAMES = ("_flash_attn_forward", "_flash_attn_backward", "_flash_attn_varlen_forward",
                         "_flash_attn_varlen_backward")


@pytest.mark.skipif(importlib.util.find_spec("ring_flash_attn") is None, reason="ring-flash-attn is not installed")
def test_real_package_imports_with_the_shim(monkeypatch):
    """The real ring_flash_attn source under this transformers; flash-attn's interface stubbed if it is absent
    (its kernels are not called here, only imported by name)."""
    if importlib.util.find_spec("flash_attn") is None:
        interface = types.ModuleType("flash_attn.flash_attn_interface")
        for name in FLASH_INTERFACE_NAMES:
            setattr(interface, name, lambda *a, **k: None)
        package = types.ModuleType("flash_attn")
        package.flash_attn_interface = interface
        monkeypatch.setitem(sys.modules, "flash_attn", package)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    monkeypatch.delitem(sys.modules, "ring_flash_attn", raising=False)
    _without_the_transformers_4_name(monkeypatch)
    ring_flash_import.ring_flash_attn_status.cache_clear()
    try:
        status = ring_flash_import.ring_flash_attn_status()
        assert status.usable, status.reason
        assert callable(status.module.llama3_flash_attn_varlen_func)
        assert callable(status.module.llama3_flash_attn_prepare_cu_seqlens)
    finally:
        for name in [m for m in sys.modules if m == "ring_flash_attn" or m.startswith("ring_flash_attn.")]:
            sys.modules.pop(name)
        ring_flash_import.ring_flash_attn_status.cache_clear()
