"""Bounded waits for the security tier: an attack that gets through often shows as a hang (a stranger holding a
rank, a blocked read), so every wait has its own deadline and a failure names what did not end, instead of the
tier's timeout stopping the test with a stack dump."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch.multiprocessing as mp


def join_or_fail(thread: threading.Thread, timeout_s: float, what: str) -> None:
    """Wait for ``thread`` at most ``timeout_s``; fail the test naming ``what`` if it is still running."""
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"{what} did not end within {timeout_s:g} s", pytrace=False)


def spawn_or_fail(fn: Callable[..., Any], args: tuple, nprocs: int, timeout_s: float, what: str,
                  results: Mapping | None = None) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` held to ``timeout_s``: processes still running then are
    killed and the test fails naming them (by spawn index) and what ``results`` held so far."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            hung = [index for index, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            so_far = dict(results) if results is not None else {}
            pytest.fail(f"{what}: process(es) {hung} still running after {timeout_s:g} s; results so far: {so_far}",
                        pytrace=False)
