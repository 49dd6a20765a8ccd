"""Calls into user code (agents, reward functions) with a timeout that always holds.

A timeout enforced by the caller's event loop cannot fire while user code blocks that loop (``time.sleep``
inside ``async def``), and a worker thread of ``concurrent.futures`` that never returns keeps the process
alive at exit (its pool joins its threads). So user code never runs on the caller's thread or loop:

* plain functions run in a fresh **daemon** thread per call;
* coroutine functions run on a private event loop in a daemon thread (``UserLoop``), one per
  ``UserCallRunner``, so agent objects that keep loop-bound state (sessions, locks) across calls work.

On timeout the call is abandoned, never joined: a hung call can only waste its thread, and daemon threads
never keep the interpreter from exiting when training ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)
CANCEL_GRACE_S = 1.0  # how long cancelled tasks get to unwind when a run ends


class UserCallTimeout(TimeoutError):
    """A call into user code ran past its time limit and was abandoned."""


def _describe(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def call_in_thread(fn: Callable[..., Any], *args: Any, timeout_s: float | None, what: str = "",
                   **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread; its result or exception, or ``UserCallTimeout``."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err
        finally:
            done.set()

    threading.Thread(target=target, name=f"hpc_rlhf_user:{_describe(fn)}", daemon=True).start()
    if not done.wait(timeout_s):
        raise UserCallTimeout(f"{what or _describe(fn)} did not return within {timeout_s} s and was abandoned")
    if "error" in box:
        raise box["error"]
    return box["value"]


class UserCallRunner:
    """Awaitable calls into user code from an asyncio loop, each bounded by ``timeout_s``.

    One private loop (daemon thread) runs every coroutine the runner is given; :meth:`close` stops it
    without waiting, so a loop blocked by user code is abandoned rather than joined.
    """

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def _user_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=_serve, args=(loop,), name="hpc_rlhf_user_loop", daemon=True).start()
            self._loop = loop
        return self._loop

    async def call(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (sync or async; an awaitable result is awaited too) within ``timeout_s``."""
        caller = asyncio.get_running_loop()
        if inspect.iscoroutinefunction(fn):
            future = self.submit(fn(*args, **kwargs))
        else:
            future = caller.create_future()
            self._start_thread(caller, future, fn, args, kwargs)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            raise UserCallTimeout(f"{_describe(fn)} did not return within {timeout_s} s and was abandoned") from None

    def start(self, coroutine: Any) -> concurrent.futures.Future:
        """Schedule ``coroutine`` on the private loop from synchronous code (no time limit)."""
        return asyncio.run_coroutine_threadsafe(_await(coroutine), self._user_loop())

    def submit(self, coroutine: Any) -> asyncio.Future:
        """Schedule ``coroutine`` on the private loop; a future of the calling loop (no time limit)."""
        return asyncio.wrap_future(self.start(coroutine))

    def _start_thread(self, caller: asyncio.AbstractEventLoop, future: asyncio.Future, fn: Callable[..., Any],
                      args: tuple, kwargs: dict) -> None:
        def deliver(setter: Callable[[Any], None], value: Any) -> None:
            if not future.done():
                setter(value)

        def chain(inner: asyncio.Future) -> None:  # a sync method that returned an awaitable
            if future.done():
                return
            if inner.cancelled():
                future.cancel()
            elif (error := inner.exception()) is not None:
                future.set_exception(error)
            else:
                future.set_result(inner.result())

        def target() -> None:
            try:
                value = fn(*args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - delivered to the awaiting task
                caller.call_soon_threadsafe(deliver, future.set_exception, err)
                return
            if inspect.isawaitable(value):
                inner = asyncio.run_coroutine_threadsafe(_await(value), self._user_loop())
                caller.call_soon_threadsafe(lambda: asyncio.wrap_future(inner).add_done_callback(chain))
                return
            caller.call_soon_threadsafe(deliver, future.set_result, value)

        threading.Thread(target=target, name=f"hpc_rlhf_user:{_describe(fn)}", daemon=True).start()

    def close(self) -> None:
        """Stop the private loop; a loop blocked in user code is abandoned (its thread is a daemon)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_cancel_all_and_stop, loop)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_forever()
    loop.close()


def _cancel_all_and_stop(loop: asyncio.AbstractEventLoop) -> None:
    for task in asyncio.all_tasks(loop):
        task.cancel()
    # One more turn of the loop lets the cancelled tasks unwind before it stops.
    loop.call_soon(loop.stop)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def run_to_completion(factory: Callable[[], Coroutine]) -> Any:
    """Run ``factory()`` to completion on a fresh event loop (in a helper thread if this thread already runs one);
    tasks it leaves behind get ``CANCEL_GRACE_S`` to unwind, then are abandoned with a warning."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_in_new_loop(factory())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = _run_in_new_loop(factory())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name="hpc_rlhf_agent_loop")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _run_in_new_loop(coroutine: Coroutine) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        try:
            pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=CANCEL_GRACE_S))
                stuck = sum(not task.done() for task in pending)
                if stuck:
                    log.warning("%d agent tasks ignored cancellation for %.1f s and were abandoned",
                                   stuck, CANCEL_GRACE_S)
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
