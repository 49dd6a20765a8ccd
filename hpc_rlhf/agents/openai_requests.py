"""Checks of one OpenAI request's fields: a malformed request is that request's 400, naming the field, and
never reaches the rollout engine (where one bad request would fail the batch of every episode).

Pure functions over the parsed JSON body; ``EndpointRequestError`` carries the HTTP status and the field.
"""

from __future__ import annotations

import math
from typing import Any

MAX_SEED = 2**63  # seeds are passed to torch / vLLM generators as 64-bit integers


class EndpointRequestError(ValueError):
    """A request the endpoint refuses; ``status`` is the HTTP status, ``param`` the field at fault."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def number(body: dict, key: str, kind: type, default: Any) -> Any:
    """``body[key]`` as an int (``kind is int``) or a finite float; ``default`` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise EndpointRequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got "
                                   f"{value!r:.100}", param=key)
    if isinstance(value, float) and not math.isfinite(value):  # Python's json reads NaN / Infinity
        raise EndpointRequestError(f"'{key}' must be finite, got {value!r}", param=key)
    return kind(value)


def stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise EndpointRequestError(f"'stop' must be a string or a list of strings, got {stop!r:.100}", param="stop")


def sample_count(body: dict, max_n: int) -> int:
    """``n`` (choices per request): 1 <= n <= ``max_n``; ``best_of``, if given, must equal it."""
    n = number(body, "n", int, 1)
    if not 1 <= n <= max_n:
        raise EndpointRequestError(f"'n' must be between 1 and {max_n}, got {n}", param="n")
    if number(body, "best_of", int, n) != n:
        raise EndpointRequestError(f"'best_of', if given, must equal n={n}", param="best_of")
    return n


def seed_of(body: dict) -> int | None:
    seed = number(body, "seed", int, None)
    if seed is not None and not -MAX_SEED <= seed < MAX_SEED:
        raise EndpointRequestError(f"'seed' must fit in 64 bits, got {seed}", param="seed")
    return seed


def check_token_ids(ids: list, vocab_size: int, param: str = "prompt") -> list[int]:
    """Token ids as the engine needs them: integers in ``[0, vocab_size)`` (an out-of-range id would index past
    the embedding table and fail the whole batch)."""
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise EndpointRequestError(f"'{param}'[{position}] must be a token id (an integer), got {token!r:.50}",
                                       param=param)
        if not 0 <= token < vocab_size:
            raise EndpointRequestError(f"'{param}'[{position}] = {token} is not a token id of this model (the "
                                       f"vocabulary has {vocab_size} tokens)", param=param)
    return list(ids)


def _check_content(content: Any, where: str) -> None:
    if content is None or isinstance(content, str):
        return
    if isinstance(content, list):
        for i, part in enumerate(content):
            if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                raise EndpointRequestError(f"'{where}.content[{i}]' must be an object with a 'type' (a content "
                                           f"part), got {part!r:.100}", param=f"{where}.content")
        return
    raise EndpointRequestError(f"'{where}.content' must be a string, a list of content parts or null, got "
                               f"{type(content).__name__}", param=f"{where}.content")


def check_messages(messages: Any) -> list[dict]:
    """A chat request's ``messages``: a non-empty list of objects, each with a string ``role``; ``content`` a
    string, a list of parts or null; ``tool_calls`` a list of objects; ``name`` / ``tool_call_id`` strings."""
    if not isinstance(messages, list) or not messages:
        raise EndpointRequestError("'messages' must be a non-empty list of message objects", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise EndpointRequestError(f"'{where}' must be an object, got {type(message).__name__}", param=where)
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise EndpointRequestError(f"'{where}.role' must be a non-empty string", param=f"{where}.role")
        _check_content(message.get("content"), where)
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise EndpointRequestError(f"'{where}.tool_calls' must be a list of objects", param=f"{where}.tool_calls")
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None and not isinstance(message[key], str):
                raise EndpointRequestError(f"'{where}.{key}' must be a string", param=f"{where}.{key}")
    return messages


def check_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise EndpointRequestError("'tools' must be a list of objects", param="tools")
    return tools
