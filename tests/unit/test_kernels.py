"""Kernel selection (``ds.attn_implementation``, ``ds.use_liger_kernel``) with faked packages and devices."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import sys
import types

import pytest
import torch

from hpc_rlhf.models import kernels
from hpc_rlhf.models.loading import load_causal_lm, load_value_model
from hpc_rlhf.models.tiny import build_tiny_model


@pytest.fixture(autouse=True)
def _fresh_log_memory():
    kernels._said.clear()
    kernels.import_error.cache_clear()
    yield
    kernels._said.clear()
    kernels.import_error.cache_clear()


def _ours(caplog) -> list[logging.LogRecord]:
    """Records of the kernels logger only (a model load may add transformers' own warnings)."""
    return [r for r in caplog.records if r.name == kernels.__name__]


def _fake_env(monkeypatch, modules: dict[str, str], capability: tuple[int, int] = (9, 0), cuda: bool = True,
              broken: tuple[str, ...] = ()):
    """Pretend ``modules`` (module -> distribution) are installed, and a GPU of ``capability``; importing a
    module of ``broken`` fails the way a flash-attn without its CUDA extension does."""
    real_find_spec = importlib.util.find_spec
    for name in modules:
        # None in sys.modules makes `import name` raise ImportError.
        monkeypatch.setitem(sys.modules, name, None if name in broken else types.ModuleType(name))

    def find_spec(name, *args, **kwargs):
        if name in modules:
            return importlib.machinery.ModuleSpec(name, None)
        if name in ("flash_attn", "flash_attn_interface", "liger_kernel"):
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(importlib.metadata, "packages_distributions",
                        lambda: {m: [d] for m, d in modules.items()})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)


FA2 = {"flash_attn": "flash_attn"}
FA3 = {"flash_attn_interface": "flash_attn_3"}


@pytest.mark.parametrize("modules,expected", [
    ({**FA2, **FA3}, "flash_attention_2"),
    (FA2, "flash_attention_2"),
    (FA3, "flash_attention_3"),
    ({}, "sdpa"),
    ({"flash_attn": "flash-attn-4"}, "sdpa"),  # flash-attn 4 ships the same module; not version 2
])
def test_auto_picks_flash_attn_2_then_3_then_sdpa(monkeypatch, modules, expected):
    _fake_env(monkeypatch, modules)
    assert kernels.resolve_attn_implementation("auto", on_gpu=True) == expected


def test_auto_on_cpu_is_sdpa_with_one_line(monkeypatch, caplog):
    _fake_env(monkeypatch, {**FA2, **FA3}, cuda=False)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        for _ in range(3):
            assert kernels.resolve_attn_implementation("auto", on_gpu=False) == "sdpa"
    assert len(_ours(caplog)) == 1 and "no CUDA GPU" in _ours(caplog)[0].getMessage()


@pytest.mark.parametrize("requested,modules,capability,reason", [
    ("flash_attention_2", {}, (9, 0), "'flash_attn' is not installed"),
    ("flash_attention_3", FA2, (9, 0), "'flash_attn_interface' is not installed"),
    ("flash_attention_3", FA3, (7, 5), "compute capability >= 8.0"),
    ("flash_attention_3", {"flash_attn_interface": "someone-elses-build"}, (9, 0), "'flash-attn-3' distribution"),
])
def test_explicit_flash_falls_back_to_sdpa_saying_why_once(monkeypatch, caplog, requested, modules, capability,
                                                            reason):
    _fake_env(monkeypatch, modules, capability)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.resolve_attn_implementation(requested, on_gpu=True) == "sdpa"
        assert kernels.resolve_attn_implementation(requested, on_gpu=True) == "sdpa"
    assert len(_ours(caplog)) == 1
    message = _ours(caplog)[0].getMessage()
    assert _ours(caplog)[0].levelno == logging.WARNING and requested in message and reason in message


def test_installed_flash_attn_that_does_not_import_falls_back_to_sdpa(monkeypatch, caplog):
    """e.g. built without its CUDA extension (FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE) or for another torch."""
    _fake_env(monkeypatch, FA2, broken=("flash_attn",))
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        assert kernels.resolve_attn_implementation("flash_attention_2", on_gpu=True) == "sdpa"
        assert kernels.resolve_attn_implementation("auto", on_gpu=True) == "sdpa"
    messages = [r.getMessage() for r in _ours(caplog)]
    assert len(messages) == 2 and all("'flash_attn' is installed but does not import" in m for m in messages)


@pytest.mark.parametrize("requested", ["flash_attention_2", "flash_attention_3"])
def test_explicit_flash_kept_when_usable(monkeypatch, requested):
    _fake_env(monkeypatch, {**FA2, **FA3})
    assert kernels.resolve_attn_implementation(requested, on_gpu=True) == requested


def test_eager_and_sdpa_pass_through():
    assert kernels.resolve_attn_implementation("eager", on_gpu=False) == "eager"
    assert kernels.resolve_attn_implementation("sdpa", on_gpu=True) == "sdpa"


# ---------------------------------------------------------------------------------------------- Liger

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("kernels") / "tiny", seed=0))


def _fake_liger(monkeypatch, calls: list) -> None:
    """A stand-in ``liger_kernel`` whose instance patcher records what it was asked to do."""
    root = types.ModuleType("liger_kernel")
    pkg = types.ModuleType("liger_kernel.transformers")
    patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": object(), "qwen2": object()}
    patch._apply_liger_kernel_to_instance = lambda model, **kw: calls.append((model, kw))
    root.transformers, pkg.monkey_patch = pkg, patch
    for name, module in (("liger_kernel", root), ("liger_kernel.transformers", pkg),
                         ("liger_kernel.transformers.monkey_patch", patch)):
        monkeypatch.setitem(sys.modules, name, module)


def test_liger_applied_to_causal_lm_and_value_model(monkeypatch, caplog, tiny_path):
    calls: list = []
    _fake_env(monkeypatch, {"liger_kernel": "liger_kernel"})
    _fake_liger(monkeypatch, calls)
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        actor = load_causal_lm(tiny_path, torch.float32, "sdpa", use_liger_kernel=True)
        critic = load_value_model(tiny_path, torch.float32, "sdpa", use_liger_kernel=True)
    assert [c[0] for c in calls] == [actor, critic]
    for _, kw in calls:
        # forward stays the model's own: no fused linear cross-entropy (it would turn a critic into an LM)
        assert kw["fused_linear_cross_entropy"] is False and kw["cross_entropy"] is False
        assert kw["rms_norm"] and kw["swiglu"] and kw["rope"]
    assert len(_ours(caplog)) == 1 and "Liger kernels applied to llama" in _ours(caplog)[0].getMessage()


def test_liger_skips_unsupported_model_type(monkeypatch, caplog, tiny_path):
    calls: list = []
    _fake_env(monkeypatch, {"liger_kernel": "liger_kernel"})
    _fake_liger(monkeypatch, calls)
    sys.modules["liger_kernel.transformers.monkey_patch"].MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": object()}
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        load_causal_lm(tiny_path, torch.float32, "sdpa", use_liger_kernel=True)
    assert calls == [] and "no kernels for model type 'llama'" in caplog.text


@pytest.mark.parametrize("installed,cuda,reason", [
    (False, True, "liger-kernel is not installed"),
    (True, False, "need a CUDA GPU"),
])
def test_liger_fallback_logs_one_line_and_keeps_plain_modules(monkeypatch, caplog, tiny_path, installed, cuda,
                                                              reason):
    calls: list = []
    _fake_env(monkeypatch, {"liger_kernel": "liger_kernel"} if installed else {}, cuda=cuda)
    if installed:
        _fake_liger(monkeypatch, calls)
    plain = load_causal_lm(tiny_path, torch.float32, "sdpa")
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        models = [load_causal_lm(tiny_path, torch.float32, "sdpa", use_liger_kernel=True) for _ in range(2)]
    assert calls == []
    assert len(_ours(caplog)) == 1 and reason in _ours(caplog)[0].getMessage()
    ids = torch.tensor([[5, 6, 7, 8]])
    for model in models:
        assert type(model.model.norm).forward is type(plain.model.norm).forward
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_liger_off_never_looks(monkeypatch, tiny_path):
    def boom(*a, **k):
        raise AssertionError("liger looked up although ds.use_liger_kernel is false")

    monkeypatch.setattr(kernels, "liger_unavailable_reason", boom)
    load_causal_lm(tiny_path, torch.float32, "sdpa")
