"""The table of vLLM names cannot drift from the engines, and the contract script's checks can fail.

The contract itself runs against real vLLM packages in separate environments (docs/gpu.md, "vLLM contract");
here its checks run on small fake modules written to a temporary directory.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from hpc_rlhf.rollout import vllm_api, vllm_contract
from hpc_rlhf.rollout.vllm_api import VLLM_NAMES, VllmName, resolve

ENGINES = Path(vllm_api.__file__).parent
# Which vLLM object each engine holds under which attribute.
HELD = {"vllm_external_launcher.py": ("self.llm", "vllm:LLM"), "vllm_server.py": ("self.engine", "vllm:AsyncLLMEngine")}


def _resolve_literals(source: str) -> set[str]:
    return {node.args[0].value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "resolve"
            and node.args and isinstance(node.args[0], ast.Constant)}


def test_every_resolved_path_is_declared():
    used = set()
    for path in ENGINES.glob("*.py"):
        if path.name in ("vllm_api.py", "vllm_contract.py"):
            continue
        used |= _resolve_literals(path.read_text())
    assert used, "the engines resolve vLLM names through vllm_api.resolve"
    assert used <= set(VLLM_NAMES), sorted(used - set(VLLM_NAMES))


@pytest.mark.parametrize("filename", sorted(HELD))
def test_every_method_called_on_a_vllm_object_is_declared(filename):
    holder, prefix = HELD[filename]
    source = (ENGINES / filename).read_text()
    called = set(re.findall(re.escape(holder) + r"\.(\w+)\(", source))
    assert called
    declared = {p.removeprefix(prefix + ".") for p in VLLM_NAMES if p.startswith(prefix + ".")}
    assert called - {"from_engine_args"} <= declared, sorted(called - declared)
    # and nothing declared for this object is left unused (a stale entry would be checked for nothing)
    assert declared - {"from_engine_args"} <= called, sorted(declared - called)


def test_resolve_refuses_an_undeclared_path():
    with pytest.raises(KeyError, match="declare it"):
        resolve("vllm:LLM.chat")


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """``fakevllm.api`` imports; ``fakevllm.gpu_only`` raises ImportError at import, as CUDA-bound modules do."""
    pkg = tmp_path / "fakevllm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = ("class Engine:\n"
            "    def __init__(self, model, seed=0):\n"
            "        self.runner = None\n"
            "    def generate(self, prompts, sampling_params):\n"
            "        return []\n")
    (pkg / "api.py").write_text(body)
    (pkg / "gpu_only.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.startswith("fakevllm")]:
        del sys.modules[name]


@pytest.mark.parametrize("module, how", [("fakevllm.api", "import"), ("fakevllm.gpu_only", "ast")])
def test_contract_checks_parameters_and_fields(monkeypatch, fake_package, module, how):
    entries = [VllmName(f"{module}:Engine.generate", ("prompts", "sampling_params")),
               VllmName(f"{module}:Engine.generate", ("prompts", "use_tqdm")),
               VllmName(f"{module}:Engine", ("model", "seed"), fields=("runner",)),
               VllmName(f"{module}:Engine", fields=("model_runner",)),
               VllmName(f"{module}:Engine.sleep")]
    results = []
    for entry in entries:
        monkeypatch.setitem(VLLM_NAMES, entry.path, entry)
        results.append(vllm_contract.check_name(entry))
    assert [r.how for r in results] == [how] * 5
    assert [r.ok for r in results] == [True, False, True, False, False], results
    assert "use_tqdm" in results[1].detail and "model_runner" in results[3].detail


def test_contract_reports_gpu_packages(monkeypatch):
    monkeypatch.setattr(vllm_contract, "GPU_PACKAGES", (("json", "pytest"), ("no_such_module_x", "no-such-dist-x")))
    checks = vllm_contract.gpu_package_checks()
    assert [(c.ok, c.detail.split()[0]) for c in checks] == [(True, "pytest"), (True, "not")]
    monkeypatch.setattr(vllm_contract, "GPU_PACKAGES", (("no_such_module_x", "pytest"),))
    broken = vllm_contract.gpu_package_checks()[0]  # installed (per metadata) but the import fails
    assert not broken.ok and "import failed" in broken.detail
