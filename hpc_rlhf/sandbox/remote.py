"""A client for a SandboxFusion service (bytedance/SandboxFusion), behind the same interface as the local sandbox.

It speaks SandboxFusion's ``POST /run_code``: the request ``{"code", "language": "python", "stdin",
"run_timeout", "compile_timeout", "memory_limit_MB", "files": {name: base64}}``, the reply ``{"status":
"Success" | "Failed" | "SandboxError", "message", "compile_result", "run_result": {"status": "Finished" |
"TimeLimitExceeded" | "Error", "execution_time", "return_code", "stdout", "stderr"}}``. Connection errors and
5xx replies are retried a bounded number of times; what then still fails comes back as ``sandbox_error`` for that
sample (the batch goes on), never as a hang: every request has a timeout.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from hpc_rlhf.sandbox.limits import SandboxLimits
from hpc_rlhf.sandbox.result import ExecRequest, ExecResult, ExecStatus

log = logging.getLogger(__name__)


def _result_from_reply(reply: dict[str, Any]) -> ExecResult:
    """A SandboxFusion ``/run_code`` reply -> :class:`ExecResult`."""
    if reply.get("status") == "SandboxError":
        return ExecResult(status="sandbox_error", stderr=str(reply.get("message", "")))
    run = reply.get("run_result") or reply.get("compile_result") or {}
    run_status = run.get("status")
    returncode = run.get("return_code")
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    status: ExecStatus
    if run_status == "TimeLimitExceeded":
        status = "timeout"
    elif run_status == "Finished" and returncode == 0:
        status = "ok"
    elif run_status in ("Finished", "Error"):
        status = "memory_limit" if "MemoryError" in stderr[-2000:] else "error"
    else:
        return ExecResult(status="sandbox_error", stderr=f"unexpected run_result {run!r} in the sandbox's reply")
    return ExecResult(status=status, returncode=returncode, stdout=stdout, stderr=stderr,
                      wall_s=float(run.get("execution_time") or 0.0))


class SandboxFusionClient:
    """Runs requests on a SandboxFusion service at ``url`` (e.g. ``http://sandbox:8080``).

    Args:
        url: the service's base URL.
        limits: the wall time (``run_timeout``) and memory (``memory_limit_MB``) sent per request.
        max_workers: requests in flight at once in :meth:`run_many`.
        request_timeout_s: HTTP timeout on top of the run's own time limit.
        max_retries: extra tries after a connection error or a 5xx reply.
    """

    level = "remote"

    def __init__(self, url: str, limits: SandboxLimits | None = None, max_workers: int = 8,
                 request_timeout_s: float = 30.0, max_retries: int = 2, retry_backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.limits = limits or SandboxLimits()
        self.max_workers = max_workers
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self._client = httpx.Client(timeout=None)
        log.info("sandbox: remote SandboxFusion service at %s (its own isolation), %d requests in flight",
                 self.url, self.max_workers)

    def _payload(self, request: ExecRequest) -> dict[str, Any]:
        run_timeout = request.time_limit_s if request.time_limit_s is not None else self.limits.wall_time_s
        return {"code": request.code, "language": "python", "stdin": request.stdin,
                "run_timeout": run_timeout, "compile_timeout": run_timeout,
                "memory_limit_MB": self.limits.memory_mb,
                "files": {name: base64.b64encode(text.encode()).decode() for name, text in request.files.items()}}

    def run(self, request: ExecRequest) -> ExecResult:
        payload = self._payload(request)
        timeout = float(payload["run_timeout"]) + self.request_timeout_s
        error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.retry_backoff_s * 2 ** (attempt - 1))
            try:
                response = self._client.post(f"{self.url}/run_code", json=payload, timeout=timeout)
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code >= 500:
                error = f"HTTP {response.status_code}: {response.text[:300]}"
                continue
            if response.status_code != 200:
                return ExecResult(status="sandbox_error",
                                  stderr=f"{self.url}/run_code answered HTTP {response.status_code}: "
                                         f"{response.text[:300]}")
            try:
                reply = response.json()
            except ValueError:
                return ExecResult(status="sandbox_error", stderr=f"{self.url}/run_code answered non-JSON: "
                                                                 f"{response.text[:300]!r}")
            if not isinstance(reply, dict):
                return ExecResult(status="sandbox_error", stderr=f"{self.url}/run_code answered {reply!r:.300}")
            return _result_from_reply(reply)
        log.warning("sandbox: %s/run_code failed after %d tries: %s", self.url, self.max_retries + 1, error)
        return ExecResult(status="sandbox_error",
                          stderr=f"{self.url}/run_code failed after {self.max_retries + 1} tries: {error}")

    def run_many(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(requests)),
                                thread_name_prefix="sandbox-remote") as pool:
            return list(pool.map(self.run, requests))

    def close(self) -> None:
        self._client.close()
