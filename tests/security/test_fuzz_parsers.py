"""Fuzzing of every parser that takes outside input: the endpoint's requests (over real HTTP), the data readers
and the config loader. Each input either works or fails with the component's own clear error, never a crash
(500, an unexpected exception type) or a hang."""

from __future__ import annotations

import base64
import io
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpc_rlhf.config import load_config, redact
from hpc_rlhf.config.loader import ConfigError
from hpc_rlhf.data.sources import DataError, make_row, read_rows
from hpc_rlhf.rollout.base import GenerationResult, SamplingParams
from tests.endpoint_fixtures import queue_drained_into

FUZZ = settings(max_examples=150, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | \
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def mostly(valid, bad=json_values):
    """``valid`` three times in four, any JSON value otherwise: requests that get past the first check."""
    return st.one_of(valid, valid, valid, bad)


text = st.text(max_size=30)
message = st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "system"]))},
                                optional={"content": mostly(text), "tool_calls": json_values, "name": mostly(text)})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": text}, optional={"parameters": json_values, "description": text})})
common_fields = st.fixed_dictionaries({}, optional={
    "n": mostly(st.integers(min_value=1, max_value=4), st.integers()),
    "temperature": mostly(st.floats(min_value=0, max_value=2)),
    "top_p": mostly(st.floats(min_value=0.01, max_value=1)),
    "max_tokens": mostly(st.integers(min_value=1, max_value=10**9), st.integers()),
    "max_completion_tokens": mostly(st.integers(min_value=1, max_value=64)),
    "stop": mostly(text | st.lists(text, max_size=3)),
    "seed": mostly(st.integers(min_value=-2**63, max_value=2**63 - 1), st.integers()),
    "logprobs": mostly(st.booleans() | st.integers(min_value=0, max_value=1)),
    "stream": mostly(st.booleans()),
    "tools": mostly(st.lists(tool, max_size=2)),
    "tool_choice": mostly(st.sampled_from(["auto", "none"])),
    "model": json_values,
})
rare_fields = st.one_of(st.just({}), st.just({}), st.just({}), st.dictionaries(
    st.sampled_from(["stream_options", "top_logprobs", "best_of", "echo", "messages", "prompt"]), json_values,
    max_size=2))


def _merge(parts):
    merged = {}
    for part in parts:
        merged.update(part)
    return merged


chat_bodies = st.tuples(st.fixed_dictionaries({"messages": mostly(st.lists(message, min_size=1, max_size=3))}),
                        common_fields, rare_fields).map(_merge)
completion_bodies = st.tuples(st.fixed_dictionaries({"prompt": mostly(
    st.text(min_size=1, max_size=30) | st.lists(st.integers(min_value=0, max_value=200), min_size=1, max_size=8)
    | st.lists(st.integers(), max_size=4))}), common_fields, rare_fields).map(_merge)



def _tiny_png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (2, 2), (255, 0, 0)).save(out, format="PNG")
    return out.getvalue()


_PNG = _tiny_png()
# Image bytes that get past a first look: a real PNG, cut short, with junk after it, an EPS header (Ghostscript's
# format), random bytes.
image_bytes = st.one_of(st.just(_PNG), st.integers(min_value=0, max_value=len(_PNG)).map(lambda n: _PNG[:n]),
                        st.binary(max_size=32).map(lambda junk: _PNG + junk),
                        st.just(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\n"), st.binary(max_size=64))
data_urls = st.builds(lambda mime, data, encoded: f"data:{mime};base64," + (base64.b64encode(data).decode()
                                                                          if encoded else data.decode("latin-1")),
                      st.sampled_from(["image/png", "image/jpeg", "image/webp", "application/postscript", "text/plain",
                                       ""]), image_bytes, st.booleans())
image_urls = mostly(data_urls, text | json_values)
image_part = st.one_of(
    st.fixed_dictionaries({"type": st.just("image_url"),
                           "image_url": mostly(st.fixed_dictionaries({"url": image_urls}), image_urls)}),
    st.fixed_dictionaries({"type": st.just("image"), "image": image_urls}))
content_parts = st.lists(image_part | st.fixed_dictionaries({"type": st.just("text"), "text": text}) | json_values,
                         min_size=1, max_size=3)
image_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": mostly(content_parts, text)}), min_size=1, max_size=3)
image_chat_bodies = st.tuples(st.fixed_dictionaries({"messages": image_messages}), common_fields).map(_merge)

class CheckingEngine:
    """A stand-in engine that fails loudly on any request the endpoint should have refused."""

    def __init__(self, vocab_size: int, max_n: int, max_new_tokens: int):
        self.vocab_size, self.max_n, self.max_new_tokens = vocab_size, max_n, max_new_tokens

    def generate(self, requests):
        results = []
        for index, request in enumerate(requests):
            assert all(0 <= t < self.vocab_size for t in request.prompt_ids), request.prompt_ids
            assert 1 <= request.n <= self.max_n and 1 <= request.params.max_new_tokens <= self.max_new_tokens
            results += [GenerationResult(prompt_ids=list(request.prompt_ids), output_ids=[5, 6],
                                         output_logprobs=[-1.0, -1.0], finish_reason="length", request_index=index)
                        for _ in range(request.n)]
        return results


@pytest.fixture(scope="module")
def served(tiny_tokenizer_and_engine):
    pytest.importorskip("fastapi")
    from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint

    tokenizer, _ = tiny_tokenizer_and_engine
    endpoint = OpenAIEndpoint(tokenizer, max_len=96, listen="tcp").start()
    endpoint.set_defaults(SamplingParams(max_new_tokens=8, stop_token_ids=[tokenizer.eos_token_id]))
    engine = CheckingEngine(len(tokenizer), endpoint.max_n, 96)
    endpoint.recorder.open("ep-fuzz")
    with queue_drained_into(endpoint, engine.generate), \
            httpx.Client(base_url=endpoint.base_url, headers={"Authorization": "Bearer ep-fuzz"}, timeout=20) as client:
        yield client
    endpoint.close()


def _check_answer(response: httpx.Response) -> None:
    assert response.status_code in (200, 400), (response.status_code, response.text[:500])
    if response.status_code == 400:
        assert response.json()["error"]["message"]


@FUZZ
@given(body=chat_bodies)
def test_fuzzed_chat_requests_are_answered_or_refused_as_400(served, body):
    _check_answer(served.post("/chat/completions", content=json.dumps(body, allow_nan=True)))


@FUZZ
@given(body=image_chat_bodies)
def test_fuzzed_image_parts_are_answered_or_refused_as_400(served, body):
    """Image content parts reach the endpoint's image parsers (data URL, header, Pillow) before a text-only actor
    refuses them: whatever the bytes, a 400 naming the part, never a 500."""
    _check_answer(served.post("/chat/completions", content=json.dumps(body, allow_nan=True)))


@FUZZ
@given(body=completion_bodies)
def test_fuzzed_completion_requests_are_answered_or_refused_as_400(served, body):
    _check_answer(served.post("/completions", content=json.dumps(body, allow_nan=True)))


@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v, allow_nan=True).encode()))
def test_fuzzed_raw_bodies_are_answered_or_refused_as_400(served, raw):
    _check_answer(served.post("/completions", content=raw))


@FUZZ
@given(raw=st.binary(max_size=400), suffix=st.sampled_from([".jsonl", ".json"]))
def test_fuzzed_data_files_give_rows_or_data_errors(tmp_path_factory, raw, suffix):
    path = tmp_path_factory.mktemp("fuzz") / f"rows{suffix}"
    path.write_bytes(raw)
    try:
        rows = read_rows(str(path))
    except DataError:
        return
    for index in range(len(rows)):
        try:
            make_row(lambda row, p, i: row, rows, str(path), index)
        except DataError as err:
            assert str(path) in str(err)


@FUZZ
@given(rows=st.lists(st.dictionaries(st.text(max_size=6), st.text(max_size=12) | st.integers(), max_size=3),
                     min_size=1, max_size=5))
def test_any_json_lines_file_reads_back_row_for_row(tmp_path_factory, rows):
    """Whatever characters the strings hold (U+2028, U+0085, control characters), one line is one row."""
    path = tmp_path_factory.mktemp("fuzz") / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    read = read_rows(str(path))
    assert [make_row(lambda row, p, i: row, read, str(path), i) for i in range(len(read))] == rows


override_keys = st.sampled_from(["train.seed", "train.agent_kwargs.x", "algo.kl.init_coef", "rollout.temperature",
                                 "data.max_len", "reward.remote_url", "nope.key", "train", ""]) | st.text(max_size=12)
override_values = st.text(max_size=20) | st.sampled_from(["${oc.env:NOPE_NOT_SET}", "${oc.env:HOME}", "[1,2",
                                                           "{a: 1}", "${train.seed}", "[" * 500, "null", "-1e999"])


@FUZZ
@given(overrides=st.lists(st.tuples(override_keys, override_values).map(lambda kv: f"{kv[0]}={kv[1]}") |
                          st.text(max_size=20), max_size=4))
def test_fuzzed_overrides_give_a_config_or_a_config_error(overrides):
    saved = dict(redact.ENV_SOURCES)
    try:
        load_config(None, overrides)
    except ConfigError as err:
        assert str(err)
    finally:
        redact.ENV_SOURCES.clear()
        redact.ENV_SOURCES.update(saved)


@FUZZ
@given(text=st.text(max_size=200) | st.sampled_from(["[" * 5000, "a: &x [*x]", "- - - -", "train: {seed: x}"]))
def test_fuzzed_config_files_give_a_config_or_a_config_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "run.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as err:
        assert str(path) in str(err) or "invalid config" in str(err)
