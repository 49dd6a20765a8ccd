"""How the agents' endpoint hands requests to the rollout engine: queued by the server's thread, batched across
episodes by the thread that owns the engine, and a failure kept to the request that caused it.

The server thread puts each request on a :class:`GenerationQueue`; the engine's thread takes everything queued,
from every concurrent episode, into one ``generate`` call (:meth:`GenerationQueue.take`) and :func:`run_batch`
hands each request its results.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
from dataclasses import dataclass
from typing import Any

from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult

logger = logging.getLogger(__name__)


@dataclass
class PendingRequest:
    episode_id: str
    request: GenerationRequest
    future: concurrent.futures.Future


class GenerationQueue:
    """Requests from the server thread to the engine thread, batched across episodes."""

    def __init__(self) -> None:
        self._queue: queue.Queue[PendingRequest] = queue.Queue()

    def submit(self, episode_id: str, request: GenerationRequest) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put(PendingRequest(episode_id, request, future))
        return future

    def take(self, waiting_for: set[str], first_timeout_s: float, batch_wait_s: float) -> list[PendingRequest]:
        """Block up to ``first_timeout_s`` for a request, then gather more until every episode in
        ``waiting_for`` (the running ones) has one queued or ``batch_wait_s`` passed: an episode that is
        busy elsewhere (a tool, the environment) delays the batch by at most ``batch_wait_s``."""
        try:
            batch = [self._queue.get(timeout=first_timeout_s)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + batch_wait_s
        while not waiting_for <= {p.episode_id for p in batch}:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        while True:  # whatever else is already queued rides along
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def fail_all(self, error: BaseException) -> None:
        while True:
            try:
                pending = self._queue.get_nowait()
            except queue.Empty:
                return
            if not pending.future.done():
                pending.future.set_exception(error)


def _deliver(batch: list[PendingRequest], results: list[GenerationResult]) -> None:
    """Each pending request's ``n`` results; an engine that returns a wrong count is broken (raises)."""
    grouped: list[list[GenerationResult]] = [[] for _ in batch]
    for result in results:
        grouped[result.request_index].append(result)
    for pending, group in zip(batch, grouped, strict=True):
        if len(group) != pending.request.n:
            raise RuntimeError(f"rollout engine returned {len(group)} samples for a request with "
                               f"n={pending.request.n}")
    for pending, group in zip(batch, grouped, strict=True):
        if not pending.future.done():
            pending.future.set_result(group)


def run_batch(batch: list[PendingRequest], generate: Any) -> None:
    """One ``generate`` call for ``batch``; each pending request gets its ``n`` results.

    When the call fails, each request is generated again alone, so a request the engine cannot serve fails
    only itself (its future gets the error). When every request of a batch of several fails alone too, the
    engine is broken, not a request: every future gets the error and it propagates.
    """
    if not batch:
        return
    try:
        _deliver(batch, generate([p.request for p in batch]))
        return
    except Exception as err:  # noqa: BLE001 - isolated below; a broken engine re-raises
        if len(batch) == 1:
            logger.warning("rollout engine failed on the request of episode %s: %s: %s", batch[0].episode_id,
                           type(err).__name__, err)
            _fail(batch, err)
            return
        batch_error = err
    except BaseException as err:  # an interrupt: every waiting request learns of it, then it propagates
        _fail(batch, err)
        raise
    failures: list[BaseException] = []
    for pending in batch:
        try:
            _deliver([pending], generate([pending.request]))
        except Exception as err:  # noqa: BLE001 - this request's own failure
            logger.warning("rollout engine failed on the request of episode %s: %s: %s", pending.episode_id,
                           type(err).__name__, err)
            _fail([pending], err)
            failures.append(err)
    if len(failures) == len(batch):
        raise batch_error


def _fail(batch: list[PendingRequest], error: BaseException) -> None:
    for pending in batch:
        if not pending.future.done():
            pending.future.set_exception(error)


__all__ = ["GenerationQueue", "PendingRequest", "run_batch"]
