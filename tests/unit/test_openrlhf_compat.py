"""OpenRLHF compatibility without a distributed run: loader shapes and their errors, the function-style
adapter, user-call timeouts, reward-function timeouts, a .py remote_url, serve-rm flags, rollout health, and the
config keys that docs/openrlhf_flags.md cites."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel

from hpc_rlhf.agents.agent_loader import AgentLoadError, load_agent_executor
from hpc_rlhf.cli.serve_rm import translate_openrlhf_flags
from hpc_rlhf.config import RunConfig, load_config
from hpc_rlhf.config.supervised import CONFIG_CLASSES
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.tiny import build_char_tokenizer
from hpc_rlhf.rewards.functions import RewardFunction, RewardFunctionError
from hpc_rlhf.rollout.base import SamplingParams, Trajectory
from hpc_rlhf.trainers.rl.controller_steps import append_groups, kept_by_dynamic_filtering, select_samples
from hpc_rlhf.trainers.rl.rollout_health import RolloutHealth, extra_log_metrics
from hpc_rlhf.trainers.rl.setup import SetupError, reward_function
from hpc_rlhf.utils.user_calls import UserCallTimeout, call_in_thread
from tests.unit.test_multi_turn_agent import ScriptedGenerate

FILES = Path(__file__).resolve().parents[1] / "multiproc" / "agent_files"
FLAGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "openrlhf_flags.md"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _run(executor, tok, labels=("1",), n=2):
    prompts = [Prompt(text="1+1=", label=label, source="t", index=i) for i, label in enumerate(labels)]
    return executor.run(prompts, ScriptedGenerate(tok), SamplingParams(max_new_tokens=4), n)


def test_executor_base_file_gets_constructor_args_kwargs_and_execute_override(tok):
    executor = load_agent_executor(str(FILES / "openrlhf_import_agent.py"), tok, 16, max_len=64, max_turns=3,
                                   step_timeout_s=5, agent_kwargs={"bonus": 3})
    assert executor.max_steps == 3 and executor.max_length == 64 and executor.hf_tokenizer is tok
    trajectories = _run(executor, tok)
    assert all(t.extra_logs["bonus_seen"] == 3 and t.extra_logs["wrapped_by_execute"] == 1.0 for t in trajectories)
    assert all(t.failure is None and t.extra_logs["num_turns"] == 2 for t in trajectories)


def test_execute_override_without_super_is_refused_saying_what_to_change(tmp_path, tok):
    path = _write(tmp_path, "own_execute.py", """
        from hpc_rlhf.agents.multi_turn import AgentExecutorBase, AgentInstanceBase
        class AgentInstance(AgentInstanceBase):
            async def step(self, states, **kwargs):
                return {"rewards": 0.0, "done": True}
        class AgentExecutor(AgentExecutorBase):
            def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
                super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
            async def execute(self, prompt, label, sampling_params):
                return await self.llm_engine.generate(prompt)
    """)
    with pytest.raises(AgentLoadError, match=r"without calling super\(\)\.execute.*AgentInstance\.step"):
        load_agent_executor(path, tok, 16)


def test_constructor_argument_the_trainer_cannot_supply_is_named(tmp_path, tok):
    path = _write(tmp_path, "needs_arg.py", """
        from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
        class AgentInstance(AgentInstanceBase):
            async def step(self, states, **kwargs):
                return {"rewards": 0.0, "done": True}
        class AgentExecutor(MultiTurnAgentExecutor):
            def __init__(self, sandbox_url):
                super().__init__(AgentInstance)
    """)
    with pytest.raises(AgentLoadError, match=r"requires \['sandbox_url'\].*train.agent_kwargs"):
        load_agent_executor(path, tok, 16)


def test_function_style_file_and_its_dict_form(tmp_path, tok):
    executor = load_agent_executor(str(FILES / "function_step_agent.py"), tok, 16, max_len=64, max_turns=3,
                                   agent_kwargs={"scale": 2.0})
    trajectories = _run(executor, tok)
    assert all(t.failure is None and t.extra_logs["step_scale"] == 2.0 for t in trajectories)
    assert all(t.extra_logs["num_turns"] == 2 for t in trajectories)  # "\nA: " feedback, then done
    feedback = tok.encode("\nA: ", add_special_tokens=False)
    assert all(0 in t.action_mask and len(t.action_mask) > len(feedback) for t in trajectories)

    path = _write(tmp_path, "dict_step.py", """
        def step(state, action, label, **kwargs):
            return {"rewards": 1.0, "next_state": state + action, "done": True, "extra_logs": {"x": 1}}
    """)
    trajectories = _run(load_agent_executor(path, tok, 16, max_len=64), tok)
    assert all(t.reward == 1.0 and t.extra_logs["x"] == 1.0 for t in trajectories)


def test_function_style_next_state_must_extend_the_state(tmp_path, tok):
    path = _write(tmp_path, "rewrites.py", """
        async def step(state, action, label, **kwargs):
            return 1.0, "something else", True
    """)
    trajectories = _run(load_agent_executor(path, tok, 16, max_len=64), tok)
    assert all(t.finish_reason == "agent_error" and "must start with state + action" in t.failure
               for t in trajectories)


def test_file_with_no_agent_names_every_accepted_shape(tmp_path, tok):
    path = _write(tmp_path, "empty.py", "X = 1\n")
    with pytest.raises(AgentLoadError, match="AgentInstance.*step function.*agents_from_openrlhf"):
        load_agent_executor(path, tok, 16)


def test_timeouts_hold_for_blocking_async_and_hung_sync_agents(tok):
    executor = load_agent_executor(str(FILES / "hanging_agent.py"), tok, 16, max_len=64, step_timeout_s=1)
    start = time.monotonic()
    trajectories = _run(executor, tok, labels=("1", "2"))
    assert time.monotonic() - start < 10
    assert [t.finish_reason for t in trajectories] == ["agent_timeout"] * 4


def test_hung_user_thread_does_not_keep_the_process_alive():
    code = ("import threading\nfrom hpc_rlhf.utils.user_calls import call_in_thread, UserCallTimeout\n"
            "try:\n    call_in_thread(threading.Event().wait, timeout_s=0.2)\n"
            "except UserCallTimeout:\n    print('timed out')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "timed out" in done.stdout


def test_call_in_thread_returns_and_raises():
    assert call_in_thread(lambda x: x + 1, 1, timeout_s=5) == 2
    with pytest.raises(ZeroDivisionError):
        call_in_thread(lambda: 1 / 0, timeout_s=5)
    with pytest.raises(UserCallTimeout):
        call_in_thread(time.sleep, 5, timeout_s=0.1)


def test_hanging_reward_function_times_out():
    reward = RewardFunction(str(FILES / "hanging_reward.py"), timeout_s=0.5)
    with pytest.raises(RewardFunctionError, match="reward_func_timeout_s"):
        reward(["q"], ["p"], [None])


def test_py_remote_url_is_a_reward_function_file(tmp_path):
    path = str(FILES / "mostly_uniform_reward.py")
    cfg = load_config(None, [f"reward.remote_url=[{path}]"])
    assert isinstance(reward_function(cfg), RewardFunction) and not cfg.needs_reward_model
    cfg = load_config(None, [f"reward.remote_url=[{path},http://host:5000/get_reward]"])
    with pytest.raises(SetupError, match="reward.reward_func_path"):
        reward_function(cfg)


def test_serve_rm_accepts_openrlhf_flags_or_names_ours():
    argv = ["--reward_pretrain", "m", "--normalize_reward", "--bf16", "--flash_attn", "--max_len", "8",
            "--data.max_len=16", "--packing_samples", "--reward.model_name_or_path", "n"]
    assert translate_openrlhf_flags(argv) == [
        "--reward_pretrain", "m", "--normalize", "--param_dtype", "bf16", "--attn_implementation",
        "flash_attention_2", "--max_len", "8", "--max_len=16", "--reward_pretrain", "n"]
    with pytest.raises(SystemExit, match="--param_dtype bf16"):
        translate_openrlhf_flags(["--load_in_4bit"])


def _trajectory(reward, group, failure=None, finish="stop", logs=None):
    return Trajectory(prompt=f"prompt {group}", label=None, prompt_ids=[1], response_ids=[2], action_mask=[1],
                      rollout_logprobs=[0.0], reward=reward, score=reward, group_index=group, failure=failure,
                      finish_reason=finish, extra_logs=dict(logs or {}))


def test_extra_logs_are_namespaced_batch_means():
    rows = extra_log_metrics([_trajectory(1, 0, logs={"num_turns": 1.0, "reward": 5.0}),
                              _trajectory(0, 0, finish="max_len", logs={"num_turns": 3.0, "reward": 7.0})])
    assert rows["agent/num_turns"] == 2.0 and rows["extra/reward"] == 6.0 and "reward" not in rows
    assert rows["agent/max_len_fraction"] == 0.5


def test_tool_seconds_are_step_sums_under_timing_and_cannot_overwrite_a_phase():
    rows = extra_log_metrics([_trajectory(1, 0, logs={"timing/tools/code_interpreter": 0.5, "timing/train": 9.0}),
                              _trajectory(0, 1, logs={"timing/tools/code_interpreter": 1.5, "timing/train": 7.0})])
    assert rows["timing/tools/code_interpreter"] == 2.0  # the step's tool seconds, not the episode mean
    assert rows["extra/timing/train"] == 8.0 and "timing/train" not in rows


def test_failure_limit_needs_a_full_window_and_names_the_cause(caplog):
    health = RolloutHealth(max_failure_fraction=0.5, window_steps=2, max_len=32)
    failing = [_trajectory(0, 0, failure="step: KeyError: 'tool'", finish="agent_error") for _ in range(3)]
    health.observe(failing + [_trajectory(1, 1, finish="max_len")], step=1)
    assert health.verdict() is None  # one step is not the window
    assert "were cut at data.max_len=32" in caplog.text
    health.observe(failing + [_trajectory(1, 1)], step=2)
    verdict = health.verdict()
    assert "6 of 8" in verdict and "KeyError" in verdict and "prompt 0" in verdict
    health.observe([_trajectory(1, 0)] * 8, step=3)
    assert health.verdict() is None  # 3 of 12 in the window now


def test_refill_helpers_and_the_cap_to_one_step():
    cfg = load_config(None, ["rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=2",
                             "train.train_batch_size=4", "algo.dynamic_filtering=true",
                             "algo.dynamic_filtering_reward_range=[0.01,0.99]"])
    uniform = [_trajectory(1.0, 0), _trajectory(1.0, 0), _trajectory(0.0, 1), _trajectory(1.0, 1)]
    assert kept_by_dynamic_filtering(uniform, cfg) == 2
    more = [_trajectory(0.0, 0), _trajectory(1.0, 0), _trajectory(1.0, 1), _trajectory(0.0, 1)]
    merged = append_groups(uniform, more)
    assert [t.group_index for t in merged] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(select_samples(merged, cfg)) == 4


def test_reward_function_without_timeout_runs_in_the_calling_thread(tmp_path):
    path = _write(tmp_path, "thread_name.py", """
        import threading
        def reward_func(queries, prompts, labels):
            return [float(threading.current_thread() is threading.main_thread())] * len(queries)
    """)
    assert RewardFunction(path, timeout_s=None)(["q"], ["p"]).rewards.tolist() == [1.0]
    assert RewardFunction(path, timeout_s=5)(["q"], ["p"]).rewards.tolist() == [0.0]


# A backticked dotted key in a table cell, with an optional `=value`: `ds.param_dtype=bf16`, `ds.lora.rank`.
_KEY = re.compile(r"`([a-z_]+(?:\.[a-z0-9_]+)+)(?:=[^`]*)?`")


def _has_key(root: type[BaseModel], dotted: str) -> bool:
    """Whether ``dotted`` names a field of the config tree ``root`` (nested sections followed)."""
    model: type[BaseModel] | None = root
    for part in dotted.split("."):
        if model is None or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        nested = [c for c in (annotation, *get_args(annotation)) if isinstance(c, type) and issubclass(c, BaseModel)]
        model = nested[0] if nested else None
    return True


def _flag_tables() -> dict[str, list[tuple[str, str]]]:
    """docs/openrlhf_flags.md's flag tables: ``{"rl": [...], "offline": [...]}`` of (key cell, notes cell)."""
    tables: dict[str, list[tuple[str, str]]] = {"rl": [], "offline": []}
    section = "rl"
    for line in FLAGS_DOC.read_text().splitlines():
        if line.startswith("## "):
            section = "offline" if line.startswith("## SFT") else "other"
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| ") else []
        if section in tables and len(cells) == 3 and cells[0] != "OpenRLHF flag":
            tables[section].append((cells[1], cells[2]))
    return tables


def test_every_key_the_openrlhf_flags_doc_cites_exists():
    """The RL table's keys are RunConfig's, the offline table's those of an SFT / RM / DPO / KTO config; keys in
    the notes may be of either tree. Only dotted keys whose first part is a section are checked."""
    tables = _flag_tables()
    assert len(tables["rl"]) > 90 and len(tables["offline"]) >= 10
    offline_roots = list(CONFIG_CLASSES.values())
    rl_sections = set(RunConfig.model_fields)
    offline_sections = {name for root in offline_roots for name in root.model_fields}
    missing, checked = [], 0
    for name, rows in tables.items():
        own = [RunConfig] if name == "rl" else offline_roots
        for key_cell, notes in rows:
            for cell, roots, sections in ((key_cell, own, rl_sections if name == "rl" else offline_sections),
                                          (notes, [RunConfig, *offline_roots], rl_sections | offline_sections)):
                for key in _KEY.findall(cell):
                    if key.split(".")[0] not in sections:
                        continue
                    checked += 1
                    if not any(_has_key(root, key) for root in roots):
                        missing.append(f"{name}: {key}")
    assert not missing, f"docs/openrlhf_flags.md cites keys the config does not have: {missing}"
    assert checked > 150


def test_flag_doc_key_check_catches_an_unknown_key():
    assert _has_key(RunConfig, "ds.lora.rank") and _has_key(RunConfig, "train.async_queue_size")
    assert not _has_key(RunConfig, "ds.overlap_comm") and not _has_key(RunConfig, "ds.lora.rank.x")
    assert _has_key(CONFIG_CLASSES["dpo"], "loss.beta") and not _has_key(CONFIG_CLASSES["sft"], "loss.beta")
    assert _KEY.findall("`ds.param_dtype=bf16` / `hf/step_<N>` `<train.output_dir>/ckpt` `config.json`") == [
        "ds.param_dtype", "config.json"]
