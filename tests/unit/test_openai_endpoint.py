"""The OpenAI-compatible endpoint over the transformers engine, through the real `openai` client and real HTTP."""

from __future__ import annotations

import threading

import pytest

openai = pytest.importorskip("openai")

from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint, run_batch  # noqa: E402
from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor  # noqa: E402
from hpc_rlhf.agents.openai_recording import CompletionRecord, episode_sequences  # noqa: E402
from hpc_rlhf.data.prompts import Prompt  # noqa: E402
from hpc_rlhf.engines.rollout_base import SamplingParams  # noqa: E402
from hpc_rlhf.engines.transformers_rollout import TransformersRolloutEngine  # noqa: E402
from hpc_rlhf.models.tiny import build_tiny_model  # noqa: E402


class CapturingEngine:
    """The real engine; keeps what each generate call was given and returned, to compare with the records."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, requests):
        results = self.engine.generate(requests)
        self.calls.append((requests, results))
        return results


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).float().eval()
    engine = TransformersRolloutEngine(model, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id, device="cpu", seed=3)
    return tokenizer, engine


@pytest.fixture(scope="module")
def served(tiny):
    """An endpoint whose queue a background thread drains into the engine, as the executor's thread does."""
    tokenizer, engine = tiny
    capturing = CapturingEngine(engine)
    endpoint = OpenAIEndpoint(tokenizer, max_len=96).start()
    endpoint.set_defaults(SamplingParams(max_new_tokens=8, stop_token_ids=[tokenizer.eos_token_id], seed=5))
    stop = threading.Event()

    def pump():
        while not stop.is_set():
            run_batch(endpoint.queue.take(set(), 0.02, 0.0), capturing.generate)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    yield endpoint, capturing, tokenizer
    stop.set()
    thread.join(5)
    endpoint.close()


def _client(endpoint, episode_id):
    endpoint.recorder.open(episode_id)
    return openai.OpenAI(base_url=endpoint.base_url, api_key=episode_id, max_retries=0, timeout=60)


def test_chat_n_and_logprobs_match_the_engine_tokens(served):
    endpoint, capturing, tokenizer = served
    client = _client(endpoint, "ep-chat")
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "3+4="}],
                                           n=3, temperature=1.0, max_tokens=6, logprobs=True)
    assert len(reply.choices) == 3 and reply.object == "chat.completion"
    requests, results = capturing.calls[-1]
    assert len(requests) == 1 and requests[0].n == 3 and requests[0].params.max_new_tokens == 6
    expected_prompt = tokenizer.encode("Q: 3+4=\nA: ", add_special_tokens=False)
    records = endpoint.recorder.close("ep-chat")
    assert len(records) == 3
    for choice, record, result in zip(reply.choices, records, results):
        assert record.prompt_ids == expected_prompt == list(result.prompt_ids)
        assert record.output_ids == list(result.output_ids)  # exact ids, never re-tokenised
        assert record.output_logprobs == pytest.approx([float(x) for x in result.output_logprobs])
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(record.output_logprobs)
        assert choice.message.content == tokenizer.decode(record.output_ids, skip_special_tokens=True)
        assert choice.finish_reason == result.finish_reason
    assert reply.usage.completion_tokens == sum(len(r.output_ids) for r in records)


def test_completions_stop_string_logprobs_and_models(served):
    endpoint, capturing, tokenizer = served
    client = _client(endpoint, "ep-completion")
    assert [m.id for m in client.models.list().data] == ["policy"]
    full = client.completions.create(model="policy", prompt="Q: 1+2=\nA: ", max_tokens=12, temperature=0,
                                     logprobs=1)
    text = full.choices[0].text
    assert full.choices[0].logprobs.token_logprobs == pytest.approx(
        [float(x) for x in capturing.calls[-1][1][0].output_logprobs])
    assert len(text) >= 4, f"the tiny model stopped too early to test stop strings: {text!r}"
    stop = text[2:4]
    cut = client.completions.create(model="policy", prompt="Q: 1+2=\nA: ", max_tokens=12, temperature=0,
                                    stop=[stop], logprobs=1)
    choice = cut.choices[0]
    assert choice.text == text[: text.find(stop)] and choice.finish_reason == "stop"
    records = endpoint.recorder.close("ep-completion")
    assert tokenizer.decode(records[-1].output_ids) == choice.text  # the stop string's tokens are not recorded
    assert choice.logprobs.token_logprobs == pytest.approx(records[-1].output_logprobs)
    assert records[-1].output_ids == list(capturing.calls[-1][1][0].output_ids[: len(choice.text)])


def test_unknown_episode_is_refused(served):
    endpoint, _, _ = served
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="not-an-episode", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        _client(endpoint, "ep-stream").completions.create(model="policy", prompt="1+1=", max_tokens=2, stream=True)


async def three_turn_chat(client, prompt, label):
    messages = [{"role": "user", "content": prompt}]
    for follow_up in ("are you sure?", "final answer?", None):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return 1.0


def test_linear_three_call_chat_is_one_trajectory_masking_all_but_the_outputs(tiny):
    tokenizer, engine = tiny
    capturing = CapturingEngine(engine)
    executor = OpenAIAgentExecutor(three_turn_chat, tokenizer, prompt_max_len=32, max_len=128, num_concurrent=4)
    try:
        sampling = SamplingParams(max_new_tokens=5, stop_token_ids=[tokenizer.eos_token_id], seed=11)
        prompts = [Prompt(text="2+5=", label="7", source="t", index=0),
                   Prompt(text="1+1=", label="2", source="t", index=1)]
        trajectories = executor.run(prompts, capturing.generate, sampling, n_samples_per_prompt=2)
    finally:
        executor.close()
    assert len(trajectories) == 4 and [t.group_index for t in trajectories] == [0, 0, 1, 1]
    # Concurrent episodes share generate calls: 4 episodes x 3 calls in fewer than 12 engine calls.
    assert len(capturing.calls) < 12
    outputs = {}
    for requests, results in capturing.calls:
        for result in results:
            outputs.setdefault(tuple(requests[result.request_index].prompt_ids), []).append(list(result.output_ids))
    for t in trajectories:
        assert t.failure is None and t.reward == 1.0
        assert t.extra_logs["num_calls"] == 3 and t.extra_logs["num_branches"] == 1
        assert t.extra_logs["dropped_calls"] == 0
        sequence = t.prompt_ids + t.response_ids
        # Split the response into its trained runs: exactly three, each the engine's output for its prompt.
        runs, start = [], None
        for i, m in enumerate(t.action_mask + [0]):
            if m and start is None:
                start = i
            if not m and start is not None:
                runs.append((start, i))
                start = None
        assert len(runs) == 3
        for begin, end in runs:
            prefix = tuple(sequence[: len(t.prompt_ids) + begin])
            assert t.response_ids[begin:end] in outputs[prefix]
        assert all(lp == 0.0 for lp, m in zip(t.rollout_logprobs, t.action_mask) if not m)
        text = tokenizer.decode(sequence)
        assert "Q: are you sure?\nA: " in text and "Q: final answer?\nA: " in text


def test_branching_calls_start_new_sequences():
    def record(i, prompt, out):
        return CompletionRecord(call_index=i, prompt_ids=prompt, output_ids=out, output_logprobs=[-1.0] * len(out),
                                finish_reason="stop")

    records = [record(0, [1, 2], [3]), record(1, [1, 2, 3, 9], [4, 5]), record(2, [1, 2], [7])]
    sequences = episode_sequences(records)
    assert [s.calls for s in sequences] == [[0, 1], [2]]
    assert sequences[0].response_ids == [3, 9, 4, 5] and sequences[0].action_mask == [1, 0, 1, 1]
    assert sequences[0].logprobs == [-1.0, 0.0, -1.0, -1.0]
