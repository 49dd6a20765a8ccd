"""The RL trainer's modules each run on one known set of ranks, and the controller's story asks no rank: it is rank
0's alone, and what differs between ranks is the role workers' business (``hpc_rlhf.trainers.rl.role_worker``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RL = Path(__file__).resolve().parents[2] / "hpc_rlhf" / "trainers" / "rl"
CONTROLLER_MODULES = ("controller.py", "async_controller.py")
RANK_WORDS = ("rank", "is_controller", "get_rank", "CONTROLLER")


def _rank_references(source: str) -> list[str]:
    """Names, attributes and imports in ``source`` that ask which rank the code runs on."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name is not None and any(word in name for word in RANK_WORDS):
            found.append(f"line {node.lineno}: {name}")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            found += [f"line {node.lineno}: import {m}" for m in modules if m.startswith("torch.distributed")]
    return found


@pytest.mark.parametrize("module", CONTROLLER_MODULES)
def test_the_controller_asks_no_rank(module):
    assert _rank_references((RL / module).read_text()) == []


def test_the_rank_check_finds_a_rank_test():
    source = "def step(self):\n    if self.world.is_controller:\n        return dist.get_rank()\n"
    assert _rank_references(source) == ["line 2: is_controller", "line 3: get_rank"]


@pytest.mark.parametrize("path", sorted(p for p in RL.glob("*.py") if p.name != "__init__.py"), ids=lambda p: p.name)
def test_every_rl_module_says_which_ranks_it_runs_on(path):
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Runs on" in doc or "runs on any rank" in doc, f"{path.name}: its docstring must say which ranks run it"
