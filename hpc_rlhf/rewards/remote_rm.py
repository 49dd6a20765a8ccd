"""Client for remote reward-model servers speaking OpenRLHF's ``/get_reward`` protocol.

    rm = RemoteRewardModel(["http://node1:5000/get_reward", "http://node2:5000/get_reward"])
    out = rm(queries, prompts, labels)        # RewardOutput(rewards, scores, extra_logs)

Protocol (OpenRLHF ``--remote_rm_url``): ``POST <url>`` with JSON
``{"query": [str], "prompts": [str], "labels": [...]}``; the answer is
``{"rewards": [float], "scores": [float] (optional, default rewards), "extra_logs": {name: [float] | float}
(optional)}``. Any OpenRLHF-compatible server works, including ours (``python -m hpc_rlhf.cli.serve_rm``).

URLs
----
Give the full URL ending in ``/get_reward`` as with OpenRLHF. A bare ``host:port`` or
``http://host:port`` (no path) gets ``/get_reward`` appended and ``http://`` when no scheme is given;
any other path is used as is.

Sharding
--------
The batch is cut into contiguous chunks: ``batch_size`` samples each, or, without ``batch_size``, one
chunk per URL (as even as possible). Chunk ``i`` goes to ``urls[i % len(urls)]``; all chunks are sent at
once from a thread pool and the answers are put back in the input order.

Failures
--------
Each attempt has a deadline of ``timeout_s`` for the whole exchange - connect, send, and the answer to its last
byte - so a server that trickles its answer a byte at a time cannot stretch it; an answer larger than
``max_response_bytes`` is refused (not retried) without being read further; counted after decoding, which
takes one ``Content-Encoding`` layer at most (``gzip`` or ``deflate``), so a compression bomb is refused too
(:mod:`hpc_rlhf.rewards.capped_decoding`). Transient failures (timeouts,
connection errors, HTTP 408 / 429 / 5xx, e.g. a busy server's 503) are retried up to ``max_retries`` times (so
at most ``max_retries + 1`` attempts) with exponential backoff ``backoff_s * 2**k`` plus up to ``backoff_s`` of
jitter (so clients turned away together do not return together), or the server's ``Retry-After`` when that is
longer; capped at 30 s. Other
HTTP errors (4xx: the request itself is wrong) and malformed answers are not retried. Every failure
raises ``RemoteRewardError`` naming the URL, the number of attempts and the last cause (HTTP status and
a body excerpt, a timeout, a bad field), so a broken server never hangs or silently zeroes a step.

Authentication
--------------
``api_key`` (the trainer reads it from ``$HPC_RLHF_RM_API_KEY``, see ``reward.remote_api_key_env``) is sent as
``Authorization: Bearer <key>`` to every URL; it appears in no message, log line or ``repr``, and neither do
credentials written inside a URL (``http://user:pw@host`` is shown as ``http://***@host``).

Proxies: like every httpx client this one honours ``HTTP_PROXY`` / ``HTTPS_PROXY`` / ``ALL_PROXY`` /
``NO_PROXY``. A URL that would go through a proxy - with the API key - is named in a warning when the client
is built; set ``NO_PROXY=<host>`` to reach such a server directly.

Keyword arguments other than queries / prompts / labels (e.g. ``responses``) are not part of the
protocol and are not sent.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import torch
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from hpc_rlhf.config.redact import mask_url_credentials
from hpc_rlhf.rewards.capped_decoding import ACCEPT_ENCODING, CappedDecoder, DecodedTooLarge, EncodingRefused
from hpc_rlhf.rewards.functions import RewardFunctionError, RewardOutput, validate_reward_output
from hpc_rlhf.utils.user_calls import UserCallTimeout, call_in_thread

log = logging.getLogger(__name__)

_BODY_CHARS_IN_ERROR = 500
_MAX_BACKOFF_S = 30.0
_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024  # rewards + extra logs of a large batch are a few MiB at most


class RemoteRewardError(RuntimeError):
    """A remote reward server failed or answered something unusable; names the URL and attempts."""

    def __init__(self, message: str, *, url: str, attempts: int):
        super().__init__(message)
        self.url = url
        self.attempts = attempts


class _TransientError(Exception):
    """A failure worth retrying (timeout, connection error, 408/429/5xx); ``cause`` is human readable."""

    def __init__(self, cause: str, retry_after_s: float | None = None):
        super().__init__(cause)
        self.cause = cause
        self.retry_after_s = retry_after_s  # the server's Retry-After, if it sent one


class _PermanentError(Exception):
    """A failure retrying cannot fix (4xx other than 408/429, malformed answer)."""


def normalize_url(url: str) -> str:
    """``host:port`` -> ``http://host:port/get_reward``; a URL with a path other than ``/`` is kept."""
    url = url.strip()
    if not url:
        raise ValueError("empty remote reward URL (reward.remote_url)")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if not parts.netloc:
        raise ValueError(f"remote reward URL {url!r} has no host (expected e.g. http://host:5000/get_reward; "
                         "a reward function file goes in reward.reward_func_path)")
    path = parts.path if parts.path not in ("", "/") else "/get_reward"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


def proxy_for(url: str) -> str | None:
    """The proxy the environment (``*_PROXY`` / ``NO_PROXY``) routes ``url`` through, credentials masked; None
    when it goes direct (the rules httpx applies with ``trust_env``)."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    # proxy_bypass_environment: in urllib on every platform, missing from typeshed.
    bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
    if not proxy or bypass(parts.hostname or "", proxies):
        return None
    return mask_url_credentials(proxy)


def _excerpt(text: str) -> str:
    text = text.strip()
    if len(text) <= _BODY_CHARS_IN_ERROR:
        return text
    return text[:_BODY_CHARS_IN_ERROR] + f"... [{len(text) - _BODY_CHARS_IN_ERROR} more chars]"


def _jsonable(value: Any) -> Any:
    """Labels that ``json`` cannot write itself: tensors / numpy values become lists or numbers."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a label of type {type(value).__name__} cannot be sent as JSON to a remote reward server")


def chunk_bounds(batch_size: int, num_urls: int, chunk_size: int | None) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` chunks: ``chunk_size`` each, or one per URL (sizes differ by <= 1)."""
    if batch_size == 0:
        return []
    if chunk_size is None:
        num_chunks = min(num_urls, batch_size)
        base, extra = divmod(batch_size, num_chunks)
        sizes = [base + (1 if i < extra else 0) for i in range(num_chunks)]
    else:
        sizes = [min(chunk_size, batch_size - start) for start in range(0, batch_size, chunk_size)]
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


class RemoteRewardModel:
    """Reward function backed by one or more ``/get_reward`` servers; see the module docstring."""

    def __init__(self, urls: Sequence[str] | str, timeout_s: float = 60, max_retries: int = 3,
                 backoff_s: float = 1.0, batch_size: int | None = None, api_key: str | None = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES):
        if isinstance(urls, str):
            urls = [urls]
        if not urls:
            raise ValueError("RemoteRewardModel needs at least one URL (reward.remote_url is empty)")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {max_response_bytes}")
        self.urls = [normalize_url(u) for u in urls]
        self.max_response_bytes = max_response_bytes
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.batch_size = batch_size
        # One pooled client shared by the worker threads (httpx.Client is thread-safe); keep-alive
        # connections make the per-step requests cheap.
        # Only the codings CappedDecoder takes, one layer (httpx would offer br / zstd where installed).
        headers = {"Content-Type": "application/json", "Accept-Encoding": ACCEPT_ENCODING}
        if api_key and api_key.strip():
            headers["Authorization"] = f"Bearer {api_key.strip()}"  # as the server strips its own
        self._client = httpx.Client(timeout=httpx.Timeout(self.timeout_s), headers=headers)
        for url in self.urls:
            proxy = proxy_for(url)
            if proxy is not None:
                log.warning("remote reward server %s is reached through the proxy %s (from the *_PROXY environment "
                            "variables), and the API key with it; set NO_PROXY=%s to reach it directly",
                            mask_url_credentials(url), proxy, urlsplit(url).hostname)

    def __repr__(self) -> str:
        return f"RemoteRewardModel({[mask_url_credentials(u) for u in self.urls]!r})"

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RemoteRewardModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __call__(self, queries: Sequence[str], prompts: Sequence[str], labels: Sequence[Any] | None = None,
                 **kwargs: Any) -> RewardOutput:
        batch_size = len(queries)
        if labels is None:
            labels = [None] * batch_size
        if not len(prompts) == len(labels) == batch_size:
            raise ValueError(f"reward inputs must have one entry per sample, got lengths "
                             f"queries={batch_size} prompts={len(prompts)} labels={len(labels)}")
        bounds = chunk_bounds(batch_size, len(self.urls), self.batch_size)
        if not bounds:
            empty = torch.zeros(0, dtype=torch.float32)
            return RewardOutput(rewards=empty, scores=empty.clone())
        jobs = [(self.urls[i % len(self.urls)], list(queries[a:b]), list(prompts[a:b]), list(labels[a:b]))
                for i, (a, b) in enumerate(bounds)]
        if len(jobs) == 1:
            return _merge([self._request(*jobs[0])])
        with ThreadPoolExecutor(max_workers=min(len(jobs), 32), thread_name_prefix="remote-rm") as pool:
            futures = [pool.submit(self._request, *job) for job in jobs]
            try:
                outputs = [f.result() for f in futures]
            except BaseException:
                for f in futures:  # requests not started yet are dropped; running ones end by timeout
                    f.cancel()
                raise
        return _merge(outputs)

    def _request(self, url: str, queries: list[str], prompts: list[str], labels: list[Any]) -> RewardOutput:
        """One chunk to one server, with retries; returns its validated output or raises."""
        body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}, default=_jsonable)
        attempts = self.max_retries + 1
        shown = mask_url_credentials(url)
        retrying = Retrying(
            stop=stop_after_attempt(attempts),
            wait=self._wait,
            retry=retry_if_exception(lambda err: isinstance(err, _TransientError)),
            before_sleep=lambda state: _log_retry(shown, attempts, state),
            reraise=True,
        )
        try:
            payload = retrying(self._post_once, url, body)
        except _TransientError as err:
            made = retrying.statistics.get("attempt_number", attempts)
            raise RemoteRewardError(
                f"remote reward server {shown} failed after {made} attempt(s) "
                f"(deadline {self.timeout_s:g}s each); last cause: {err.cause}",
                url=shown, attempts=made) from err
        except _PermanentError as err:
            made = retrying.statistics.get("attempt_number", 1)
            raise RemoteRewardError(f"remote reward server {shown} failed on attempt {made} "
                                    f"(not retried): {err}", url=shown, attempts=made) from err
        try:
            return validate_reward_output(payload, len(queries), path=f"remote reward server {shown}")
        except RewardFunctionError as err:
            raise RemoteRewardError(f"{err} (malformed answer, not retried)", url=shown, attempts=1) from err

    def _wait(self, state: RetryCallState) -> float:
        """Seconds before the next attempt: jittered exponential backoff, or the server's Retry-After if longer."""
        backoff = (wait_exponential(multiplier=self.backoff_s, max=_MAX_BACKOFF_S)
                   + wait_random(0, self.backoff_s))(state)
        err = state.outcome.exception() if state.outcome is not None else None
        hint = getattr(err, "retry_after_s", None) or 0.0
        return min(max(backoff, hint), _MAX_BACKOFF_S)

    def _post_once(self, url: str, body: str) -> Any:
        """One attempt, held to its deadline even while a read is waiting: it runs in a daemon thread that is
        abandoned at ``timeout_s`` (that thread stops at its next chunk, or at httpx's read timeout)."""
        deadline = time.monotonic() + self.timeout_s
        try:
            return call_in_thread(self._attempt, url, body, deadline, timeout_s=self.timeout_s,
                                  what=f"remote reward request to {mask_url_credentials(url)}")
        except UserCallTimeout:
            raise _TransientError(f"timed out: no complete answer within the {self.timeout_s:g}s deadline") from None

    def _attempt(self, url: str, body: str, deadline: float) -> Any:
        try:
            with self._client.stream("POST", url, content=body) as response:
                raw = self._read_capped(response, deadline)
        except httpx.TimeoutException as err:
            raise _TransientError(f"timed out after {self.timeout_s:g}s ({type(err).__name__})") from err
        except httpx.TransportError as err:
            raise _TransientError(f"{type(err).__name__}: {mask_url_credentials(str(err))}") from err
        text = raw.decode("utf-8", errors="replace")
        if response.status_code != 200:
            cause = f"HTTP {response.status_code}: {_excerpt(text)}"
            if response.status_code in _RETRYABLE_STATUS:
                raise _TransientError(cause, _retry_after_s(response))
            raise _PermanentError(cause)
        try:
            payload = json.loads(raw)
        except RecursionError:
            raise _PermanentError("answer nests too deeply to be a reward answer") from None
        except ValueError as err:
            raise _PermanentError(f"answer is not JSON: {_excerpt(text)!r}") from err
        if not isinstance(payload, dict):
            raise _PermanentError(f"answer must be a JSON object with 'rewards', got {_excerpt(text)!r}")
        return payload

    def _read_capped(self, response: httpx.Response, deadline: float) -> bytes:
        """The answer's bytes, at most ``max_response_bytes``, all of them before ``deadline``."""
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_response_bytes:
            raise _PermanentError(f"answer of {declared} bytes is larger than max_response_bytes="
                                  f"{self.max_response_bytes}")
        # Raw bytes, decoded here: httpx would decode a chunk (and every stacked coding) in one go, past any cap.
        try:
            decoder = CappedDecoder(response.headers.get("content-encoding", ""), self.max_response_bytes)
            raw = bytearray()
            for chunk in response.iter_raw():
                raw += decoder.feed(chunk)
                if time.monotonic() > deadline:
                    raise _TransientError(f"timed out: no complete answer within the {self.timeout_s:g}s deadline "
                                          f"({len(raw)} bytes so far)")
            raw += decoder.finish()
        except DecodedTooLarge:
            raise _PermanentError(f"answer larger than max_response_bytes={self.max_response_bytes}") from None
        except EncodingRefused as err:
            raise _PermanentError(f"answer refused: {err}") from None
        return bytes(raw)


def _retry_after_s(response: httpx.Response) -> float | None:
    """A ``Retry-After`` given in seconds (the HTTP-date form is not used by reward servers); None otherwise."""
    try:
        return max(float(response.headers.get("retry-after", "")), 0.0)
    except ValueError:
        return None


def _log_retry(url: str, attempts: int, state: RetryCallState) -> None:
    err = state.outcome.exception() if state.outcome is not None else None
    cause = getattr(err, "cause", err)
    wait = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning("remote reward server %s: attempt %d/%d failed (%s); retrying in %.2fs",
                url, state.attempt_number, attempts, cause, wait)


def _merge(outputs: list[RewardOutput]) -> RewardOutput:
    """Concatenate chunk outputs in order; keep the ``extra_logs`` names every chunk has."""
    names = [n for n in outputs[0].extra_logs if all(n in o.extra_logs for o in outputs)]
    dropped = {n for o in outputs for n in o.extra_logs} - set(names)
    if dropped:
        log.debug("remote reward extra_logs %s missing from some servers' answers; dropped", sorted(dropped))
    return RewardOutput(
        rewards=torch.cat([o.rewards for o in outputs]),
        scores=torch.cat([o.scores for o in outputs]),
        extra_logs={n: torch.cat([o.extra_logs[n] for o in outputs]) for n in names},
    )

