"""The SandboxFusion client against a small local server that speaks SandboxFusion's /run_code over real HTTP."""

from __future__ import annotations

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hpc_rlhf.rewards.code import score_programs
from hpc_rlhf.sandbox.factory import make_sandbox
from hpc_rlhf.sandbox.remote import SandboxFusionClient
from hpc_rlhf.sandbox.result import ExecRequest


class _FakeSandboxFusion(BaseHTTPRequestHandler):
    """Answers like SandboxFusion: the program's behaviour is read from markers in its code."""

    requests: list[dict] = []
    fail_next = 0  # answer this many requests with HTTP 503 first

    def log_message(self, *args):  # keep the test output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if self.path != "/run_code":
            return self._send(404, {"detail": "Not Found"})
        if type(self).fail_next > 0:
            type(self).fail_next -= 1
            return self._send(503, {"detail": "busy"})
        code = body["code"]
        run = {"execution_time": 0.01, "stderr": "", "stdout": ""}
        status = "Success"
        if "SANDBOX_BROKEN" in code:
            return self._send(200, {"status": "SandboxError", "message": "pod died", "run_result": None})
        if "while True" in code:
            run.update(status="TimeLimitExceeded", return_code=None)
            status = "Failed"
        elif "raise" in code or "assert False" in code:
            run.update(status="Finished", return_code=1, stderr="Traceback ...\nAssertionError")
            status = "Failed"
        else:
            # What the program prints: its stdin upper-cased, then the code reward's end-of-tests marker, if any.
            markers = re.findall(r"print\('(tests-done-[0-9a-f]+)'\)", code)
            stdout = body["stdin"].upper() + "".join(m + "\n" for m in markers)
            run.update(status="Finished", return_code=0, stdout=stdout)
        self._send(200, {"status": status, "message": "", "compile_result": None, "run_result": run,
                         "executor_pod_name": None, "files": {}})

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    _FakeSandboxFusion.requests = []
    _FakeSandboxFusion.fail_next = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSandboxFusion)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_request_schema_and_verdicts(server):
    client = make_sandbox("remote", url=server)
    assert isinstance(client, SandboxFusionClient) and client.level == "remote"
    results = client.run_many([
        ExecRequest(code="print(input())", stdin="abc\n", time_limit_s=3, files={"data.txt": "héllo"}),
        ExecRequest(code="while True: pass"),
        ExecRequest(code="raise ValueError"),
        ExecRequest(code="SANDBOX_BROKEN"),
    ])
    assert [r.status for r in results] == ["ok", "timeout", "error", "sandbox_error"]
    assert results[0].stdout == "ABC\n"
    first = next(r for r in _FakeSandboxFusion.requests if r["code"] == "print(input())")
    assert first["language"] == "python" and first["run_timeout"] == 3 and first["stdin"] == "abc\n"
    assert base64.b64decode(first["files"]["data.txt"]).decode() == "héllo"


def test_retries_5xx_then_gives_a_sandbox_error_not_an_exception(server):
    _FakeSandboxFusion.fail_next = 2
    client = SandboxFusionClient(server, max_retries=2, retry_backoff_s=0.0)
    assert client.run(ExecRequest(code="print(1)")).status == "ok"
    _FakeSandboxFusion.fail_next = 10
    result = client.run(ExecRequest(code="print(1)"))
    assert result.status == "sandbox_error" and "503" in result.stderr


def test_unreachable_service_is_a_sandbox_error(server):
    client = SandboxFusionClient("http://127.0.0.1:9", max_retries=1, retry_backoff_s=0.0)
    assert client.run(ExecRequest(code="print(1)")).status == "sandbox_error"


def test_code_reward_through_the_remote_sandbox(server):
    client = make_sandbox("remote", url=server)
    scores = score_programs(client, ["print(1)", "def f(:", "while True: pass"],
                            [{"asserts": ["assert True", "assert False"]}, {"asserts": ["assert 1"]},
                             {"asserts": ["assert 1"]}])
    assert [(s.pass_fraction, s.verdict) for s in scores] == [(0.5, "runtime_error"), (0.0, "compile_error"),
                                                             (0.0, "timeout")]


def test_bad_urls_and_levels_are_refused():
    with pytest.raises(ValueError, match="needs the SandboxFusion"):
        make_sandbox("remote")
    with pytest.raises(ValueError, match="http"):
        SandboxFusionClient("sandbox:8080")
    with pytest.raises(ValueError, match="must be one of"):
        make_sandbox("docker")
