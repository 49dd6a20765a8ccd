"""The OpenAI-compatible endpoint's door: the API key and the body size are checked before anything is read.

Every user of a node can connect to ``127.0.0.1``. :class:`EndpointGuard` is a pure ASGI middleware that runs
before FastAPI parses anything:

1. the ``Authorization: Bearer <key>`` header must name a running episode (the key is the episode id,
   ``openai_endpoint``), for every path - ``/docs``, ``/openapi.json`` and unknown paths included - or the
   answer is 401 and not one byte of the body is read;
2. a ``Content-Length`` above ``max_body_bytes`` is answered 413 at once; a body without one (chunked) is read
   chunk by chunk and answered 413 as soon as it passes the cap. The app then gets the buffered body.

Both refusals carry ``Connection: close``, so uvicorn drops the connection instead of draining the rest of an
oversized upload. uvicorn itself pauses reading when its per-connection buffer passes 64 KiB, so what the
process holds for one request is bounded by the cap, not by what the client sends.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

# ASGI's messages are string-keyed mappings of any values; these are starlette.types' definitions, repeated so
# that importing the endpoint needs no starlette (the optional agents extra).
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a long chat with tools is well under 1 MiB; token ids ~6 bytes each


def bearer_token(authorization: str | None) -> str:
    """The key of an ``Authorization`` value ``Bearer <key>``; the scheme's case does not matter (RFC 7235: ``bearer``
    and ``BEARER`` are the same scheme). '' when there is none or the scheme is another one."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def bearer_key(headers: list[tuple[bytes, bytes]]) -> str:
    """The key of an ``Authorization: Bearer <key>`` header ('' when there is none)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            return bearer_token(value.decode("latin-1"))
    return ""


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


async def send_error(send: Send, status: int, message: str, param: str | None = None,
                     close: bool = False) -> None:
    """An OpenAI-shaped error response (``{"error": {...}}``), written with raw ASGI messages."""
    kind = {401: "authentication_error", 404: "not_found_error"}.get(status, "invalid_request_error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": None}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class EndpointGuard:
    """ASGI middleware around the endpoint's app (module docstring).

    Args:
        app: the FastAPI app.
        is_authorized: whether a key names a running episode (``EpisodeRecorder.is_open``).
        max_body_bytes: the largest request body accepted.
    """

    def __init__(self, app: ASGIApp,
                 is_authorized: Callable[[str], bool], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app, self.is_authorized, self.max_body_bytes = app, is_authorized, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # nothing here speaks websockets
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        key = bearer_key(headers)
        if not key or not self.is_authorized(key):
            await send_error(send, 401, "unknown episode: the API key must be the episode id the trainer gave this "
                             "client (requests outside a running episode are refused)", close=True)
            return
        length = _content_length(headers)
        if length is not None and (length < 0 or length > self.max_body_bytes):
            await send_error(send, 413, self._too_large(length), close=True)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await send_error(send, 413, self._too_large(None), close=True)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

    def _too_large(self, length: int | None) -> str:
        got = f" (Content-Length {length})" if length is not None else ""
        return f"request body larger than the endpoint's limit of {self.max_body_bytes} bytes{got}"


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the buffered body once, then waits on the real one (for the disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
