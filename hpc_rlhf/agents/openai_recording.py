"""What the OpenAI-compatible endpoint records, and how an episode's calls become token sequences.

Every choice the endpoint returns is stored as one :class:`CompletionRecord` under the episode id the
request carried (the API key, see ``openai_endpoint``): the exact prompt token ids the engine was given,
the output token ids it produced and their logprobs. Nothing is ever re-tokenised from text.

Episode -> sequences (:func:`episode_sequences`)
-----------------------------------------------
Records are taken in call order. A record *extends* a sequence when that sequence's tokens so far
(``prompt_ids + response_ids``) are a prefix of the record's ``prompt_ids``: the tokens between (the
environment's / user's text, the chat template's turn markers) are appended with ``action_mask`` 0 and
logprob 0.0, then the record's output tokens with ``action_mask`` 1 and the engine's logprobs. A record
that extends no sequence starts a new one (a *branch*). So a linear chat, where each call's prompt is the
previous call's prompt + output + new messages, becomes exactly one sequence whose action mask covers
exactly the model's outputs - the layout the multi-turn executor produces.

When several sequences could be extended (``n > 1`` earlier), the longest wins; each sequence is extended
at most once per prefix (a second choice of the same call starts its own branch).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionRecord:
    """One returned choice.

    ``prompt_ids`` (P,) the engine's input, ``output_ids`` (O,) its output, ``output_logprobs`` (O,) the
    engine's logprob of each output token. ``prompt_text`` / ``output_text`` are what the client sent /
    received (completions); ``messages`` / ``message`` the chat request's messages / the returned
    assistant message (chat), used to keep a continued chat's earlier tokens exact.
    """

    call_index: int
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    kind: str = "chat"  # "chat" or "completion"
    prompt_text: str | None = None
    output_text: str = ""
    messages: list[dict] | None = None
    message: dict | None = None
    render_kwargs: dict = field(default_factory=dict)  # chat: tools etc. the prompt was rendered with
    # the prompt's images as hashes into the episode's store (openai_images.EpisodeVisual: each image held once
    # per episode, not once per call), None for a prompt without any
    visual: Any = None

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(f"record {self.call_index}: {len(self.output_ids)} output tokens but "
                             f"{len(self.output_logprobs)} logprobs")


@dataclass
class TokenSequence:
    """A linear chain of records: ``prompt_ids`` (P,), then ``response_ids`` / ``action_mask`` /
    ``logprobs`` (R,) with the model's tokens at mask 1. ``calls``: the records' ``call_index`` in order."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    finish_reason: str = ""
    visual: Any = None  # every image of the tokens (the last record's prompt holds them all), or None

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def append(self, record: CompletionRecord) -> None:
        bridge = record.prompt_ids[len(self.tokens):]
        self.response_ids += bridge + list(record.output_ids)
        self.action_mask += [0] * len(bridge) + [1] * len(record.output_ids)
        self.logprobs += [0.0] * len(bridge) + [float(x) for x in record.output_logprobs]
        self.calls.append(record.call_index)
        self.finish_reason = record.finish_reason
        self.visual = record.visual


def _image_refs(visual: Any) -> tuple[str, ...]:
    return tuple(visual.refs) if visual is not None else ()


def _extends(sequence: TokenSequence, record: CompletionRecord) -> bool:
    tokens = sequence.tokens
    if not (len(record.prompt_ids) >= len(tokens) and record.prompt_ids[: len(tokens)] == tokens):
        return False
    # Equal tokens are not enough with images: two calls may show different screenshots of one size.
    seen, shown = _image_refs(sequence.visual), _image_refs(record.visual)
    return shown[: len(seen)] == seen


def episode_sequences(records: list[CompletionRecord]) -> list[TokenSequence]:
    """The episode's linear chains, in the order they started (see the module docstring)."""
    sequences: list[TokenSequence] = []
    for record in sorted(records, key=lambda r: r.call_index):
        candidates = [s for s in sequences if _extends(s, record)]
        if candidates:
            max(candidates, key=lambda s: len(s.tokens)).append(record)
            continue
        sequence = TokenSequence(prompt_ids=list(record.prompt_ids))
        sequence.append(record)
        sequences.append(sequence)
    return sequences


class EpisodeRecorder:
    """Thread-safe store of records per episode id (the endpoint writes, the executor reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, list[CompletionRecord]] = {}
        self._next_call: dict[str, int] = {}
        self._failures: dict[str, str] = {}
        self._stores: dict[str, Any] = {}

    def open(self, episode_id: str) -> None:
        with self._lock:
            self._records[episode_id] = []
            self._next_call[episode_id] = 0

    def store(self, episode_id: str, create: Callable[[], Any]) -> Any:
        """The episode's per-episode state (its images, ``openai_images.EpisodeImages``), made by ``create`` on
        first use and dropped at :meth:`close`; None when the episode is not open."""
        with self._lock:
            if episode_id not in self._records:
                return None
            if episode_id not in self._stores:
                self._stores[episode_id] = create()
            return self._stores[episode_id]

    def is_open(self, episode_id: str) -> bool:
        """Whether ``episode_id`` is recording and has not failed (its requests are served)."""
        with self._lock:
            return episode_id in self._records and episode_id not in self._failures

    def fail(self, episode_id: str, reason: str) -> None:
        """End ``episode_id`` as failed (the engine could not serve one of its requests): later requests are
        refused, and the executor reports ``reason`` as the episode's failure."""
        with self._lock:
            if episode_id in self._records:
                self._failures.setdefault(episode_id, reason)

    def failure(self, episode_id: str) -> str | None:
        with self._lock:
            return self._failures.get(episode_id)

    def next_call_index(self, episode_id: str) -> int:
        with self._lock:
            index = self._next_call[episode_id]
            self._next_call[episode_id] = index + 1
            return index

    def add(self, episode_id: str, record: CompletionRecord) -> None:
        with self._lock:
            if episode_id in self._records:  # a call that finished after its episode closed is dropped
                self._records[episode_id].append(record)

    def records(self, episode_id: str) -> list[CompletionRecord]:
        with self._lock:
            return list(self._records.get(episode_id, []))

    def close(self, episode_id: str) -> list[CompletionRecord]:
        """Stop recording ``episode_id``; its records in call order."""
        with self._lock:
            self._next_call.pop(episode_id, None)
            self._failures.pop(episode_id, None)
            self._stores.pop(episode_id, None)
            return sorted(self._records.pop(episode_id, []), key=lambda r: r.call_index)


def records_summary(records: list[CompletionRecord]) -> dict[str, Any]:
    """Counts for logs: calls, output tokens."""
    return {"num_calls": len(records), "output_tokens": sum(len(r.output_ids) for r in records)}
