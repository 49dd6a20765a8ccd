"""Engine restarts without vLLM (``hpc_rlhf.rollout.engine_restart``): what continues after a failure, how the
results are put back together, and the bound. The vLLM engine's use of it: ``tests/unit/test_vllm_server.py``; a
real engine core killed mid-generation: ``tests/faults/test_engine_restart.py``."""

from __future__ import annotations

import pytest

from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.engine_restart import (
    EngineFailure,
    EngineRestartLimitError,
    GenerationProgress,
    RestartBudget,
    generate_with_restarts,
)

STOP = 2


def _requests():
    return [GenerationRequest([1, 3], SamplingParams(max_new_tokens=4, stop_token_ids=[STOP], seed=7), n=3),
            GenerationRequest([4], SamplingParams(max_new_tokens=2, stop_token_ids=[STOP]))]


def test_continuations_keep_the_tokens_and_seed_each_sample():
    progress = GenerationProgress(_requests())
    first = progress.submissions()
    assert [(r.n, slots) for r, slots in first] == [(3, [(0, 0), (0, 1), (0, 2)]), (1, [(1, 0)])]
    progress.record((0, 0), [5, 6], [-0.1, -0.2])  # two tokens came back
    progress.record((0, 1), [5, STOP], [-0.1, -0.3])  # ended in a stop token before its finish was reported
    progress.record((0, 2), [5, 6, 7, 8], [-0.1] * 4)  # all its tokens
    # (1, 0): nothing came back
    again = progress.submissions()
    assert [(r.prompt_ids, r.params.max_new_tokens, r.params.seed, r.n, slots) for r, slots in again] == [
        ([1, 3, 5, 6], 2, 7, 1, [(0, 0)]), ([4], 2, None, 1, [(1, 0)])]
    progress.record((0, 0), [9], [-0.5], "stop")
    progress.record((1, 0), [8, 8], [-0.4, -0.4], "length")
    assert progress.submissions() == []
    results = progress.results()
    assert [(r.request_index, r.output_ids, r.finish_reason) for r in results] == [
        (0, [5, 6, 9], "stop"), (0, [5, STOP], "stop"), (0, [5, 6, 7, 8], "length"), (1, [8, 8], "length")]
    assert results[0].output_logprobs == [-0.1, -0.2, -0.5] and results[0].prompt_ids == [1, 3]


def test_generate_with_restarts_over_a_fake_engine_that_dies_twice():
    """The fake engine samples token 10 + sample index for every position; its first two starts die after one
    token per sample. The results are those of an engine that never died."""
    starts = []

    def attempt(submissions, progress):
        dies = len(starts) < 2
        for request, slots in submissions:
            for slot in slots:
                remaining = request.params.max_new_tokens
                count = 1 if dies else remaining
                progress.record(slot, [10 + slot[1]] * count, [-1.0] * count, None if dies else "length")
        if dies:
            raise EngineFailure("engine-core exited")

    def restart(failure):
        starts.append(failure.cause)

    results = generate_with_restarts(_requests(), attempt, restart)
    assert starts == ["engine-core exited"] * 2
    assert [r.output_ids for r in results] == [[10] * 4, [11] * 4, [12] * 4, [10] * 2]


def test_the_bound_names_the_engine_the_cause_and_earlier_restarts():
    budget = RestartBudget(1, "rank 3's vLLM rollout engine")
    budget.spend(EngineFailure("no token for 601 s"))
    with pytest.raises(EngineRestartLimitError, match=r"rank 3's vLLM rollout engine failed: engine-core exited; it "
                       r"was restarted 1 time\(s\), the bound rollout.max_engine_restarts=1 \(earlier restarts: no "
                       r"token for 601 s\)"):
        budget.spend(EngineFailure("engine-core exited"))
    with pytest.raises(ValueError, match="max_engine_restarts=-1"):
        RestartBudget(-1, "x")
