"""What the reward server checks before a request reaches the app: the bearer token and the admission bound.

``RequestGuard`` is a plain ASGI middleware, so it runs before routing and before any body is read, and covers
every path (``/get_reward``, ``/health``, unknown ones):

* **API key.** With ``api_key`` set, every request needs ``Authorization: Bearer <key>``; a missing or wrong
  one gets 401 (compared in constant time with :func:`secrets.compare_digest`, so the answer's timing does not
  leak the key). A server bound to ``0.0.0.0`` on a cluster node is reachable by every user of the cluster.
  ``/health`` is no exception: it names the model and its load, and a probe can send the header.
* **Back-pressure.** At most ``max_pending`` scoring requests are admitted at once (being read, queued or
  scored); the next one gets 503 with ``Retry-After`` at once instead of queueing without bound. Memory for
  request bodies is therefore bounded by ``max_pending x max_body_bytes``. Only ``POST`` scoring paths count;
  ``/health`` always answers.

The event loop is single-threaded, so the counters need no lock.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The environment variable both the server (``serve-rm``) and the client (``reward.remote_api_key_env``) read
# the key from by default: a key on the command line is visible to every user of the node in ``ps``.
API_KEY_ENV = "HPC_RLHF_RM_API_KEY"
DEFAULT_MAX_PENDING = 128  # requests admitted at once (reading, queued, scoring); more get 503 + Retry-After
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # admission to answer: minutes of CPU scoring for a request at max_texts

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass
class GuardCounters:
    """Shared with the app (``/health`` shows them): requests admitted now, and the 503 / 401 answers given."""

    pending: int = 0
    rejected_busy: int = 0
    rejected_auth: int = 0


def check_guard_settings(api_key: str | None, max_pending: int, retry_after_s: int) -> None:
    """ValueError for settings the guard cannot work with (called at app creation, before the first request)."""
    if max_pending < 1 or retry_after_s < 0:
        raise ValueError(f"max_pending must be >= 1 and retry_after_s >= 0, got {max_pending}, {retry_after_s}")
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty; unset it to serve without one")


class RequestGuard:
    """ASGI middleware: bearer-token check on every HTTP request, admission bound on ``POST`` requests."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], counters: GuardCounters,
                 api_key: str | None = None, max_pending: int = DEFAULT_MAX_PENDING, retry_after_s: int = 1):
        check_guard_settings(api_key, max_pending, retry_after_s)
        self.app = app
        self.counters = counters
        # Surrounding white space is never part of a key (a trailing newline from a key file, say).
        self._expected = None if api_key is None else f"Bearer {api_key.strip()}".encode()
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan (startup / shutdown)
            return await self.app(scope, receive, send)
        if self._expected is not None and not self._authorized(scope):
            self.counters.rejected_auth += 1
            return await _answer(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                 f"(the client reads it from ${API_KEY_ENV} by default)",
                                 [(b"www-authenticate", b"Bearer")])
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if self.counters.pending >= self.max_pending:
            self.counters.rejected_busy += 1
            return await _answer(send, 503, f"server busy: {self.counters.pending} requests pending, the limit is "
                                 f"{self.max_pending} (max_pending); retry after {self.retry_after_s}s",
                                 [(b"retry-after", str(self.retry_after_s).encode())])
        self.counters.pending += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counters.pending -= 1

    def _authorized(self, scope: Scope) -> bool:
        if self._expected is None:
            return True
        sent = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, token = sent.partition(b" ")
        # The scheme is case-insensitive (RFC 9110); the token is compared in constant time.
        return secrets.compare_digest(b"Bearer " + token.strip(), self._expected) and scheme.lower() == b"bearer"


async def _answer(send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]]) -> None:
    """A JSON ``{"detail": ...}`` answer, shaped like FastAPI's own errors."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
