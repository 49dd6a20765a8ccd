"""Idle connections against the real servers: the agents' endpoint and the reward-model server's.

A client that connects and never sends a request used to hold one of the server's file descriptors forever;
1,100 of them exhausted a rollout rank's descriptors. The attacker here is a separate process (its own descriptor
limit raised), so the server's descriptors are this process's: the test counts them.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint  # noqa: E402
from hpc_rlhf.serving.rm_server import BackgroundServer  # noqa: E402

NUM_IDLE = 1100
MAX_CONNECTIONS = 64

# Opens the connections and reports how many it holds; on a line from stdin, waits for the server to close each
# one (recv gives b'') and reports how many it closed.
IDLE_CLIENT = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
port, count = int(sys.argv[1]), int(sys.argv[2])
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
print(len(held), flush=True)
sys.stdin.readline()
closed = 0
for sock in held:
    sock.settimeout(60)
    try:
        closed += sock.recv(1) == b""
    except OSError as err:  # a reset (an aborted connection) is closed too; a timeout is not
        closed += not isinstance(err, TimeoutError)
print(closed, flush=True)
"""


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _flood_then_check(port: int, real_request) -> None:
    """``NUM_IDLE`` idle connections to ``port``: the server's descriptors stay bounded, ``real_request`` is
    served meanwhile, and every idle connection is closed by the server."""
    before = _open_fds()
    attacker = subprocess.Popen([sys.executable, "-c", IDLE_CLIENT, str(port), str(NUM_IDLE)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout is not None and attacker.stdin is not None
        assert int(attacker.stdout.readline()) == NUM_IDLE
        assert real_request().status_code == 200, "a real request was not served during the flood"
        grown = _open_fds() - before
        assert grown <= MAX_CONNECTIONS + 8, f"{grown} descriptors held for {NUM_IDLE} idle connections"
        attacker.stdin.write("go\n")
        attacker.stdin.flush()
        closed = int(attacker.stdout.readline())
        assert closed == NUM_IDLE, f"{NUM_IDLE - closed} idle connections were left open by the server"
    finally:
        attacker.kill()
        attacker.wait()


def test_an_idle_flood_does_not_exhaust_the_endpoint(tiny_tokenizer_and_engine):
    tokenizer, _ = tiny_tokenizer_and_engine
    endpoint = OpenAIEndpoint(tokenizer, max_len=96, listen="tcp", max_connections=MAX_CONNECTIONS,
                              first_request_timeout_s=1.0).start()
    endpoint.recorder.open("ep-flood")
    try:
        assert endpoint.port is not None
        _flood_then_check(endpoint.port, lambda: httpx.get(f"{endpoint.base_url}/models", timeout=30,
                                                           headers={"Authorization": "Bearer ep-flood"}))
    finally:
        endpoint.close()


async def _ok_app(scope, receive, send) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def test_an_idle_flood_does_not_exhaust_the_reward_server():
    server = BackgroundServer(_ok_app, max_connections=MAX_CONNECTIONS, first_request_timeout_s=1.0)
    server.start()
    try:
        _flood_then_check(server.port, lambda: httpx.get(f"{server.url}/health", timeout=30))
    finally:
        server.stop()


def test_the_job_local_endpoint_listens_on_a_private_unix_socket(tiny_tokenizer_and_engine):
    tokenizer, _ = tiny_tokenizer_and_engine
    endpoint = OpenAIEndpoint(tokenizer, max_len=96).start()
    endpoint.recorder.open("ep-unix")
    try:
        assert endpoint.port is None and endpoint.socket_path is not None  # no TCP port at all
        folder = os.path.dirname(endpoint.socket_path)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, "other users could reach the socket"
        with endpoint.http_client(timeout=30) as client:
            reply = client.get("/models", headers={"Authorization": "Bearer ep-unix"})
        assert reply.status_code == 200 and reply.json()["data"][0]["id"] == "policy"
    finally:
        endpoint.close()
    assert not os.path.exists(folder), "close() left the socket's folder behind"
