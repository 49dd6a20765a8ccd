"""The reward-model server: scorer, micro-batcher, HTTP app (uvicorn on loopback), CLI, with a tiny RM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from hpc_rlhf.cli import serve_rm
from hpc_rlhf.models.forward import sequence_scores
from hpc_rlhf.models.loading import load_value_model
from hpc_rlhf.models.tiny import build_tiny_reward_model
from hpc_rlhf.rewards.remote_rm import RemoteRewardError, RemoteRewardModel
from hpc_rlhf.serving.guards import API_KEY_ENV
from hpc_rlhf.serving.loadtest import run_load, start_server
from hpc_rlhf.serving.rm_server import BackgroundServer, MicroBatcher, RewardScorer, RewardServerError, create_app
from hpc_rlhf.world.launch_env import free_port

MAX_LEN = 48
TEXTS = ["<bos>Q: 1+1=\nA: 2<eos>", "hello world", "Q: 3+4=\nA: 7", "x", "a much longer text " * 6]


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm")


@pytest.fixture(scope="module")
def scorer(rm_path) -> RewardScorer:
    return RewardScorer(rm_path, max_len=MAX_LEN, device="cpu", batch_size=16)


@pytest.fixture(scope="module")
def server(scorer):
    # 20 ms window: generous, so concurrent test requests reliably share forwards even on a busy CPU.
    with BackgroundServer(create_app(scorer, max_wait_s=0.02)) as srv:
        yield srv


def direct_scores(rm_path: Path, texts: list[str], padding_side: str = "right") -> list[float]:
    """Reference: tokenizer + model + sequence_scores, without the server's code."""
    tok = AutoTokenizer.from_pretrained(rm_path)
    tok.padding_side, tok.truncation_side = padding_side, "left"
    model = load_value_model(str(rm_path), torch.float32).eval()
    enc = tok(texts, add_special_tokens=False, truncation=True, max_length=MAX_LEN, padding=True,
              return_tensors="pt")
    with torch.no_grad():
        return sequence_scores(model, enc["input_ids"], enc["attention_mask"]).tolist()


def test_scorer_matches_direct_model_with_either_padding(rm_path, scorer):
    got = scorer.score(TEXTS)
    assert got == pytest.approx(direct_scores(rm_path, TEXTS, "right"), abs=1e-5)
    assert got == pytest.approx(direct_scores(rm_path, TEXTS, "left"), abs=1e-5)
    assert got == pytest.approx([scorer.score([t])[0] for t in TEXTS], abs=1e-5)  # batching changes nothing
    assert len(set(round(s, 4) for s in got)) == len(TEXTS)


def test_scorer_truncates_on_the_left_and_strips_padding(scorer):
    long_text = "0123456789" * 10  # char-level tokenizer: one token per char
    assert scorer.score([long_text]) == pytest.approx(scorer.score([long_text[-MAX_LEN:]]), abs=1e-5)
    assert scorer.score(["<pad><pad>hello<pad>"]) == pytest.approx(scorer.score(["hello"]), abs=1e-5)
    with pytest.raises(ValueError, match=r"query\[1\] has no tokens"):
        scorer.encode(["ok", "<pad>"])


def test_normalisation_from_config_and_missing_stats_fail_at_startup(rm_path, scorer, tmp_path):
    normed = tmp_path / "rm_norm"
    normed.mkdir()
    for f in rm_path.iterdir():
        (normed / f.name).symlink_to(f)
    (normed / "config.json").unlink()
    config = json.loads((rm_path / "config.json").read_text())
    (normed / "config.json").write_text(json.dumps({**config, "reward_mean": 0.5, "reward_std": 2.0}))
    raw = scorer.score(TEXTS)
    got = RewardScorer(normed, max_len=MAX_LEN, device="cpu", normalize=True).score(TEXTS)
    assert got == pytest.approx([(r - 0.5) / 2.0 for r in raw], abs=1e-5)

    with pytest.raises(RewardServerError, match="reward_mean and reward_std.*config.json"):
        RewardScorer(rm_path, normalize=True)
    with pytest.raises(SystemExit, match="reward_mean"):
        serve_rm.main(["--reward_pretrain", str(rm_path), "--normalize", "--port", "1"])


def test_value_head_prefix_and_missing_head(rm_path, scorer, tmp_path):
    renamed = tmp_path / "rm_value_head"
    renamed.mkdir()
    for f in rm_path.iterdir():
        if f.suffix != ".safetensors":
            (renamed / f.name).symlink_to(f)
    (weights_file,) = rm_path.glob("*.safetensors")
    weights = load_file(weights_file)
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, renamed / weights_file.name, metadata={"format": "pt"})
    got = RewardScorer(renamed, max_len=MAX_LEN, device="cpu", value_head_prefix="value_head").score(TEXTS)
    assert got == pytest.approx(scorer.score(TEXTS), abs=1e-5)
    with pytest.raises(RewardServerError, match="no value head score.weight"):
        RewardScorer(renamed, device="cpu")


def test_http_scores_equal_direct_scores(rm_path, server):
    answer = httpx.post(server.url + "/get_reward", json={"query": TEXTS, "prompts": TEXTS, "labels": [None] * 5},
                        timeout=30).json()
    expected = direct_scores(rm_path, TEXTS)
    assert answer["rewards"] == pytest.approx(expected, abs=1e-5)
    assert answer["scores"] == pytest.approx(expected, abs=1e-5)
    assert httpx.post(server.url + "/get_reward", json={"query": []}, timeout=30).json()["rewards"] == []


@pytest.mark.parametrize("body, status, message", [
    (b'{"prompts": ["a"]}', 422, "query: Field required"),
    (b'{"query": "just a string"}', 422, "query: Input should be a valid list"),
    (b'{"query": ["ok", 3]}', 422, "query.1: Input should be a valid string"),
    (b'["a", "b"]', 422, "JSON object"),
    (b'{"query": [', 400, "not valid JSON"),
    (b'{"query": [""]}', 400, r"query[0] has no tokens"),
    (b'{"query": ["a"], "labels": "x"}', 422, "labels: Input should be a valid list"),
    pytest.param(b"[" * 100_000, 400, "nested too deeply", id="deeply-nested"),
])
def test_malformed_requests_get_4xx_with_reason(server, body, status, message):
    response = httpx.post(server.url + "/get_reward", content=body, timeout=30)
    assert response.status_code == status
    assert message in response.json()["detail"]


def test_health(server, rm_path):
    answer = httpx.get(server.url + "/health", timeout=30)
    assert answer.status_code == 200
    assert answer.json()["status"] == "ok" and answer.json()["model"] == rm_path.name


def test_concurrent_requests_share_forwards(rm_path, scorer, server):
    texts = [f"Q: {i}+{i}=\nA: {2 * i}" for i in range(16)]
    expected = direct_scores(rm_path, texts)
    results: dict[int, list[float]] = {}
    barrier = threading.Barrier(16, timeout=30)

    def ask(i: int) -> None:
        with httpx.Client(timeout=30) as client:
            barrier.wait()
            results[i] = client.post(server.url + "/get_reward", json={"query": [texts[i]]}).json()["rewards"]

    forwards_before = scorer.num_forwards
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    forwards = scorer.num_forwards - forwards_before
    assert sorted(results) == list(range(16))
    for i in range(16):
        assert results[i] == pytest.approx([expected[i]], abs=1e-5), i
    assert 1 <= forwards < 16, f"{forwards} forwards for 16 concurrent requests: no micro-batching"


def test_remote_client_against_real_server(rm_path, server):
    with RemoteRewardModel([server.url + "/get_reward", server.url], timeout_s=30, max_retries=0) as rm:
        out = rm(TEXTS, TEXTS, None)
    assert out.rewards.tolist() == pytest.approx(direct_scores(rm_path, TEXTS), abs=1e-5)
    assert torch.equal(out.rewards, out.scores)


# --------------------------------------------------------------------------- batcher and shutdown, no model


def test_micro_batcher_merges_caps_and_propagates_errors():
    calls: list[list[int]] = []

    def score_fn(items):
        calls.append(list(items))
        if -1 in items:
            raise RuntimeError("boom")
        return [float(x) * 10 for x in items]

    async def scenario():
        batcher = MicroBatcher(score_fn, max_batch_size=4, max_wait_s=0.05)
        batcher.start()
        try:
            merged = await asyncio.gather(*(batcher.submit([i, i + 100]) for i in range(4)))
            failed = await asyncio.gather(batcher.submit([-1]), return_exceptions=True)
            empty = await batcher.submit([])
        finally:
            await batcher.close()
        with pytest.raises(RuntimeError, match="not running"):
            await batcher.submit([1])
        return merged, failed, empty, batcher.num_batches

    merged, failed, empty, num_batches = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert merged == [[10.0 * i, 10.0 * (i + 100)] for i in range(4)]
    assert [len(c) for c in calls[:2]] == [4, 4]  # 8 texts, cap 4: two calls, no request split
    assert isinstance(failed[0], RuntimeError) and "boom" in str(failed[0])
    assert empty == [] and num_batches == 2


class SlowScorer:
    """Duck-typed RewardScorer whose forward takes a while, to catch a request in flight."""

    batch_size, device, normalize, model_name, model_path = 8, "cpu", False, "slow", Path("slow")
    num_forwards = 0

    def __init__(self):
        self.started = threading.Event()

    def encode(self, texts, first_index=0):
        return [[len(t)] for t in texts]

    def score_ids(self, ids):
        self.started.set()
        time.sleep(0.5)
        return [float(i[0]) for i in ids]


def test_graceful_shutdown_finishes_in_flight_request():
    scorer = SlowScorer()
    server = BackgroundServer(create_app(scorer, max_wait_s=0.0)).start()
    result: dict[str, httpx.Response] = {}
    client = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(server.url + "/get_reward", json={"query": ["abc"]}, timeout=10)))
    client.start()
    assert scorer.started.wait(10)
    server.stop(timeout_s=10)  # what uvicorn does on SIGTERM: drain, then the lifespan stops the batcher
    client.join(10)
    assert not server._thread.is_alive()
    assert result["r"].status_code == 200 and result["r"].json()["rewards"] == [3.0]


def test_cli_serves_and_stops_on_sigterm(rm_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", API_KEY_ENV: "cli-secret"}
    auth = {"Authorization": "Bearer cli-secret"}
    proc = start_server(rm_path, port, ["--max_len", str(MAX_LEN), "--log_level", "info"], startup_timeout_s=60,
                        api_key="cli-secret", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        assert httpx.post(url + "/get_reward", json={"query": TEXTS[:2]}, timeout=30).status_code == 401
        answer = httpx.post(url + "/get_reward", json={"query": TEXTS[:2]}, headers=auth, timeout=30).json()
        assert answer["rewards"] == pytest.approx(direct_scores(rm_path, TEXTS[:2]), abs=1e-5)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Application shutdown complete" in output, output


# --------------------------------------------------------------------------- request bounds


@pytest.fixture(scope="module")
def small_limits_server(scorer):
    with BackgroundServer(create_app(scorer, max_body_bytes=2000, max_texts=4)) as srv:
        yield srv


@pytest.mark.parametrize("body, status, message", [
    (json.dumps({"query": ["x" * 3000]}).encode(), 413, "over the limit of 2000 bytes (max_body_bytes)"),
    (json.dumps({"query": ["a"] * 5}).encode(), 413, "5 texts in 'query', over the limit of 4 (max_texts)"),
    (json.dumps({"query": ["a"], "prompts": ["p", "q"]}).encode(), 422, "'prompts' has 2 entries but 'query' has 1"),
])
def test_oversized_requests_get_413_naming_the_limit(small_limits_server, body, status, message):
    response = httpx.post(small_limits_server.url + "/get_reward", content=body, timeout=30)
    assert response.status_code == status
    assert message in response.json()["detail"]


def test_chunked_body_over_the_limit_gets_413(small_limits_server):
    def chunks():
        for _ in range(10):
            yield b" " * 500  # no Content-Length: the limit is enforced while streaming
    response = httpx.post(small_limits_server.url + "/get_reward", content=chunks(), timeout=30)
    assert response.status_code == 413 and "2000 bytes" in response.json()["detail"]


# Within the default limits (16 MiB, 8192 texts), and seconds of tokenising and scoring on a CPU.
LARGE_QUERY = [f"Q: {i}+{i}=\nA: {2 * i} " + "lorem ipsum dolor " * 100 for i in range(8000)]


def _health_latencies(url: str, busy: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(timeout=30) as client:
        while busy.is_set():
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    return latencies


def test_health_answers_while_a_large_request_is_scored(scorer, server):
    body = json.dumps({"query": LARGE_QUERY}).encode()
    assert len(body) < 16 << 20
    busy, answer = threading.Event(), {}
    busy.set()

    def score() -> None:
        try:
            answer["response"] = httpx.post(server.url + "/get_reward", content=body, timeout=300)
        finally:
            busy.clear()

    worker = threading.Thread(target=score)
    worker.start()
    latencies = _health_latencies(server.url, busy)
    worker.join()
    assert answer["response"].status_code == 200 and len(answer["response"].json()["rewards"]) == len(LARGE_QUERY)
    assert len(latencies) >= 3, latencies
    assert max(latencies) < 1.0, f"/health took {max(latencies):.2f}s while a large request was scored"


def test_work_of_a_disconnected_client_is_dropped(scorer, server):
    body = json.dumps({"query": LARGE_QUERY}).encode()
    needed = -(-len(LARGE_QUERY) // scorer.batch_size)
    before = scorer.num_forwards
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/get_reward", content=body, timeout=httpx.Timeout(30, read=1.5))
    time.sleep(1.0)  # the server notices between two slices of the request
    settled = scorer.num_forwards
    time.sleep(1.0)
    assert scorer.num_forwards == settled, "still scoring for a client that has gone"
    assert settled - before < needed, f"all {needed} forwards ran for a client that disconnected"
    start = time.monotonic()
    assert httpx.post(server.url + "/get_reward", json={"query": TEXTS}, timeout=30).status_code == 200
    assert time.monotonic() - start < 5


# --------------------------------------------------------------------------- abuse: key, back-pressure, timeouts


@pytest.fixture(scope="module")
def keyed_server(scorer):
    # A key read from a file keeps its newline; white space around a key is not part of it.
    with BackgroundServer(create_app(scorer, api_key="s3cret\n")) as srv:
        yield srv


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                                     {"Authorization": "Bearer s3cret2"}, {"Authorization": "s3cret"}])
def test_api_key_is_required_on_every_path(keyed_server, headers):
    for response in (httpx.post(keyed_server.url + "/get_reward", json={"query": TEXTS}, headers=headers, timeout=30),
                     httpx.get(keyed_server.url + "/health", headers=headers, timeout=30),
                     httpx.get(keyed_server.url + "/docs", headers=headers, timeout=30)):
        assert response.status_code == 401, response.text
        assert "API key" in response.json()["detail"] and response.headers["www-authenticate"] == "Bearer"


def test_api_key_accepted_and_sent_by_the_client(rm_path, keyed_server):
    ok = {"Authorization": "bearer s3cret"}  # the scheme is case-insensitive
    assert httpx.get(keyed_server.url + "/health", headers=ok, timeout=30).status_code == 200
    with RemoteRewardModel(keyed_server.url, timeout_s=30, max_retries=0, api_key="s3cret") as rm:
        assert rm(TEXTS, TEXTS, None).rewards.tolist() == pytest.approx(direct_scores(rm_path, TEXTS), abs=1e-5)
    with RemoteRewardModel(keyed_server.url, timeout_s=30, max_retries=3, api_key="nope") as rm, \
            pytest.raises(RemoteRewardError, match="HTTP 401") as info:
        rm(TEXTS, TEXTS, None)
    assert info.value.attempts == 1 and "nope" not in str(info.value) and "nope" not in repr(rm)


def _post_in_thread(url: str, body: dict, results: list, **client_kw) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(httpx.post(url, json=body, timeout=30, **client_kw)))
    thread.start()
    return thread


def test_full_queue_answers_503_with_retry_after_and_the_client_retries():
    scorer = SlowScorer()
    app = create_app(scorer, max_wait_s=0.0, max_pending=1, retry_after_s=1)
    with BackgroundServer(app) as srv:
        first: list[httpx.Response] = []
        thread = _post_in_thread(srv.url + "/get_reward", {"query": ["abc"]}, first)
        assert scorer.started.wait(10)
        busy = httpx.post(srv.url + "/get_reward", json={"query": ["de"]}, timeout=30)
        health = httpx.get(srv.url + "/health", timeout=30).json()  # admission does not apply to /health
        thread.join(30)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert "max_pending" in busy.json()["detail"]
        assert health["pending"] == 1 and health["rejected_busy"] == 1
        assert first[0].status_code == 200 and first[0].json()["rewards"] == [3.0]

        # The trainer's client waits for Retry-After and gets its answer once the slot is free.
        scorer.started.clear()
        thread = _post_in_thread(srv.url + "/get_reward", {"query": ["abcd"]}, first)
        assert scorer.started.wait(10)
        with RemoteRewardModel(srv.url, timeout_s=30, max_retries=5, backoff_s=0.05) as rm:
            assert rm(["xy"], ["xy"], None).rewards.tolist() == [2.0]
        thread.join(30)
        assert app.state.guard.rejected_busy >= 2 and app.state.guard.pending == 0


def _read_http_answer(sock: socket.socket) -> str:
    """Status line, headers and the Content-Length body of one HTTP/1.1 answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-answer: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed mid-body: {data!r}"
        body += chunk
    return (head + b"\r\n\r\n" + body).decode()


def test_request_timeout_answers_504_and_slow_body_408():
    scorer = SlowScorer()  # 0.5 s per forward
    with BackgroundServer(create_app(scorer, max_wait_s=0.0, request_timeout_s=0.2)) as srv:
        late = httpx.post(srv.url + "/get_reward", json={"query": ["abc"]}, timeout=30)
        assert late.status_code == 504 and "request_timeout_s" in late.json()["detail"]

        # A client that announces 20 bytes, sends 10 and stalls: answered 408, not waited for.
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 20\r\n\r\n" + b'{"query": ')
            answer = _read_http_answer(sock)
        assert answer.startswith("HTTP/1.1 408") and "request_timeout_s" in answer, answer
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200


def test_load_run_answers_every_request_correctly(server):
    """200 requests of 4 texts, 16 in flight: every answer equals the text's score asked alone."""
    report = asyncio.run(asyncio.wait_for(run_load(server.url, num_requests=200, concurrency=16), 120))
    assert report.ok, report
    assert report.num_ok == 200 and report.p50_ms <= report.p99_ms
