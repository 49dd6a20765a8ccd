"""Attacks through the run's other inputs: a hostile reward server, data files, secrets in the config, a user
file that blocks at import."""

from __future__ import annotations

import functools
import gzip
import json
import logging
import socket
import sys
import threading
import time
import tracemalloc
import types

import pytest

from hpc_rlhf.config import load_config, save_resolved_config
from hpc_rlhf.config.loader import RESOLVED_CONFIG_NAME
from hpc_rlhf.config.schema import LoggerConfig
from hpc_rlhf.data.sources import DataError, make_row, read_rows
from hpc_rlhf.rewards.remote_rm import RemoteRewardError, RemoteRewardModel
from hpc_rlhf.utils.metrics import MetricsLogger
from hpc_rlhf.utils.user_code import UserCodeImportError, import_user_file

MiB = 1024 * 1024


class RawServer:
    """A loopback server that reads one request, then answers with ``respond(conn)`` (raw bytes on the socket)."""

    def __init__(self, respond):
        self.respond = respond
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/get_reward"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                body += conn.recv(65536)
            try:
                self.respond(conn, self.stop)
            except OSError:
                pass

    def close(self):
        self.stop.set()
        self.sock.close()


def test_a_server_trickling_its_answer_is_held_to_the_whole_attempt_deadline():
    answer = json.dumps({"rewards": [1.0]}).encode()

    def trickle(conn, stop):  # a byte every 0.3 s: each read is well inside a 1 s read timeout
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(answer))
        for byte in answer:
            if stop.is_set():
                return
            conn.sendall(bytes([byte]))
            time.sleep(0.3)

    server = RawServer(trickle)
    try:
        with RemoteRewardModel([server.url], timeout_s=1.0, max_retries=0) as rm:
            start = time.monotonic()
            with pytest.raises(RemoteRewardError, match="deadline"):
                rm(["q"], ["p"])
            elapsed = time.monotonic() - start
    finally:
        server.close()
    assert elapsed < 4.0, f"a 1 s deadline took {elapsed:.1f} s (the answer trickles in {len(answer) * 0.3:.0f} s)"


def test_an_oversized_answer_is_refused_without_holding_it():
    def flood(conn, stop):  # 150 MiB of JSON whitespace, then a valid answer, no Content-Length
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n")
        block = b" " * MiB
        for _ in range(150):
            if stop.is_set():
                return
            conn.sendall(block)
        conn.sendall(json.dumps({"rewards": [1.0]}).encode())

    server = RawServer(flood)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        with RemoteRewardModel([server.url], timeout_s=60.0, max_retries=0) as rm:
            with pytest.raises(RemoteRewardError, match="max_response_bytes"):
                rm(["q"], ["p"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.close()
    assert peak - base < 100 * MiB, f"{(peak - base) / MiB:.0f} MiB held for a refused answer"


def _gzip_layers(data: bytes, layers: int) -> bytes:
    for _ in range(layers):
        data = gzip.compress(data, compresslevel=9, mtime=0)
    return data


_BOMB_CAP = MiB


@functools.cache
def _bomb(layers: int) -> bytes:
    """64 MiB of JSON whitespace then an answer: ~64 kB on the wire in one gzip layer, a few kB in three."""
    return _gzip_layers(b" " * (64 * MiB) + json.dumps({"rewards": [1.0]}).encode(), layers)


def _peak_of_a_refused_answer(body: bytes, encoding: str, match: str) -> int:
    """Serve ``body`` under ``Content-Encoding: encoding`` to a client capped at 1 MiB; returns the bytes the
    client held at its peak while refusing it (the refusal must match ``match``)."""
    def answer(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: %s\r\n"
                     b"Content-Length: %d\r\n\r\n" % (encoding.encode(), len(body)) + body)

    server = RawServer(answer)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        with RemoteRewardModel([server.url], timeout_s=60.0, max_retries=0, max_response_bytes=_BOMB_CAP) as rm:
            with pytest.raises(RemoteRewardError, match=match):
                rm(["q"], ["p"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        server.close()
    return peak - base


def test_stacked_content_encodings_are_refused_before_decoding():
    body = _bomb(3)
    assert len(body) < 16 * 1024
    held = _peak_of_a_refused_answer(body, "gzip, gzip, gzip", "stacks 3 codings")
    assert held < 8 * MiB, f"{held / MiB:.0f} MiB decoded from {len(body)} bytes before the refusal"


def test_a_compression_bomb_is_refused_at_the_cap_of_decoded_bytes():
    body = _bomb(1)
    held = _peak_of_a_refused_answer(body, "gzip", "max_response_bytes")
    assert held < 8 * MiB, f"{held / MiB:.0f} MiB decoded from {len(body)} bytes before the refusal"


def test_one_gzip_layer_within_the_cap_is_read():
    answer = _gzip_layers(json.dumps({"rewards": [0.5]}).encode(), 1)

    def respond(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(answer) + answer)

    server = RawServer(respond)
    try:
        with RemoteRewardModel([server.url], timeout_s=60.0, max_retries=0) as rm:
            assert rm(["q"], ["p"]).rewards.tolist() == [0.5]
    finally:
        server.close()


def test_a_proxy_in_the_environment_is_named_and_url_credentials_never_shown(monkeypatch, caplog):
    monkeypatch.setenv("HTTP_PROXY", "http://proxyuser:proxypass@127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with caplog.at_level(logging.WARNING, logger="hpc_rlhf.rewards.remote_rm"):
        rm = RemoteRewardModel(["http://rmuser:rmsecret@rm.invalid:5000/get_reward"], timeout_s=2, max_retries=0)
    rm.close()
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "proxy" in warning and "127.0.0.1:9" in warning and "NO_PROXY=rm.invalid" in warning
    assert "proxypass" not in warning and "rmsecret" not in warning and "rmsecret" not in repr(rm)


def test_url_credentials_are_not_in_the_error_of_a_failed_reward_call(monkeypatch):
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    with RemoteRewardModel([f"http://rmuser:rmsecret@127.0.0.1:{port}/get_reward"], timeout_s=2,
                           max_retries=0) as rm, pytest.raises(RemoteRewardError) as info:
        rm(["q"], ["p"])
    assert "rmsecret" not in str(info.value) and "***@127.0.0.1" in str(info.value)


def _rows(path):
    rows = read_rows(str(path))
    out = []
    for index in range(len(rows)):
        try:
            out.append(make_row(lambda row, p, i: row, rows, str(path), index))
        except DataError as err:
            out.append(err)
    return out


def test_jsonl_rows_holding_unicode_line_separators_stay_whole(tmp_path):
    rows = [{"input": "a\u2028b", "label": "c\u2029d"}, {"input": "e\x85f\x1cg\x0bh", "label": "i"}]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n", encoding="utf-8")
    assert _rows(path) == rows


def test_jsonl_bad_bytes_and_deep_nesting_are_named_by_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"input": "ok"}\n{"input": "\xff\xfe"}\n' + b"[" * 100_000 + b"\n{\"input\": \"last\"}\n")
    got = _rows(path)
    assert got[0] == {"input": "ok"} and got[3] == {"input": "last"}
    assert isinstance(got[1], DataError) and got[1].line == 2 and "not UTF-8" in str(got[1])
    assert isinstance(got[2], DataError) and got[2].line == 3 and "nested too deeply" in str(got[2])
    json_file = tmp_path / "p.json"
    json_file.write_bytes(b'[{"input": "a"},\n {"input": "\xff"}]')
    with pytest.raises(DataError, match="line 2: not UTF-8"):
        read_rows(str(json_file))


def test_a_secret_given_as_env_interpolation_is_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_RLHF_TEST_SECRET", "sk-test-do-not-write")
    cfg = load_config(None, ["train.agent_kwargs.api_key=${oc.env:HPC_RLHF_TEST_SECRET}",
                             "reward.remote_url=[http://rmuser:rmsecret@rm.invalid:5000/get_reward]",
                             f"train.output_dir={tmp_path}"])
    assert cfg.train.agent_kwargs["api_key"] == "sk-test-do-not-write"  # the run itself gets the value
    saved = save_resolved_config(cfg, tmp_path)
    assert saved.name == RESOLVED_CONFIG_NAME
    text = saved.read_text()
    assert "sk-test-do-not-write" not in text and "rmsecret" not in text
    assert "${oc.env:HPC_RLHF_TEST_SECRET}" in text and "http://***@rm.invalid:5000" in text
    assert load_config(saved).train.agent_kwargs["api_key"] == "sk-test-do-not-write"  # the saved file reloads

    seen = {}
    fake_wandb = types.SimpleNamespace(init=lambda **kw: seen.update(kw) or types.SimpleNamespace(finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    logger = MetricsLogger(tmp_path / "m", LoggerConfig(use_wandb=True, use_tensorboard=False),
                           cfg.model_dump(mode="json"))
    logger.close()
    logged = json.dumps(seen["config"])
    assert "sk-test-do-not-write" not in logged and "rmsecret" not in logged
    assert "${oc.env:HPC_RLHF_TEST_SECRET}" in logged


def test_a_user_file_that_blocks_at_import_fails_naming_the_file(tmp_path):
    path = tmp_path / "reward_blocks.py"
    path.write_text("import threading\nthreading.Event().wait()  # a network call that never returns\n")
    with pytest.raises(UserCodeImportError, match="reward_blocks.py did not finish within 1 s"):
        import_user_file(str(path), "reward", timeout_s=1.0)
