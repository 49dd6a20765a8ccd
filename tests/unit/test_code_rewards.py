"""Code rewards: test forms, pass fraction vs all-pass, verdicts in the metrics, malformed labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_rlhf.config.sandbox import SandboxConfig
from hpc_rlhf.config.schema import RunConfig
from hpc_rlhf.rewards.code import CodeTestsError, extract_code, score_programs
from hpc_rlhf.rewards.functions import RewardFunction
from hpc_rlhf.sandbox.factory import configure_run_sandbox, sandbox_from_config
from hpc_rlhf.sandbox.isolation import SandboxUnavailableError
from hpc_rlhf.sandbox.limits import SandboxLimits
from hpc_rlhf.sandbox.local import LocalSandbox, num_workers_from_allocation

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_funcs" / "code_tests.py"


@pytest.fixture(scope="module")
def sandbox():
    # The rlimits level: these tests are about scoring, the isolation has tests/security/test_sandbox_attacks.py.
    return LocalSandbox("rlimits", limits=SandboxLimits(wall_time_s=5), max_workers=2)


def test_extract_code_takes_the_last_fenced_block():
    text = "Plan:\n```python\nx = 1\n```\nFinal:\n```py\ndef f():\n    return 2\n```\n"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("def g(): pass") == "def g(): pass"


def test_asserts_give_a_pass_fraction(sandbox):
    label = {"asserts": ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"]}
    (score,) = score_programs(sandbox, ["def add(a, b):\n    return a + b\n"], [label])
    assert score.num_tests == 3 and score.pass_fraction == pytest.approx(2 / 3) and score.verdict == "runtime_error"


def test_stdin_stdout_tests_compare_output_up_to_trailing_whitespace(sandbox):
    label = json.dumps({"io": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"},
                               {"input": "0 0\n", "output": "1\n"}]})
    program = "a, b = map(int, input().split())\nprint(a + b, ' ')\n"
    (score,) = score_programs(sandbox, [program], [label])
    assert score.pass_fraction == pytest.approx(2 / 3) and score.verdict == "fail"


@pytest.fixture
def run_sandbox_section():
    """Sets the process's sandbox section as a trainer does; puts the defaults back afterwards."""
    yield configure_run_sandbox
    configure_run_sandbox(SandboxConfig())


def test_reward_func_all_pass_and_verdict_columns(run_sandbox_section):
    # Through the example reward file, as reward.reward_func_path loads it, with the sandbox keys a trainer hands on.
    run_sandbox_section(SandboxConfig(isolation="rlimits", code_reward="all_pass", wall_time_s=1, cpu_time_s=1))
    labels = [{"asserts": ["assert f() == 1", "assert f() != 2"]}, {"asserts": ["assert f() == 1"]},
              {"asserts": ["assert f() == 1", "assert f() == 2"]}, {"asserts": ["assert f() == 1"]}]
    responses = ["```python\ndef f():\n    return 1\n```", "def f(:\n", "def f():\n    return 1\n",
                 "def f():\n    while True:\n        pass\n"]
    out = RewardFunction(str(EXAMPLE))(["p" + r for r in responses], ["p"] * 4, labels, responses=responses)
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.extra_logs["code/pass_fraction"].tolist() == [1.0, 0.0, 0.5, 0.0]
    assert out.extra_logs["code/compile_error"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert out.extra_logs["code/timeout"].tolist() == [0.0, 0.0, 0.0, 1.0]
    assert out.extra_logs["code/pass"].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sandbox_keys_refuse_unknown_and_impossible_values_naming_the_key():
    with pytest.raises(ValueError, match="sandbox.isolation"):
        RunConfig.model_validate({"sandbox": {"isolation": "docker"}})
    with pytest.raises(ValueError, match="sandbox.isolation=remote needs sandbox.url"):
        RunConfig.model_validate({"sandbox": {"isolation": "remote"}})
    with pytest.raises(ValueError, match="sandbox.url is only used with sandbox.isolation=remote"):
        RunConfig.model_validate({"sandbox": {"url": "http://127.0.0.1:8080"}})
    with pytest.raises(ValueError, match="wall_time_s"):
        RunConfig.model_validate({"sandbox": {"wall_time_s": 0}})
    # bubblewrap cannot run this interpreter (as on a node without bwrap): refused, not run unisolated
    with pytest.raises(SandboxUnavailableError, match="sandbox.isolation=bwrap: .*needs bubblewrap"):
        sandbox_from_config(SandboxConfig(isolation="bwrap", python="/nonexistent/python3"))


def test_malformed_labels_name_the_sample(sandbox):
    with pytest.raises(CodeTestsError, match="sample 1: the label is not JSON"):
        score_programs(sandbox, ["x=1", "x=1"], [{"asserts": []}, "{not json"])
    with pytest.raises(CodeTestsError, match="sample 0: the label must be a dict"):
        score_programs(sandbox, ["x=1"], [{"tests": []}])


def test_pool_size_follows_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "7")
    assert num_workers_from_allocation() == 7
    monkeypatch.delenv("SLURM_CPUS_PER_TASK")
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    assert num_workers_from_allocation() >= 1


def test_an_early_exit_with_status_zero_does_not_pass(sandbox):
    label = {"asserts": ["assert f() == 1"]}
    human_eval_style = {"test": "def check(candidate):\n    assert candidate() == 1\n", "entry_point": "f"}
    for exit_call in ("import sys; sys.exit(0)", "import os; os._exit(0)"):
        code = f"def f():\n    return 2\n{exit_call}\n"
        scores = score_programs(sandbox, [code, code], [label, human_eval_style])
        assert [s.pass_fraction for s in scores] == [0.0, 0.0], code
        assert {s.verdict for s in scores} == {"fail"}


def test_code_task_splits_are_disjoint_and_every_program_passes_its_own_tests(sandbox):
    from hpc_rlhf.data.synthetic_code import code_prompt_rows, program, split_functions

    splits = {name: set(split_functions(name)) for name in ("sft", "rl", "heldout")}
    assert not (splits["sft"] & splits["rl"] or splits["sft"] & splits["heldout"] or splits["rl"] & splits["heldout"])
    for position in range(3):  # SFT shows every step in every position: held-out functions are new combinations
        assert {fn[position] for fn in splits["sft"]} == {fn[position] for fn in splits["heldout"]}
    heldout = split_functions("heldout")
    rows = code_prompt_rows(len(heldout), 0, "heldout")
    right = score_programs(sandbox, [program(fn) for fn in heldout], [r["label"] for r in rows])
    assert all(s.verdict == "pass" for s in right)
    swapped = score_programs(sandbox, [program(fn) for fn in heldout[1:9]], [r["label"] for r in rows[:8]])
    assert sum(s.verdict == "pass" for s in swapped) <= 1  # the tests tell the functions apart


def test_a_config_naming_a_missing_isolation_level_refuses_at_start_up(run_sandbox_section):
    """`sandbox.isolation` written in the config is a demand: recording the section builds the sandbox at once, so a
    node without the level refuses the run at start-up, naming the key; a config without it waits for first use."""
    absent = "/nonexistent/python3"  # bubblewrap cannot run this interpreter: the level is "not there"
    with pytest.raises(SandboxUnavailableError, match="sandbox.isolation=bwrap: .*needs bubblewrap"):
        run_sandbox_section(SandboxConfig(isolation="bwrap", python=absent))
    run_sandbox_section(SandboxConfig(python=absent))  # isolation left to its default: nothing built yet
