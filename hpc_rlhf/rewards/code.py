"""Rewards from unit tests: run a model's Python program in the sandbox against a sample's tests.

A sample's tests (the dataset label, a dict or its JSON text) take one of three forms:

* ``{"asserts": ["assert add(1, 2) == 3", ...], "setup": "import math"}``: MBPP style; each assert is one test.
* ``{"test": "def check(candidate): ...", "entry_point": "add"}``: HumanEval style; ``check(add)`` is one test.
* ``{"io": [{"input": "1 2\\n", "output": "3\\n"}, ...]}``: competitive-programming style; the program reads
  stdin, and a test passes when its stdout equals the expected output up to trailing whitespace per line.

Any form may add ``"time_limit_s"`` (per test). Every test is its own execution, so a program cannot report its
own score (a harness that printed "3/3 passed" in the same process could be faked by the program it tests), and an
assert-style test passes only when a marker printed after the asserts comes out (an early ``sys.exit(0)`` fails).
Programs that do not parse are scored without running (``compile_error``); timeouts, limits and crashes are
counted in the metrics, never raised.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpc_rlhf.config.sandbox import SandboxConfig
from hpc_rlhf.sandbox.factory import run_sandbox, run_sandbox_config, sandbox_from_config
from hpc_rlhf.sandbox.result import ExecRequest, ExecResult, Sandbox

_CODE_BLOCK = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)
# Verdict names logged under code/<name> (fraction of samples); a sample's verdict is the worst of its tests.
VERDICTS = ("pass", "fail", "compile_error", "runtime_error", "timeout", "output_limit", "memory_limit",
            "sandbox_error", "bad_tests")


class CodeTestsError(ValueError):
    """A sample's tests (its label) are malformed; the message names the sample."""


def extract_code(response: str) -> str:
    """The last fenced Python block of a response, or the whole response when it has none."""
    blocks = _CODE_BLOCK.findall(response)
    return blocks[-1] if blocks else response


def _parse_tests(label: Any, index: int) -> Mapping[str, Any]:
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as exc:
            raise CodeTestsError(f"sample {index}: the label is not JSON ({exc})") from exc
    if not isinstance(label, Mapping) or not ({"asserts", "test", "io"} & set(label)):
        raise CodeTestsError(f"sample {index}: the label must be a dict with 'asserts', 'test' or 'io'; "
                             f"got {str(label)[:200]!r}")
    return label


def build_requests(code: str, tests: Mapping[str, Any], default_time_limit_s: float | None,
                   done_marker: str = "") -> list[ExecRequest]:
    """One :class:`ExecRequest` per test of ``tests`` for the program ``code``.

    Assert-style tests end by printing ``done_marker``: a test passes only when it is the last line of stdout, so
    a program that exits early with status 0 (``sys.exit(0)`` before the asserts run) does not pass.
    """
    time_limit = tests.get("time_limit_s", default_time_limit_s)
    if "io" in tests:
        return [ExecRequest(code=code, stdin=str(case["input"]), time_limit_s=time_limit) for case in tests["io"]]
    done = f"\nprint({done_marker!r})\n" if done_marker else "\n"
    if "test" in tests:
        entry = tests.get("entry_point")
        call = f"\n\ncheck({entry})" if entry else ""
        return [ExecRequest(code=f"{code}\n\n{tests['test']}{call}{done}", time_limit_s=time_limit)]
    setup = str(tests.get("setup", ""))
    return [ExecRequest(code=f"{setup}\n{code}\n\n{assertion}{done}", time_limit_s=time_limit)
            for assertion in tests["asserts"]]


def _normalise_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _test_passed(result: ExecResult, tests: Mapping[str, Any], case_index: int, done_marker: str) -> bool:
    if result.status != "ok":
        return False
    if "io" in tests:
        return _normalise_output(result.stdout) == _normalise_output(str(tests["io"][case_index]["output"]))
    lines = result.stdout.rstrip("\n").rsplit("\n", 1)
    return lines[-1] == done_marker


_FAILURE_ORDER = ("sandbox_error", "timeout", "memory_limit", "output_limit", "runtime_error", "fail")


def _verdict(results: Sequence[ExecResult], passed: Sequence[bool]) -> str:
    if all(passed):
        return "pass"
    kinds = {"error": "runtime_error", "ok": "fail"}
    seen = {kinds.get(r.status, r.status) for r, ok in zip(results, passed, strict=True) if not ok}
    return next(kind for kind in _FAILURE_ORDER if kind in seen)


@dataclass(frozen=True)
class CodeScore:
    """One sample's outcome: ``pass_fraction`` over ``num_tests`` and the sample's verdict (see ``VERDICTS``)."""

    pass_fraction: float
    num_tests: int
    verdict: str


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def score_programs(sandbox: Sandbox, programs: Sequence[str], labels: Sequence[Any],
                   time_limit_s: float | None = None) -> list[CodeScore]:
    """Run every program against its sample's tests, all tests of the batch in one pool; one score per sample.

    Raises:
        CodeTestsError: a label is malformed (naming the sample).
    """
    if len(programs) != len(labels):
        raise ValueError(f"{len(programs)} programs but {len(labels)} labels")
    all_tests = [_parse_tests(label, i) for i, label in enumerate(labels)]
    # Fresh per batch. It is in the program's source, which the program could read: this stops an early exit, not
    # a program written to find the marker (same-process tests can never be proof against that).
    done_marker = f"tests-done-{secrets.token_hex(8)}"
    requests: list[ExecRequest] = []
    spans: list[tuple[int, int] | None] = []
    for code, tests in zip(programs, all_tests, strict=True):
        if not _parses(code):
            spans.append(None)
            continue
        batch = build_requests(code, tests, time_limit_s, done_marker)
        spans.append((len(requests), len(requests) + len(batch)))
        requests.extend(batch)
    results = sandbox.run_many(requests)
    scores = []
    for tests, span in zip(all_tests, spans, strict=True):
        if span is None:
            scores.append(CodeScore(0.0, 0, "compile_error"))
            continue
        mine = results[span[0]:span[1]]
        if not mine:
            scores.append(CodeScore(0.0, 0, "bad_tests"))
            continue
        passed = [_test_passed(r, tests, k, done_marker) for k, r in enumerate(mine)]
        scores.append(CodeScore(sum(passed) / len(passed), len(passed), _verdict(mine, passed)))
    return scores


def make_code_reward_func(sandbox: Sandbox, *, all_pass: bool = False, time_limit_s: float | None = None):
    """A ``reward_func(queries, prompts, labels, responses=...)`` for ``reward.reward_func_path`` files.

    The reward is the pass fraction (or 1.0 only when every test passes, with ``all_pass``); ``extra_logs``
    carries ``code/pass_fraction`` and one 0/1 column per verdict, so compile errors and timeouts show in the
    metrics as fractions of the batch.
    """

    def reward_func(queries: list[str], prompts: list[str], labels: list[Any],
                    responses: list[str] | None = None) -> dict[str, Any]:
        texts = responses if responses is not None else [q[len(p):] for q, p in zip(queries, prompts, strict=True)]
        scores = score_programs(sandbox, [extract_code(t) for t in texts], labels, time_limit_s)
        fractions = [s.pass_fraction for s in scores]
        rewards = [float(f == 1.0) for f in fractions] if all_pass else fractions
        extra: dict[str, list[float]] = {"code/pass_fraction": fractions}
        for verdict in VERDICTS:
            extra[f"code/{verdict}"] = [float(s.verdict == verdict) for s in scores]
        return {"rewards": rewards, "scores": [float(f == 1.0) for f in fractions], "extra_logs": extra}

    return reward_func



def run_code_reward_func(config: SandboxConfig | None = None):
    """:func:`make_code_reward_func` on the run's sandbox (:func:`hpc_rlhf.sandbox.factory.run_sandbox`), with
    ``sandbox.code_reward`` choosing the pass fraction or all-pass; the per-test limits are the ``sandbox`` ones.
    ``config``: a ``sandbox`` section to build a sandbox of its own from (default: the process's shared one, from
    the section the trainer configured)."""
    if config is None:
        return make_code_reward_func(run_sandbox(), all_pass=run_sandbox_config().code_reward == "all_pass")
    return make_code_reward_func(sandbox_from_config(config), all_pass=config.code_reward == "all_pass")
