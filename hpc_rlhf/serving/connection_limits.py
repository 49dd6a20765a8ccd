"""Bounds on the connections a uvicorn server holds: how many at once, and how long one may wait before its first
request.

uvicorn (0.54) starts no timer before a connection's first request, so a client that connects and sends nothing
holds a file descriptor until the process runs out of them (then it can open no checkpoint, socket or module);
its ``limit_concurrency`` answers 503 to requests, but only once a request arrives, so idle connections are not
counted against anything. :func:`limited_http_protocol` returns uvicorn's HTTP protocol class with two bounds
added, for ``uvicorn.Config(http=...)``:

* ``max_connections``: when a connection is accepted while that many are open, the oldest one that is idle (no
  request under way: none yet, or between two requests) is closed to make room, or the new one itself when every
  other one is serving a request. So file descriptors stay bounded, and a flood of idle connections delays a real
  client by nothing: its connection is the newest, the flood's are closed first;
* ``first_request_timeout_s``: a connection whose request headers have not all arrived within that time is
  closed, also one that trickles a byte now and then. Between two requests on a kept-alive connection uvicorn's
  own ``timeout_keep_alive`` applies.

Every server here that listens on TCP uses it: ``serve-rm`` and its ``BackgroundServer``, and the agents'
endpoint (``hpc_rlhf.agents.openai_endpoint``), which by default listens on a Unix socket in a private folder.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 512  # well under the usual 1024 soft limit on file descriptors
DEFAULT_FIRST_REQUEST_TIMEOUT_S = 10.0


def limited_http_protocol(max_connections: int = DEFAULT_MAX_CONNECTIONS,
                          first_request_timeout_s: float = DEFAULT_FIRST_REQUEST_TIMEOUT_S) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools when installed, else h11) with the module's two bounds."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections}")
    if not first_request_timeout_s > 0:
        raise ValueError(f"first_request_timeout_s must be > 0, got {first_request_timeout_s}")
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # the serve / agents extra, imported where served

    base: Any = AutoHTTPProtocol  # uvicorn types it as a bare asyncio.Protocol; its attributes are its own

    class LimitedHTTPProtocol(base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._connected_at = self.loop.time()
            self._first_request_timer = self.loop.call_later(first_request_timeout_s, self._close_if_no_request)
            if len(self.connections) > max_connections:
                self._make_room()

        def _is_idle(self) -> bool:
            # ``cycle`` is set when a request's headers are complete (both uvicorn protocols) and stays until the
            # next one's are
            return self.cycle is None or self.cycle.response_complete

        def _make_room(self) -> None:
            idle = [c for c in self.connections if c is not self and c._is_idle() and not c.transport.is_closing()]
            victim = min(idle, key=lambda c: c._connected_at) if idle else self
            if victim is self:
                logger.warning("HTTP server: %d connections serving requests (max_connections); refusing a new one",
                               len(self.connections) - 1)
            victim.transport.abort()  # its connection_lost follows and removes it from the set

        def _close_if_no_request(self) -> None:
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._first_request_timer.cancel()
            super().connection_lost(exc)

    return LimitedHTTPProtocol


__all__ = ["DEFAULT_FIRST_REQUEST_TIMEOUT_S", "DEFAULT_MAX_CONNECTIONS", "limited_http_protocol"]
