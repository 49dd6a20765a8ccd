"""Multi-turn agent execution: token in / token out, budgets, batching, failures, loader, examples."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import sys
import time

import pytest
import torch

from hpc_rlhf.agents.agent_loader import AgentLoadError, load_agent_executor
from hpc_rlhf.agents.multi_turn import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.tiny import build_char_tokenizer, build_tiny_model
from hpc_rlhf.rollout.base import GenerationResult, SamplingParams

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "agents")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def logprob_of(token: int) -> float:
    return -(token + 1) / 100.0


class ScriptedGenerate:
    """A deterministic batched engine. Sample j of request i in call c answers ``script(c, i, j, request)``
    (text), cut to ``max_new_tokens`` (then finish "length"); token t gets logprob ``-(t + 1) / 100``."""

    def __init__(self, tok, script=None, reverse=False):
        self.tok, self.calls, self.reverse = tok, [], reverse
        self.script = script or (lambda c, i, j, request: f"{c}{j}")

    def __call__(self, requests):
        self.calls.append(requests)
        call = len(self.calls) - 1
        results = []
        for i, request in enumerate(requests):
            for j in range(request.n):
                ids = self.tok.encode(self.script(call, i, j, request), add_special_tokens=False)
                finish = "stop"
                if len(ids) > request.params.max_new_tokens:
                    ids, finish = ids[:request.params.max_new_tokens], "length"
                results.append(GenerationResult(prompt_ids=list(request.prompt_ids), output_ids=ids,
                                                output_logprobs=[logprob_of(t) for t in ids],
                                                finish_reason=finish, request_index=i))
        return results[::-1] if self.reverse else results  # an engine may return results out of order

    def all_prompts(self):
        return [tuple(r.prompt_ids) for call in self.calls for r in call for _ in range(r.n)]


class ScriptedAgent(AgentInstanceBase):
    """Behaviour from the label dict: ``turns`` (done after that many, None = never), ``fail_at``,
    ``sleep_at``, ``stubborn_at`` (sleeps and ignores cancellation), ``bad_at`` (malformed output),
    ``reset_fail``, ``sampling`` (overrides returned at turn 1). Reward = turn number."""

    seen: list[dict] = []
    in_step = 0
    max_in_step = 0

    def __init__(self):
        self.turn = 0

    async def reset(self, states):
        if states["label"].get("reset_fail"):
            raise ValueError("reset exploded")
        return {"observation": states["observation"]}

    async def step(self, states):
        label = states["label"]
        self.turn += 1
        ScriptedAgent.seen.append({**states, "turn": self.turn})
        ScriptedAgent.in_step += 1
        ScriptedAgent.max_in_step = max(ScriptedAgent.max_in_step, ScriptedAgent.in_step)
        try:
            await asyncio.sleep(0.01)
            if label.get("fail_at") == self.turn:
                raise RuntimeError("environment exploded")
            if label.get("sleep_at") == self.turn:
                await asyncio.sleep(30)
            if label.get("stubborn_at") == self.turn:
                for _ in range(300):
                    try:
                        await asyncio.sleep(0.1)
                    except asyncio.CancelledError:
                        pass
            if label.get("bad_at") == self.turn:
                return {"rewards": 1.0}
        finally:
            ScriptedAgent.in_step -= 1
        turns = label.get("turns")
        return {
            "rewards": float(self.turn),
            "scores": torch.tensor(10.0 * self.turn),
            "environment_feedback": f"f{self.turn};",
            "done": turns is not None and self.turn >= turns,
            "sampling_params": label.get("sampling") if self.turn == 1 else None,
            "extra_logs": {"turn_seen": self.turn, "flag": True},
        }


@pytest.fixture(autouse=True)
def reset_agent_log():
    ScriptedAgent.seen, ScriptedAgent.in_step, ScriptedAgent.max_in_step = [], 0, 0


def prompts_for(labels):
    return [Prompt(text=f"Q{i}? ", label=label, source="mem", index=i) for i, label in enumerate(labels)]


def make_executor(tok, **kwargs):
    kwargs.setdefault("max_turns", 8)
    kwargs.setdefault("step_timeout_s", 5.0)
    return MultiTurnAgentExecutor(ScriptedAgent, tok, 64, **kwargs)


def sampling(**kwargs):
    return SamplingParams(**{"max_new_tokens": 8, "temperature": 1.0, **kwargs})


def segments(trajectory):
    """Split response_ids into runs of equal action_mask: [(mask, ids), ...]."""
    out = []
    for token, mask in zip(trajectory.response_ids, trajectory.action_mask):
        if out and out[-1][0] == mask:
            out[-1][1].append(token)
        else:
            out.append((mask, [token]))
    return out


# ---------------------------------------------------------------------------- token in, token out


def test_masks_logprobs_and_exact_next_prompts(tok):
    generate = ScriptedGenerate(tok)
    executor = make_executor(tok)
    trajectories = executor.run(prompts_for([{"turns": 3}, {"turns": 3}]), generate, sampling(seed=7), 2)

    assert len(trajectories) == 4 and len(generate.calls) == 3
    sent = generate.all_prompts()
    for t in trajectories:
        t.check()
        parts = segments(t)
        assert [m for m, _ in parts] == [1, 0, 1, 0, 1]  # action, feedback, action, feedback, action
        assert [tok.decode(ids) for m, ids in parts if m == 0] == ["f1;", "f2;"]
        for token, mask, logprob in zip(t.response_ids, t.action_mask, t.rollout_logprobs):
            assert logprob == (logprob_of(token) if mask else 0.0)
        # turn k was prompted with exactly prompt_ids + everything before it, no re-tokenization
        boundary = 0
        for k, (mask, ids) in enumerate(parts):
            if mask == 1:
                assert tuple(t.prompt_ids + t.response_ids[:boundary]) in sent
            boundary += len(ids)
        assert t.reward == 3.0 and t.score == 30.0  # the last step's
        assert not t.truncated and t.finish_reason == "stop"
        assert t.data_source == "mem"  # the prompt's source name (its file stem: no data_source column)
        assert t.extra_logs["num_turns"] == 3.0 and t.extra_logs["agent_error"] == 0.0
        assert t.extra_logs["turn_seen"] == 3.0 and t.extra_logs["flag"] == 1.0

    # the n samples of a prompt share one request in turn 1 (same tokens), later turns differ
    assert [r.n for r in generate.calls[0]] == [2, 2]
    assert sum(r.n for r in generate.calls[1]) == 4
    # ... and every later request carries its own seed derived from the step seed
    later_seeds = [r.params.seed for call in generate.calls[1:] for r in call]
    assert len(set(later_seeds)) == len(later_seeds) and 7 not in later_seeds

    # the environment saw the text so far and the latest action
    first = next(s for s in ScriptedAgent.seen if s["turn"] == 2)
    assert first["observation_text"].startswith("Q") and first["observation_text"].endswith("f1;")
    assert isinstance(first["sampling_params"], SamplingParams)
    assert executor.last_run_stats["agent_errors"] == 0 and executor.last_run_stats["generate_calls"] == 3


def test_grouping_and_order_with_out_of_order_engine(tok):
    labels = [{"turns": 1, "id": 0}, {"turns": 3, "id": 1}, {"turns": 2, "id": 2}]
    generate = ScriptedGenerate(tok, script=lambda c, i, j, r: f"{i}{j}{c}", reverse=True)
    trajectories = make_executor(tok).run(prompts_for(labels), generate, sampling(), 3)
    assert len(trajectories) == 9
    for i, t in enumerate(trajectories):
        assert t.group_index == i // 3
        assert t.label["id"] == i // 3 and t.prompt == f"Q{i // 3}? "
        assert t.extra_logs["num_turns"] == labels[i // 3]["turns"]
        assert t.reward == labels[i // 3]["turns"]


def test_sampling_overrides_apply_to_later_turns(tok):
    generate = ScriptedGenerate(tok)
    labels = [{"turns": 3, "sampling": {"temperature": 0.0, "max_tokens": 1}}]
    (t,) = make_executor(tok).run(prompts_for(labels), generate, sampling(), 1)
    assert generate.calls[0][0].params.temperature == 1.0
    for call in generate.calls[1:]:
        assert call[0].params.temperature == 0.0 and call[0].params.max_new_tokens == 1
    assert t.finish_reason == "length"  # env said done on a cut action: not a truncated episode
    assert not t.truncated


def test_reward_mode_sum(tok):
    class Summing(MultiTurnAgentExecutor):
        reward_mode = "sum"

    executor = Summing(ScriptedAgent, tok, 64)
    (t,) = executor.run(prompts_for([{"turns": 3}]), ScriptedGenerate(tok), sampling(), 1)
    assert t.reward == 6.0


# ---------------------------------------------------------------------------- budgets


def test_max_len_budget_truncates(tok):
    generate = ScriptedGenerate(tok, script=lambda c, i, j, r: "123456")
    executor = make_executor(tok, max_len=16)
    trajectories = executor.run(prompts_for([{"turns": None}] * 2), generate, sampling(max_new_tokens=4), 1)
    for t in trajectories:
        assert len(t.prompt_ids) == 4  # "Q0? "
        assert len(t.sequence_ids) <= 16
        assert t.truncated and t.finish_reason == "max_len"
    for call in generate.calls:  # every turn asked for at most the remaining budget
        for r in call:
            assert r.params.max_new_tokens == min(4, 16 - len(r.prompt_ids))
    # 4 prompt + 4 action + 3 feedback + 4 action = 15; "f2;" does not fit with one more token
    assert [len(ids) for _, ids in segments(trajectories[0])] == [4, 3, 4]
    assert executor.last_run_stats["truncated_max_len"] == 2


def test_max_len_cuts_last_action(tok):
    generate = ScriptedGenerate(tok, script=lambda c, i, j, r: "123456")
    (t,) = make_executor(tok, max_len=12).run(prompts_for([{"turns": None}]), generate,
                                                sampling(max_new_tokens=4), 1)
    # 4 + 4 + 3 = 11 -> one token left: the second turn asks for 1 token, then nothing is left
    assert generate.calls[1][0].params.max_new_tokens == 1
    assert len(t.sequence_ids) == 12 and t.truncated and t.finish_reason == "max_len"


def test_max_turns_truncates_and_drops_trailing_feedback(tok):
    generate = ScriptedGenerate(tok)
    executor = make_executor(tok, max_turns=2)
    (t,) = executor.run(prompts_for([{"turns": None}]), generate, sampling(), 1)
    assert len(generate.calls) == 2
    assert t.truncated and t.finish_reason == "max_turns"
    assert [m for m, _ in segments(t)] == [1, 0, 1] and t.action_mask[-1] == 1
    assert t.reward == 2.0
    assert executor.last_run_stats["truncated_max_turns"] == 1


# ---------------------------------------------------------------------------- batching


def test_one_generate_call_per_round_with_all_active_episodes(tok):
    generate = ScriptedGenerate(tok, script=lambda c, i, j, r: f"{c}{i}")
    labels = [{"turns": k} for k in (1, 2, 3, 4)]
    executor = make_executor(tok, num_concurrent=4)
    trajectories = executor.run(prompts_for(labels), generate, sampling(), 1)
    assert len(generate.calls) == 4  # one engine call per round
    assert [sum(r.n for r in call) for call in generate.calls] == [4, 3, 2, 1]  # every active episode
    assert [t.extra_logs["num_turns"] for t in trajectories] == [1, 2, 3, 4]
    assert ScriptedAgent.max_in_step == 4  # the environments stepped concurrently
    assert executor.last_run_stats["generate_calls"] == 4


def test_num_concurrent_bounds_active_episodes(tok):
    generate = ScriptedGenerate(tok, script=lambda c, i, j, r: f"{c}{i}")
    labels = [{"turns": 2, "id": k} for k in range(5)]
    executor = make_executor(tok, num_concurrent=2)
    trajectories = executor.run(prompts_for(labels), generate, sampling(), 1)
    assert max(sum(r.n for r in call) for call in generate.calls) == 2
    assert ScriptedAgent.max_in_step <= 2
    assert [t.label["id"] for t in trajectories] == list(range(5))
    assert all(t.reward == 2.0 and not t.truncated for t in trajectories)
    assert executor.last_run_stats["max_active"] == 2


# ---------------------------------------------------------------------------- failures


def test_agent_error_ends_only_its_episode(tok, caplog):
    labels = [{"turns": 3}, {"turns": 3, "fail_at": 2}, {"turns": 3, "reset_fail": True}, {"turns": 3, "bad_at": 1}]
    executor = make_executor(tok)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.agents.multi_turn"):
        trajectories = executor.run(prompts_for(labels), ScriptedGenerate(tok), sampling(), 1)
    ok, raised, reset_failed, malformed = trajectories
    assert ok.reward == 3.0 and ok.finish_reason == "stop" and ok.extra_logs["agent_error"] == 0.0
    for t in (raised, reset_failed, malformed):
        t.check()
        assert t.reward == 0.0 and t.score == 0.0 and not t.truncated
        assert t.finish_reason == "agent_error" and t.extra_logs["agent_error"] == 1.0
        assert sum(t.action_mask) == 0 and set(t.rollout_logprobs) <= {0.0}  # nothing trained on
    assert raised.extra_logs["num_turns"] == 2 and len(raised.response_ids) > 0
    assert reset_failed.response_ids == [] and reset_failed.prompt_ids
    assert executor.last_run_stats["agent_errors"] == 3 and executor.last_run_stats["agent_timeouts"] == 0
    text = caplog.text
    assert "environment exploded" in text and "reset exploded" in text and "lacks ['done']" in text


def test_failed_episodes_can_be_kept_for_training(tok):
    class Keep(MultiTurnAgentExecutor):
        train_on_failed_episodes = True

    (t,) = Keep(ScriptedAgent, tok, 64).run(prompts_for([{"turns": 3, "fail_at": 2}]), ScriptedGenerate(tok),
                                             sampling(), 1)
    assert t.finish_reason == "agent_error" and sum(t.action_mask) > 0


def test_agent_timeout_is_bounded(tok):
    labels = [{"turns": 2}, {"turns": 2, "sleep_at": 1}, {"turns": 2, "stubborn_at": 2}]
    executor = make_executor(tok, step_timeout_s=0.2)
    start = time.monotonic()
    trajectories = executor.run(prompts_for(labels), ScriptedGenerate(tok), sampling(), 1)
    assert time.monotonic() - start < 5.0
    ok, slept, stubborn = trajectories
    assert ok.reward == 2.0 and ok.finish_reason == "stop"
    for t in (slept, stubborn):
        assert t.finish_reason == "agent_timeout" and t.reward == 0.0 and not t.truncated
        assert t.extra_logs["agent_error"] == 1.0 and t.extra_logs["agent_timeout"] == 1.0
    assert executor.last_run_stats["agent_timeouts"] == 2 and executor.last_run_stats["agent_errors"] == 0


def test_sync_agent_methods_and_run_inside_event_loop(tok):
    class SyncAgent:  # duck-typed, plain def methods, no reset
        def step(self, states):
            return {"rewards": 1, "done": True, "environment_feedback": ""}

    executor = MultiTurnAgentExecutor(SyncAgent, tok, 64)

    async def caller():  # an async caller (notebook, async trainer) must not break run()
        return executor.run(prompts_for([{}]), ScriptedGenerate(tok), sampling(), 2)

    trajectories = asyncio.run(caller())
    assert [t.reward for t in trajectories] == [1.0, 1.0]


def test_validation(tok):
    with pytest.raises(ValueError, match="max_turns"):
        make_executor(tok, max_turns=0).run(prompts_for([{}]), ScriptedGenerate(tok), sampling(), 1)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        make_executor(tok).run(prompts_for([{}]), ScriptedGenerate(tok), sampling(), 0)
    assert make_executor(tok).run([], ScriptedGenerate(tok), sampling(), 2) == []


# ---------------------------------------------------------------------------- loader and examples


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_loader_errors_name_the_file(tmp_path, tok):
    no_instance = write(tmp_path, "no_instance.py", (
        "from hpc_rlhf.agents.multi_turn import MultiTurnAgentExecutor\n"
        "class AgentExecutor(MultiTurnAgentExecutor):\n    pass\n"))
    with pytest.raises(AgentLoadError, match="no_instance.py defines AgentExecutor but no AgentInstance"):
        load_agent_executor(no_instance, tok, 64)
    empty = write(tmp_path, "empty.py", "x = 1\n")
    with pytest.raises(AgentLoadError, match="empty.py defines neither AgentInstance nor AgentExecutor"):
        load_agent_executor(empty, tok, 64)
    foreign = write(tmp_path, "foreign.py", (
        "class AgentInstance:\n    async def step(self, states):\n        return {}\n"
        "class AgentExecutor:\n    def __init__(self, cls):\n        self.cls = cls\n"))
    with pytest.raises(AgentLoadError, match="foreign.py: AgentExecutor must subclass"):
        load_agent_executor(foreign, tok, 64)
    with pytest.raises(AgentLoadError, match="does not exist"):
        load_agent_executor(str(tmp_path / "missing.py"), tok, 64)
    broken = write(tmp_path, "broken.py", "from openrlhf.models import Actor\n")  # only utils.agent is aliased
    with pytest.raises(AgentLoadError, match="broken.py failed: ModuleNotFoundError.*openrlhf.utils.agent"):
        load_agent_executor(broken, tok, 64)
    assert "openrlhf" not in sys.modules


def test_openrlhf_import_loads_unchanged_and_the_alias_is_gone_afterwards(tmp_path, tok):
    if importlib.util.find_spec("openrlhf") is not None:
        pytest.skip("the real openrlhf is installed: the file imports it and nothing is aliased")
    original = write(tmp_path, "original.py", (
        "from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase\n"
        "import openrlhf.utils.agent as agent_module\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def step(self, states, **kwargs):\n"
        "        return {'rewards': 1.0, 'environment_feedback': '', 'done': True}\n"
        "class AgentExecutor(AgentExecutorBase):\n"
        "    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):\n"
        "        super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)\n"))
    executor = load_agent_executor(original, tok, 64, max_len=100, max_turns=2)
    assert isinstance(executor, AgentExecutorBase) and issubclass(executor.agent_instance_cls, AgentInstanceBase)
    assert [t.reward for t in executor.run(prompts_for([{}]), ScriptedGenerate(tok), sampling(), 2)] == [1.0, 1.0]
    assert not [name for name in sys.modules if name == "openrlhf" or name.startswith("openrlhf.")]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("openrlhf.utils.agent")


def test_loader_shapes(tmp_path, tok):
    # OpenRLHF's shape, with an async __init__ as some of its examples have
    openrlhf_style = write(tmp_path, "openrlhf_style.py", (
        "from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def __init__(self, *args, **kwargs):\n        self.k = 0\n"
        "    async def step(self, states, **kwargs):\n"
        "        self.k += 1\n"
        "        return {'rewards': float(self.k), 'environment_feedback': 'x', 'done': self.k == 2}\n"
        "class AgentExecutor(MultiTurnAgentExecutor):\n"
        "    def __init__(self):\n        super().__init__(AgentInstance)\n"))
    executor = load_agent_executor(openrlhf_style, tok, 64, max_len=100, max_turns=5, num_concurrent=3,
                                   step_timeout_s=1.0)
    assert isinstance(executor, MultiTurnAgentExecutor)
    assert (executor.max_len, executor.max_turns, executor.num_concurrent, executor.step_timeout_s) == (100, 5, 3, 1.0)
    trajectories = executor.run(prompts_for([{}]), ScriptedGenerate(tok), sampling(), 2)
    assert [t.reward for t in trajectories] == [2.0, 2.0]

    only_instance = write(tmp_path, "only_instance.py", (
        "from hpc_rlhf.agents.multi_turn import AgentInstanceBase\n"
        "class AgentInstance(AgentInstanceBase):\n"
        "    async def step(self, states):\n        return {'rewards': 1.0, 'done': True}\n"))
    assert type(load_agent_executor(only_instance, tok, 64)) is MultiTurnAgentExecutor

    custom = write(tmp_path, "custom.py", (
        "from hpc_rlhf.agents.executor import AgentExecutor as Base\n"
        "class AgentExecutor(Base):\n"
        "    def __init__(self, tokenizer, prompt_max_len, max_turns=1):\n"
        "        super().__init__(tokenizer, prompt_max_len)\n        self.max_turns = max_turns\n"
        "    def run(self, prompts, generate, sampling, n_samples_per_prompt):\n        return []\n"))
    executor = load_agent_executor(custom, tok, 64, max_turns=7)
    assert executor.max_turns == 7 and executor.prompt_max_len == 64


def test_math_retry_example(tok):
    executor = load_agent_executor(os.path.join(EXAMPLES, "math_retry_agent.py"), tok, 64, max_len=200, max_turns=8)
    answers = {0: ["3", "5"], 1: ["7"], 2: ["1", "2", "4", "9"]}  # per prompt, per turn

    def script(c, i, j, request):
        prompt = tok.decode(request.prompt_ids)
        k = int(prompt[1])
        turn = prompt.count("Wrong")
        return answers[k][turn] + tok.eos_token

    prompts = [Prompt(text=f"Q{k}: what? A: ", label=label, source="mem", index=k)
               for k, label in enumerate([5, "7", "#### 8"])]
    trajectories = executor.run(prompts, ScriptedGenerate(tok, script=script), sampling(), 1)
    second_try, first_try, failed = trajectories
    assert first_try.reward == 1.0 and first_try.extra_logs["attempts"] == 1.0
    assert second_try.reward == 0.5 and second_try.score == 1.0 and second_try.extra_logs["attempts"] == 2.0
    assert "Wrong. Try again." in tok.decode([t for t, m in zip(second_try.response_ids, second_try.action_mask)
                                              if m == 0])
    assert failed.reward == 0.0 and failed.extra_logs["attempts"] == 3.0 and not failed.truncated  # env's limit
    assert tok.eos_token_id in second_try.response_ids  # the exact generated tokens, eos included


def test_random_reward_example(tok):
    executor = load_agent_executor(os.path.join(EXAMPLES, "random_reward_agent.py"), tok, 64, max_len=200)
    trajectories = executor.run(prompts_for([{}, {}, {}]), ScriptedGenerate(tok), sampling(), 4)
    assert len(trajectories) == 12
    for t in trajectories:
        t.check()
        assert t.reward in (0.0, 1.0) and 1 <= t.extra_logs["num_turns"] <= 3
        assert t.extra_logs["random_reward"] == t.reward
    assert executor.last_run_stats["agent_errors"] == 0


# ---------------------------------------------------------------------------- real engine


def test_real_transformers_engine_token_in_token_out(tmp_path, tok):
    from transformers import LlamaForCausalLM

    from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine

    path = build_tiny_model(tmp_path / "tiny")
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = TransformersRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                       device="cpu", seed=3)
    executor = load_agent_executor(os.path.join(EXAMPLES, "math_retry_agent.py"), tok, 32, max_len=60, max_turns=3)
    prompts = [Prompt(text=f"Q: {a}+{b}=? A: ", label=a + b, source="mem", index=k)
               for k, (a, b) in enumerate([(1, 2), (3, 4)])]
    trajectories = executor.run(prompts, engine.generate,
                                SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=[tok.eos_token_id],
                                               seed=11), 2)
    assert len(trajectories) == 4 and [t.group_index for t in trajectories] == [0, 0, 1, 1]
    with torch.no_grad():
        for t in trajectories:
            t.check()
            assert len(t.sequence_ids) <= 60
            logits = model(torch.tensor([t.sequence_ids])).logits[0].float()
            logprobs = logits.log_softmax(-1)
            p = len(t.prompt_ids)
            for k, (token, mask, rollout) in enumerate(zip(t.response_ids, t.action_mask, t.rollout_logprobs)):
                if mask:  # the engine's logprob of exactly this token in exactly this context
                    assert rollout == pytest.approx(float(logprobs[p + k - 1, token]), abs=1e-4)
                else:
                    assert rollout == 0.0
            if t.extra_logs["num_turns"] > 1:
                assert 0 in t.action_mask
    assert any(t.extra_logs["num_turns"] > 1 for t in trajectories)  # feedback really was conditioned on
