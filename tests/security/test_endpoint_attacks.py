"""Attacks on the OpenAI-compatible endpoint and its executor, over real HTTP on loopback.

Any user of a node can reach ``127.0.0.1`` (``listen="tcp"``; the default Unix socket in a private folder only its
user): a body without a key, or a huge one, must be refused before it is read; a malformed request must be its own 400, and an agent that blocks its thread must time out as itself.
"""

from __future__ import annotations

import threading
import tracemalloc

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint  # noqa: E402
from hpc_rlhf.agents.openai_executor import OpenAIAgentExecutor  # noqa: E402
from hpc_rlhf.data.prompts import Prompt  # noqa: E402
from hpc_rlhf.rollout.base import SamplingParams  # noqa: E402

MiB = 1024 * 1024
ATTACK_BYTES = 300 * MiB


@pytest.fixture()
def endpoint(tiny_tokenizer_and_engine):
    tokenizer, _ = tiny_tokenizer_and_engine
    served = OpenAIEndpoint(tokenizer, max_len=96, listen="tcp").start()  # reachable by every user
    yield served
    served.close()


def _chunks(total: int, chunk: bytes = b"x" * MiB):
    """``total`` bytes of body, one shared 1 MiB buffer at a time (the client holds ~1 MiB)."""
    for _ in range(total // len(chunk)):
        yield chunk


def _post_measured(url: str, headers: dict, total: int) -> tuple[int, int]:
    """POST ``total`` bytes to ``url``; (status, peak bytes allocated in this process while it ran). The server
    runs in this process (a thread), so tracemalloc's peak includes whatever it buffered of the body."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        with httpx.Client(timeout=120) as client:
            status = client.post(url, headers=headers, content=_chunks(total)).status_code
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return status, peak - base


def _prompt(text: str, index: int) -> Prompt:
    return Prompt(text=text, label="", source="test", index=index)


def test_unauthenticated_300mb_body_is_refused_without_reading_it(endpoint):
    status, peak = _post_measured(f"{endpoint.base_url}/completions",
                                  {"Content-Length": str(ATTACK_BYTES), "Content-Type": "application/json"},
                                  ATTACK_BYTES)
    assert status == 401
    assert peak < 32 * MiB, f"the server buffered {peak / MiB:.0f} MiB of a body it refuses"


def test_oversized_chunked_body_with_a_key_is_413_past_the_cap(endpoint):
    endpoint.recorder.open("ep-big")
    status, peak = _post_measured(f"{endpoint.base_url}/completions",  # no Content-Length: chunked
                                  {"Authorization": "Bearer ep-big", "Content-Type": "application/json"},
                                  ATTACK_BYTES)
    assert status == 413
    assert peak < endpoint.max_body_bytes + 32 * MiB, f"peak {peak / MiB:.0f} MiB for a body capped at " \
                                                      f"{endpoint.max_body_bytes / MiB:.0f} MiB"


def test_declared_oversized_body_is_413_before_it_is_read(endpoint):
    endpoint.recorder.open("ep-declared")
    status, peak = _post_measured(f"{endpoint.base_url}/completions",
                                  {"Authorization": "Bearer ep-declared", "Content-Length": str(ATTACK_BYTES)},
                                  ATTACK_BYTES)
    assert status == 413 and peak < 32 * MiB


def test_nothing_is_served_without_a_key(endpoint):
    root = endpoint.base_url.removesuffix("/v1")
    for path in ("/docs", "/openapi.json", "/redoc", "/v1/models", "/nowhere"):
        response = httpx.get(root + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.post(root + "/v1/completions", json={"prompt": "1+1="}).status_code == 401
    endpoint.recorder.open("ep-docs")
    key = {"Authorization": "Bearer ep-docs"}
    assert httpx.get(root + "/docs", headers=key).status_code == 404  # no docs even with a key
    assert httpx.get(root + "/openapi.json", headers=key).status_code == 404
    assert httpx.get(root + "/v1/models", headers=key).json()["data"][0]["id"] == "policy"


@pytest.mark.parametrize("body, param", [
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [5, 10**9]}, "prompt"),
    ({"prompt": "1+1=", "n": 10**6}, "n"),
    ({"prompt": "1+1=", "n": 0}, "n"),
    ({"prompt": "1+1=", "seed": 2**80}, "seed"),
    ({"prompt": "1+1=", "max_tokens": -3}, "max_tokens"),
])
def test_malformed_completion_is_a_400_naming_the_field(endpoint, body, param):
    endpoint.recorder.open("ep-400")
    response = httpx.post(f"{endpoint.base_url}/completions", json=body, headers={"Authorization": "Bearer ep-400"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert endpoint.queue._queue.empty()  # nothing reached the engine


@pytest.mark.parametrize("messages, param", [
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [1, 2]}], "messages[0].content"),
    ([{"role": "user", "content": "hi", "tool_calls": "x"}], "messages[0].tool_calls"),
    (["hi"], "messages[0]"),
])
def test_malformed_chat_messages_are_a_400_naming_the_message(endpoint, messages, param):
    endpoint.recorder.open("ep-chat-400")
    response = httpx.post(f"{endpoint.base_url}/chat/completions", json={"messages": messages},
                          headers={"Authorization": "Bearer ep-chat-400"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_deeply_nested_body_is_a_400(endpoint):
    endpoint.recorder.open("ep-deep")
    body = b"[" * 200_000 + b"]" * 200_000
    response = httpx.post(f"{endpoint.base_url}/completions", content=body,
                          headers={"Authorization": "Bearer ep-deep"})
    assert response.status_code == 400 and "nests too deeply" in response.text


def _sampling(tokenizer) -> SamplingParams:
    return SamplingParams(max_new_tokens=4, stop_token_ids=[tokenizer.eos_token_id], seed=1)


def test_bad_token_ids_get_400_and_the_other_episodes_of_the_batch_train(tiny_tokenizer_and_engine):
    tokenizer, engine = tiny_tokenizer_and_engine
    refusals = []

    async def agent(client, prompt, label):
        if prompt == "bad":
            try:
                await client.completions.create(model="policy", prompt=[-5, 3, 10**9], max_tokens=4)
            except openai.BadRequestError as err:
                refusals.append(str(err))
            return 0.0
        await client.completions.create(model="policy", prompt=prompt, max_tokens=4)
        return 1.0

    executor = OpenAIAgentExecutor(agent, tokenizer, prompt_max_len=32, max_len=96, episode_timeout_s=120,
                                   batch_wait_s=0.5)
    try:
        rows = executor.run([_prompt("1+1=", 0), _prompt("bad", 1), _prompt("2+2=", 2)], engine.generate,
                            _sampling(tokenizer), 2)
    finally:
        executor.close()
    assert len(refusals) == 2 and all("vocabulary" in r for r in refusals)
    good = [r for r in rows if r.group_index != 1]
    assert len(good) == 4 and all(r.failure is None and sum(r.action_mask) > 0 and r.reward == 1.0 for r in good)
    bad = [r for r in rows if r.group_index == 1]
    assert all(r.failure is not None and sum(r.action_mask) == 0 for r in bad)  # made no call: nothing trains


def test_an_engine_failure_ends_only_the_request_and_episode_it_belongs_to(tiny_tokenizer_and_engine):
    tokenizer, engine = tiny_tokenizer_and_engine
    poison = 7

    def generate(requests):
        if any(r.prompt_ids[0] == poison for r in requests):
            raise ValueError("the engine cannot serve this prompt")
        return engine.generate(requests)

    async def agent(client, prompt, label):
        ids = [poison, 5, 6] if prompt == "poison" else prompt
        await client.completions.create(model="policy", prompt=ids, max_tokens=4)
        return 1.0

    executor = OpenAIAgentExecutor(agent, tokenizer, prompt_max_len=32, max_len=96, episode_timeout_s=120,
                                   batch_wait_s=0.5)
    try:
        rows = executor.run([_prompt("1+1=", 0), _prompt("poison", 1), _prompt("2+2=", 2)], generate,
                            _sampling(tokenizer), 1)
    finally:
        executor.close()
    by_group = {r.group_index: r for r in rows}
    assert by_group[1].finish_reason == "agent_error"
    assert "cannot serve this prompt" in by_group[1].failure and "rollout engine" in by_group[1].failure
    assert all(by_group[g].failure is None and sum(by_group[g].action_mask) > 0 for g in (0, 2))


def test_an_agent_that_blocks_its_thread_forever_times_out_as_itself(tiny_tokenizer_and_engine):
    tokenizer, engine = tiny_tokenizer_and_engine
    release = threading.Event()

    async def agent(client, prompt, label):
        if prompt == "block":
            release.wait()  # a synchronous block inside `async def` (time.sleep, a blocking HTTP client)
            return 0.0
        await client.completions.create(model="policy", prompt=prompt, max_tokens=4)
        return 1.0

    executor = OpenAIAgentExecutor(agent, tokenizer, prompt_max_len=32, max_len=96, episode_timeout_s=5)
    box: dict = {}

    def run():
        box["rows"] = executor.run([_prompt("block", 0), _prompt("1+1=", 1), _prompt("2+2=", 2)],
                                   engine.generate, _sampling(tokenizer), 2)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(90)
    hung = thread.is_alive()
    release.set()  # let the blocked agent (and, before the fix, the whole run) unwind
    thread.join(30)
    executor.close()
    assert not hung, "the run hung on one agent that blocked its thread"
    blocked = [r for r in box["rows"] if r.group_index == 0]
    others = [r for r in box["rows"] if r.group_index != 0]
    assert [r.finish_reason for r in blocked] == ["agent_timeout", "agent_timeout"]
    assert all("episode_timeout_s" in r.failure for r in blocked)
    assert len(others) == 4 and all(r.failure is None and r.reward == 1.0 for r in others)
    assert executor.last_run_stats["agent_timeouts"] == 2


def test_a_call_past_the_engine_context_is_its_own_400_with_data_max_len_unset(tiny_tokenizer_and_engine):
    tokenizer, engine = tiny_tokenizer_and_engine
    context = engine.max_context_len  # the tiny model's max_position_embeddings
    assert context == 512
    seen: list[int] = []

    def generate(requests):
        seen.extend(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        return engine.generate(requests)

    async def agent(client, prompt, label):
        # A long conversation: its prompt alone passes the engine's context; the agent lets the 400 raise.
        ids = [5] * (context + 10) if prompt == "long" else prompt
        await client.completions.create(model="policy", prompt=ids, max_tokens=4)
        return 1.0

    executor = OpenAIAgentExecutor(agent, tokenizer, prompt_max_len=32, max_len=None, episode_timeout_s=120,
                                   batch_wait_s=0.5)
    executor.context_len = context  # as the trainer's setup pairs the executor with its engine
    try:
        rows = executor.run([_prompt("1+1=", 0), _prompt("long", 1), _prompt("2+2=", 2)], generate,
                            _sampling(tokenizer), 1)
    finally:
        executor.close()
    assert seen and max(seen) <= context, f"a call of {max(seen)} tokens reached an engine of {context}"
    by_group = {r.group_index: r for r in rows}
    assert by_group[1].finish_reason == "agent_error"
    assert "BadRequestError" in by_group[1].failure and f"context of {context} tokens" in by_group[1].failure
    assert all(by_group[g].failure is None and sum(by_group[g].action_mask) > 0 for g in (0, 2))
