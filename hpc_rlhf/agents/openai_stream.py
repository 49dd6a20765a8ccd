"""``stream=true`` for the OpenAI-compatible endpoint: a finished response as server-sent events.

Generation is batched across episodes, not token by token, so nothing is gained by streaming tokens as they
come: the endpoint generates and records the completion exactly as it does without streaming, then sends it
in OpenAI's chunk format. Per choice, one chunk carries the whole delta (``role``, ``content``,
``reasoning_content``, ``tool_calls`` with their ``index``; for text completions the ``text``) and its logprobs,
then one chunk carries the ``finish_reason``. With ``stream_options.include_usage`` every chunk has
``"usage": null`` and a last chunk with no choices carries the usage. The stream ends with ``data: [DONE]``.
A client that accumulates the deltas gets the same message as the non-streaming response.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any


def _chat_delta(message: dict) -> dict:
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return delta


def chunks(response: dict, include_usage: bool) -> Iterator[dict]:
    """The chunk objects of a complete chat (``chat.completion``) or text (``text_completion``) response."""
    is_chat = response["object"] == "chat.completion"
    head = {"id": response["id"], "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": response["created"], "model": response["model"]}
    if include_usage:
        head["usage"] = None
    for choice in response["choices"]:
        if is_chat:
            body = {"index": choice["index"], "delta": _chat_delta(choice["message"]), "logprobs": choice["logprobs"],
                    "finish_reason": None}
            end = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            body = {"index": choice["index"], "text": choice["text"], "logprobs": choice["logprobs"],
                    "finish_reason": None}
            end = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        yield {**head, "choices": [body]}
        yield {**head, "choices": [end]}
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def sse_events(response: dict, include_usage: bool) -> Iterator[bytes]:
    """``chunks`` as ``data: <json>`` events, then ``data: [DONE]``."""
    for chunk in chunks(response, include_usage):
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
    yield b"data: [DONE]\n\n"
