"""RemoteRewardModel against small real HTTP servers on loopback (stdlib http.server in threads)."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hpc_rlhf.rewards.remote_rm import RemoteRewardError, RemoteRewardModel, chunk_bounds, normalize_url


class FakeRewardServer:
    """``POST`` answers ``respond(payload, call_index) -> (status, body)``; records every payload."""

    def __init__(self, respond):
        self.respond = respond
        self.payloads: list[dict] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with outer._lock:
                    payload = json.loads(body)
                    outer.payloads.append(payload)
                    outer.paths.append(self.path)
                    index = len(outer.payloads) - 1
                status, text = outer.respond(payload, index)
                data = text.encode() if isinstance(text, str) else json.dumps(text).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


def length_rewards(payload, _index):
    """rewards = len(query), scores = 10 * that, one extra log per sample and one per batch."""
    rewards = [float(len(q)) for q in payload["query"]]
    return 200, {"rewards": rewards, "scores": [10 * r for r in rewards],
                 "extra_logs": {"n_prompts": [float(len(p)) for p in payload["prompts"]], "batch_const": 1.0}}


QUERIES = ["a", "bb", "ccc", "dddd", "eeeee"]
PROMPTS = ["p", "pp", "ppp", "pppp", "ppppp"]
LABELS = ["1", None, "3", "4", "5"]


def fast_client(urls, **kw):
    return RemoteRewardModel(urls, **{"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, **kw})


def test_two_urls_shard_in_order_and_reassemble():
    with FakeRewardServer(length_rewards) as a, FakeRewardServer(length_rewards) as b, \
            fast_client([a.url, b.url]) as rm:
        out = rm(QUERIES, PROMPTS, LABELS)
    assert out.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert out.scores.tolist() == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert out.extra_logs["n_prompts"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert out.extra_logs["batch_const"].tolist() == [1.0] * 5  # one number per batch is broadcast
    assert out.rewards.dtype == torch.float32
    # contiguous shards: first 3 to the first URL, last 2 to the second, with their prompts and labels
    assert a.payloads == [{"query": QUERIES[:3], "prompts": PROMPTS[:3], "labels": LABELS[:3]}]
    assert b.payloads == [{"query": QUERIES[3:], "prompts": PROMPTS[3:], "labels": LABELS[3:]}]
    assert a.paths == b.paths == ["/get_reward"]


def test_batch_size_chunks_go_round_robin():
    with FakeRewardServer(length_rewards) as a, FakeRewardServer(length_rewards) as b, \
            fast_client([a.url, b.url], batch_size=2) as rm:
        out = rm(QUERIES, PROMPTS, None)
    assert out.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert sorted(p["query"] for p in a.payloads) == [["a", "bb"], ["eeeee"]]
    assert b.payloads == [{"query": ["ccc", "dddd"], "prompts": ["ppp", "pppp"], "labels": [None, None]}]


def test_scores_default_to_rewards_and_empty_batch_sends_nothing():
    def half(payload, _index):
        return 200, {"rewards": [0.5] * len(payload["query"])}

    with FakeRewardServer(half) as srv, fast_client([srv.url]) as rm:
        out = rm(["x", "y"], ["x", "y"], None)
        empty = rm([], [], [])
    assert out.scores.tolist() == [0.5, 0.5] and out.extra_logs == {}
    assert empty.rewards.shape == (0,) and len(srv.payloads) == 1


def test_server_error_twice_then_success_is_retried():
    def flaky(payload, index):
        return (500, "model is warming up") if index < 2 else length_rewards(payload, index)

    with FakeRewardServer(flaky) as srv, fast_client([srv.url], max_retries=3) as rm:
        out = rm(QUERIES, PROMPTS, LABELS)
    assert out.rewards.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert len(srv.payloads) == 3


def test_always_failing_server_raises_naming_url_attempts_and_cause():
    with FakeRewardServer(lambda p, i: (503, "overloaded: queue full")) as srv, \
            fast_client([srv.url], max_retries=2) as rm:
        with pytest.raises(RemoteRewardError) as info:
            rm(QUERIES, PROMPTS, LABELS)
    message = str(info.value)
    assert srv.url in message and "3 attempt" in message
    assert "HTTP 503" in message and "overloaded: queue full" in message
    assert info.value.url == srv.url and info.value.attempts == 3
    assert len(srv.payloads) == 3


def test_client_error_is_not_retried():
    with FakeRewardServer(lambda p, i: (422, '{"detail": "query: Field required"}')) as srv, \
            fast_client([srv.url]) as rm:
        with pytest.raises(RemoteRewardError, match="HTTP 422.*Field required") as info:
            rm(QUERIES, PROMPTS, LABELS)
    assert info.value.attempts == 1 and len(srv.payloads) == 1


@pytest.mark.parametrize("answer, expected", [
    ({"rewards": [1.0, 2.0]}, "2 values for a batch of 5"),
    ({"rewards": [1.0, "bad", 3.0, 4.0, 5.0]}, r"rewards\[1\] = 'bad' is not a number"),
    ({"scores": [1.0] * 5}, "without 'rewards'"),
    ([1, 2, 3], "JSON object"),
    ("<html>oops</html>", "not JSON"),
])
def test_malformed_answer_names_url(answer, expected):
    body = answer if isinstance(answer, str) else json.dumps(answer)
    with FakeRewardServer(lambda p, i: (200, body)) as srv, fast_client([srv.url]) as rm:
        with pytest.raises(RemoteRewardError, match=expected) as info:
            rm(QUERIES, PROMPTS, LABELS)
    assert srv.url in str(info.value)


def test_silent_server_times_out_within_bounded_time():
    # Listens (the kernel accepts the connection) but never reads or answers.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/get_reward"
    try:
        with fast_client([url], timeout_s=0.5, max_retries=2) as rm:
            start = time.monotonic()
            with pytest.raises(RemoteRewardError) as info:
                rm(QUERIES, PROMPTS, LABELS)
            elapsed = time.monotonic() - start
    finally:
        silent.close()
    assert url in str(info.value) and "3 attempt" in str(info.value) and "timed out" in str(info.value)
    assert 1.4 < elapsed < 5.0


def test_one_bad_url_among_good_ones_fails_the_call():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{closed.getsockname()[1]}/get_reward"
    closed.close()  # nothing listens: connection refused
    with FakeRewardServer(length_rewards) as good, fast_client([good.url, dead_url], max_retries=1) as rm:
        with pytest.raises(RemoteRewardError, match="2 attempt") as info:
            rm(QUERIES, PROMPTS, LABELS)
    assert info.value.url == dead_url and "ConnectError" in str(info.value)


def test_url_normalisation():
    assert normalize_url("node1:5000") == "http://node1:5000/get_reward"
    assert normalize_url("http://node1:5000/") == "http://node1:5000/get_reward"
    assert normalize_url("https://rm.example.org/get_reward") == "https://rm.example.org/get_reward"
    assert normalize_url("http://node1:5000/v2/score") == "http://node1:5000/v2/score"
    with pytest.raises(ValueError):
        normalize_url("  ")


def test_chunk_bounds_and_argument_checks():
    assert chunk_bounds(5, 2, None) == [(0, 3), (3, 5)]
    assert chunk_bounds(1, 4, None) == [(0, 1)]
    assert chunk_bounds(5, 2, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(0, 2, None) == []
    with pytest.raises(ValueError, match="at least one URL"):
        RemoteRewardModel([])
    with pytest.raises(ValueError, match="timeout_s"):
        RemoteRewardModel(["h:1"], timeout_s=0)
    with RemoteRewardModel(["h:1"]) as rm, pytest.raises(ValueError, match="one entry per sample"):
        rm(["a", "b"], ["a"], None)


def test_retry_wait_honours_retry_after_within_the_cap():
    from types import SimpleNamespace

    from hpc_rlhf.rewards.remote_rm import _TransientError

    def state(err, attempt=1):
        return SimpleNamespace(attempt_number=attempt, outcome=SimpleNamespace(exception=lambda: err))

    with RemoteRewardModel(["h:1"], backoff_s=0.01) as rm:
        assert rm._wait(state(_TransientError("HTTP 503", retry_after_s=7.0))) == 7.0
        assert rm._wait(state(_TransientError("HTTP 503", retry_after_s=1e6))) == 30.0  # capped
        assert 0.01 <= rm._wait(state(_TransientError("HTTP 500"))) <= 0.02  # backoff plus jitter
        assert 0.04 <= rm._wait(state(_TransientError("HTTP 500"), attempt=3)) <= 0.05
