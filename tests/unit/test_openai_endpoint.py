"""The OpenAI-compatible endpoint over the transformers engine, through the real `openai` client and real HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from hpc_rlhf.agents.agent_loader import AgentLoadError, load_agent_executor  # noqa: E402
from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint  # noqa: E402
from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor  # noqa: E402
from hpc_rlhf.agents.openai_recording import CompletionRecord, episode_sequences  # noqa: E402
from hpc_rlhf.data.prompts import Prompt  # noqa: E402
from hpc_rlhf.rollout.base import SamplingParams  # noqa: E402
from tests.endpoint_fixtures import queue_drained_into, tiny_tokenizer_and_engine  # noqa: E402


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
    return tiny_tokenizer_and_engine(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def served(tiny):
    """An endpoint whose queue a background thread drains into the engine, as the executor's thread does."""
    tokenizer, engine = tiny
    capturing = CapturingEngine(engine)
    endpoint = OpenAIEndpoint(tokenizer, max_len=96).start()
    endpoint.set_defaults(SamplingParams(max_new_tokens=8, stop_token_ids=[tokenizer.eos_token_id], seed=5))
    with queue_drained_into(endpoint, capturing.generate):
        yield endpoint, capturing, tokenizer
    endpoint.close()


def _client(endpoint, episode_id):
    endpoint.recorder.open(episode_id)
    return openai.OpenAI(base_url=endpoint.base_url, api_key=episode_id, max_retries=0, timeout=60,
                         http_client=endpoint.http_client(timeout=60))  # over its Unix socket


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
    client = openai.OpenAI(base_url=endpoint.base_url, api_key="not-an-episode", max_retries=0,
                           http_client=endpoint.http_client())
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        _client(endpoint, "ep-bad").completions.create(model="policy", prompt="1+1=", max_tokens=2,
                                                       stream_options={"include_usage": True})


def _recorded(records):
    return [(r.prompt_ids, r.output_ids, r.output_logprobs, r.finish_reason) for r in records]


def test_streaming_chat_and_completions_record_what_the_same_seed_records_without_streaming(served):
    """The real client with stream=True: the accumulated deltas equal the non-streaming reply, and the recorded
    trajectory (a two-call chat, then a completion, n=2) equals the non-streaming episode's for the same seeds."""
    endpoint, _, _ = served
    replies, trajectories = {}, {}
    for stream in (False, True):
        episode = f"ep-stream-{stream}"
        client = _client(endpoint, episode)
        messages = [{"role": "user", "content": "2+2="}]
        texts = []
        for seed in (1, 2):
            kwargs = dict(model="policy", messages=messages, max_tokens=5, temperature=1.0, seed=seed, logprobs=True)
            if not stream:
                reply = client.chat.completions.create(**kwargs)
                content, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
                logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
            else:
                chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                             stream_options={"include_usage": True}))
                assert all(c.object == "chat.completion.chunk" for c in chunks)
                assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(logprobs_of(chunks))
                content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                finish, logprobs = finish[0], logprobs_of(chunks)
                assert chunks[0].choices[0].delta.role == "assistant"
            texts.append((content, finish, logprobs))
            messages = messages + [{"role": "assistant", "content": content}, {"role": "user", "content": "ok?"}]
        kwargs = dict(model="policy", prompt="Q: 1+2=\nA: ", max_tokens=6, temperature=1.0, seed=3, n=2)
        if stream:
            chunks = list(client.completions.create(**kwargs, stream=True))
            texts.append(sorted((i, "".join(c.choices[0].text for c in chunks if c.choices[0].index == i))
                                for i in (0, 1)))
            assert all(c.choices[0].finish_reason in ("stop", "length") for c in chunks[1::2])
        else:
            texts.append(sorted((c.index, c.text) for c in client.completions.create(**kwargs).choices))
        replies[stream] = texts
        trajectories[stream] = _recorded(endpoint.recorder.close(episode))
    assert replies[True] == replies[False]
    assert trajectories[True] == trajectories[False] and len(trajectories[True]) == 4
    assert [len(s.calls) for s in episode_sequences([CompletionRecord(i, *r) for i, r in
                                                     enumerate(trajectories[True][:2])])] == [2]


def logprobs_of(chunks):
    return [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]


async def three_turn_chat(client, prompt, label):
    messages = [{"role": "user", "content": prompt}]
    for follow_up in ("are you sure?", "final answer?", None):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return 1.0


def _trained_runs(t):
    """``(begin, end)`` of each maximal run of action_mask 1 in the response."""
    runs, start = [], None
    for i, m in enumerate(t.action_mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _engine_outputs(capturing):
    """prompt ids -> every output the engine produced for it."""
    outputs = {}
    for requests, results in capturing.calls:
        for result in results:
            outputs.setdefault(tuple(requests[result.request_index].prompt_ids), []).append(list(result.output_ids))
    return outputs


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
    outputs = _engine_outputs(capturing)
    for t in trajectories:
        assert t.failure is None and t.reward == 1.0
        assert t.extra_logs["num_calls"] == 3 and t.extra_logs["num_branches"] == 1
        assert t.extra_logs["num_turns"] == 3 and t.branch_index == 0
        sequence = t.prompt_ids + t.response_ids
        # The trained runs of the response: exactly three, each the engine's output for its prompt.
        runs = _trained_runs(t)
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


BRANCHING_AGENT = Path(__file__).resolve().parents[2] / "examples/agents/openai_branching_agent.py"


def test_branching_episode_trains_one_row_per_branch_sharing_the_reward(tiny):
    """The example workflow asks once with n=2 and continues both choices: each episode becomes two rows, each
    masking in exactly its own branch's two outputs (the n=2 choice, then its follow-up's answer)."""
    tokenizer, engine = tiny
    capturing = CapturingEngine(engine)
    executor = load_agent_executor(str(BRANCHING_AGENT), tokenizer, 32, max_len=128, num_concurrent=4,
                                   agent_kwargs={"max_tokens": 4, "unused": 1})
    try:
        sampling = SamplingParams(max_new_tokens=4, stop_token_ids=[tokenizer.eos_token_id], seed=7, temperature=1.0)
        prompts = [Prompt(text="2+5=", label="7", source="t", index=0),
                   Prompt(text="1+1=", label="2", source="t", index=1, data_source="sums")]
        rows = executor.run(prompts, capturing.generate, sampling, n_samples_per_prompt=2)
    finally:
        executor.close()
    assert [(t.group_index, t.branch_index) for t in rows] == [(0, 0), (0, 1), (0, 0), (0, 1),
                                                                (1, 0), (1, 1), (1, 0), (1, 1)]
    assert [t.data_source for t in rows] == ["t"] * 4 + ["sums"] * 4  # every branch: its prompt's source
    outputs = _engine_outputs(capturing)
    n2_choices = [sorted(list(r.output_ids) for r in results if r.request_index == i)
                  for requests, results in capturing.calls for i, q in enumerate(requests) if q.n == 2]
    assert len(n2_choices) == 4  # one n=2 call per episode
    for first, second in zip(rows[::2], rows[1::2], strict=True):
        assert first.failure is None and first.reward == second.reward and first.score == second.score
        assert first.prompt_ids == second.prompt_ids  # both branches start at the episode's first prompt
        assert first.extra_logs["num_calls"] == 4 and first.extra_logs["num_branches"] == 2
        for row in (first, second):
            runs = _trained_runs(row)
            assert len(runs) == 2, row.action_mask  # the branch's choice and its follow-up answer, nothing else
            sequence = row.prompt_ids + row.response_ids
            for begin, end in runs:
                assert row.response_ids[begin:end] in outputs[tuple(sequence[: len(row.prompt_ids) + begin])]
            assert sum(row.action_mask) == sum(end - begin for begin, end in runs)
            assert all(lp == 0.0 for lp, m in zip(row.rollout_logprobs, row.action_mask, strict=True) if not m)
            assert "Q: are you sure?\nA: " in tokenizer.decode(sequence)
        # The two rows hold the two choices of one n=2 call, one each.
        (begin0, end0), (begin1, end1) = _trained_runs(first)[0], _trained_runs(second)[0]
        assert begin0 == begin1 == 0
        assert sorted([first.response_ids[:end0], second.response_ids[:end1]]) in n2_choices


def _agent_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_workflow_class_shape_and_its_errors(tiny, tmp_path):
    tokenizer, _ = tiny
    workflow = (
        "class Workflow:\n"
        "    def __init__(self, bonus=0.0):\n"
        "        self.bonus = bonus\n"
        "    async def arun_episode(self, client, data):\n"
        "        return self.bonus\n")
    executor = load_agent_executor(_agent_file(tmp_path, "wf.py", workflow), tokenizer, 32,
                                   agent_kwargs={"bonus": 2.5, "other": 1})
    assert isinstance(executor, OpenAIAgentExecutor) and executor.run_episode.bonus == 2.5
    function = "async def run_episode(client, prompt, label):\n    return 0.0\n"
    both = _agent_file(tmp_path, "both.py", workflow + function)
    with pytest.raises(AgentLoadError, match=r"both.py defines both `run_episode` and the workflow class Workflow"):
        load_agent_executor(both, tokenizer, 32)
    two = _agent_file(tmp_path, "two.py", workflow + workflow.replace("class Workflow", "class Other"))
    with pytest.raises(AgentLoadError, match=r"two.py defines 2 workflow classes .*Workflow, Other"):
        load_agent_executor(two, tokenizer, 32)
    neither = _agent_file(tmp_path, "neither.py", "class Workflow:\n    def arun_episode(self, client, data):\n"
                                                  "        return 1.0\n")  # not async: no agent shape
    with pytest.raises(AgentLoadError, match=r"neither.py defines neither .*arun_episode"):
        load_agent_executor(neither, tokenizer, 32)
    broken = _agent_file(tmp_path, "broken.py", workflow.replace("self.bonus = bonus", "raise KeyError(bonus)"))
    with pytest.raises(AgentLoadError, match=r"broken.py: building the workflow Workflow"):
        load_agent_executor(broken, tokenizer, 32)


@pytest.mark.parametrize("listen", ["unix", "tcp"])
def test_the_agents_client_reaches_the_endpoint_where_it_listens(tiny, listen):
    tokenizer, engine = tiny
    executor = OpenAIAgentExecutor(three_turn_chat, tokenizer, prompt_max_len=32, max_len=128, endpoint_listen=listen)
    try:
        sampling = SamplingParams(max_new_tokens=3, stop_token_ids=[tokenizer.eos_token_id], seed=2)
        [row] = executor.run([Prompt(text="1+2=", label="3", source="t", index=0)], engine.generate, sampling, 1)
        served = executor.endpoint
        assert served is not None and (served.port is None) == (listen == "unix")
    finally:
        executor.close()
    assert row.failure is None and sum(row.action_mask) > 0


def _png_part(side: int) -> dict:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (side, side), (9, 99, 199)).save(buffer, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                      + base64.b64encode(buffer.getvalue()).decode()}}


def test_the_endpoint_limit_keys_reach_the_endpoint_the_run_builds(tiny, tmp_path, monkeypatch):
    """rollout.agent_* limit keys, through the run's setup, are the limits of the endpoint its executor serves: the
    server is built with the connection bounds, and a request past a lowered image cap is its 400 naming the key."""
    import asyncio

    from hpc_rlhf.agents import openai_endpoint
    from hpc_rlhf.agents.openai_requests import EndpointRequestError
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.setup import _executor

    tokenizer, _ = tiny
    built: list[tuple] = []
    real = openai_endpoint.limited_http_protocol
    monkeypatch.setattr(openai_endpoint, "limited_http_protocol", lambda *bounds: built.append(bounds) or real(*bounds))
    agent = _agent_file(tmp_path, "agent.py", "async def run_episode(client, prompt, label):\n    return 0.0\n")
    cfg = load_config(None, [f"train.agent_func_path={agent}", "rollout.agent_endpoint=tcp",
                             "rollout.agent_max_images_per_request=1", "rollout.agent_max_pixels_per_image=64",
                             "rollout.agent_endpoint_max_connections=7",
                             "rollout.agent_endpoint_first_request_timeout_s=2.5"])
    executor = _executor(cfg, tokenizer)
    try:
        endpoint = executor.start_endpoint()
        assert built == [(7, 2.5)] and endpoint.port is not None
        endpoint.recorder.open("ep-caps")

        def chat(*parts: dict) -> None:
            asyncio.run(endpoint.chat({"messages": [{"role": "user", "content": [*parts]}]}, "Bearer ep-caps"))

        with pytest.raises(EndpointRequestError, match=r"more than 1 images.*rollout\.agent_max_images_per_request") \
                as caught:
            chat(_png_part(4), _png_part(4))
        assert caught.value.status == 400
        with pytest.raises(EndpointRequestError, match=r"\(81 pixels\).*64 pixels per image "
                                                       r"\(rollout\.agent_max_pixels_per_image\)") as caught:
            chat(_png_part(9))
        assert caught.value.status == 400
    finally:
        executor.close()
