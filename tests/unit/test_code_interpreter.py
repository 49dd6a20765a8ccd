"""The agents' code interpreter: state across calls, errors leave state intact, limits, OpenAI tool messages."""

from __future__ import annotations

import json

import pytest

from hpc_rlhf.agents.code_interpreter import CodeInterpreter, tool_spec
from hpc_rlhf.config.sandbox import SandboxConfig
from hpc_rlhf.sandbox.factory import configure_run_sandbox
from hpc_rlhf.sandbox.isolation import default_python, probe_bwrap
from hpc_rlhf.sandbox.local import LocalSandbox


@pytest.fixture(scope="module")
def sandbox():
    return LocalSandbox("bwrap" if probe_bwrap(default_python()) is None else "rlimits", max_workers=2)


def test_state_persists_and_failed_cells_are_not_replayed(sandbox):
    interp = CodeInterpreter(sandbox, time_limit_s=5)
    assert interp.run("x = 20\ndef double(v):\n    return 2 * v\n") == "(no output)"
    assert interp.run("print('shown once')\ny = double(x)") == "shown once\n"
    assert interp.run("y + 2") == "42\n"  # the replayed cell's print is not shown again
    error = interp.run("x = 0\n1 / 0")
    assert "ZeroDivisionError" in error
    assert interp.run("x") == "20\n"  # the failed cell's x = 0 did not stick
    assert interp.stats()["code_interpreter_calls"] == 5.0 and interp.stats()["timing/tools/code_interpreter"] > 0


def test_timeouts_and_long_output_are_reported(sandbox):
    interp = CodeInterpreter(sandbox, time_limit_s=1, max_output_chars=100)
    assert "timed out" in interp.run("while True:\n    pass")
    out = interp.run("print('a' * 5000)")
    assert "characters cut" in out and len(out) < 200


def test_openai_tool_message(sandbox):
    interp = CodeInterpreter(sandbox)
    assert tool_spec()["function"]["parameters"]["required"] == ["code"]
    message = interp.tool_message("call_1", json.dumps({"code": "sum(range(10))"}))
    assert message == {"role": "tool", "tool_call_id": "call_1", "content": "45\n"}
    bad = interp.tool_message("call_2", "not json")
    assert bad["content"].startswith("[the arguments must be JSON")


def test_openrlhf_style_agent_file_runs_code_between_turns(monkeypatch):
    import asyncio
    from pathlib import Path

    from hpc_rlhf.utils.user_code import import_user_file

    # the process's sandbox as a trainer sets it; monkeypatch puts the module's previous state back afterwards
    monkeypatch.setattr("hpc_rlhf.sandbox.factory._run_config", None)
    monkeypatch.setattr("hpc_rlhf.sandbox.factory._run_sandbox", None)
    configure_run_sandbox(SandboxConfig(isolation="auto" if probe_bwrap(default_python()) is None else "rlimits"))
    path = Path(__file__).resolve().parents[2] / "examples" / "agents" / "code_interpreter_agent.py"
    module = import_user_file(str(path), "code_interpreter_agent")
    agent = module.AgentInstance()

    async def episode():
        first = await agent.step({"action_text": "```python\nn = sum(i * i for i in range(5))\nn\n```",
                                  "label": "30"})
        second = await agent.step({"action_text": "Answer: 30", "label": "30"})
        return first, second

    first, second = asyncio.run(episode())
    assert first["environment_feedback"] == "\n<output>\n30\n\n</output>\n" and not first["done"]
    assert second["rewards"] == 1.0 and second["done"]
    assert second["extra_logs"]["code_interpreter_calls"] == 1.0
