"""``agents.executor.timed_generate``: the engine busy time that the asynchronous trainer and the in-flight episode
pool count (``async/engine_busy_s``)."""

from __future__ import annotations

import time

import pytest

from hpc_rlhf.agents.executor import timed_generate


def test_every_call_is_timed_also_a_failed_one():
    seconds: list[float] = []

    def generate(requests):
        time.sleep(0.01)
        if requests == ["bad"]:
            raise RuntimeError("engine died")
        return [f"done {r}" for r in requests]

    timed = timed_generate(generate, seconds.append)
    assert timed(["a", "b"]) == ["done a", "done b"]
    with pytest.raises(RuntimeError, match="engine died"):
        timed(["bad"])
    assert len(seconds) == 2 and all(s >= 0.01 for s in seconds)
