"""Restarting a rollout engine that died or stopped answering, without losing what it had generated.

A vLLM engine in processes of its own (``rollout.vllm_mode=server_process``) can lose its processes while the
rollout rank and the world are intact: out of memory, a kernel fault, a killed process. This module holds the part
of its recovery that needs no vLLM, unit-tested against a fake engine (``tests/unit/test_engine_restart.py``):

- :class:`GenerationProgress`: what every sample of a ``generate`` call has produced so far (token ids and their
  sampling logprobs, streamed back as they are sampled), and the requests that continue the unfinished samples after
  a restart: each unfinished sample becomes a request of ``n=1`` whose prompt is the original prompt plus the tokens
  that came back, asking for the remaining tokens, with the sample's own seed (vLLM seeds sample ``j`` of a request
  of seed ``s`` with ``s + j``). A sample of which nothing came back starts again from its prompt.
- :class:`RestartBudget`: ``rollout.max_engine_restarts`` over the run; past it the engine's own error ends the job,
  wrapped in :class:`EngineRestartLimitError`, which names the engine, the cause and the count.
- :func:`generate_with_restarts`: the loop ``attempt -> (failure -> restart -> continue the unfinished samples)``.

What a restart does to the engine (new processes, reopening its weight channel, receiving the current weights) is
the engine's and the weight sync's business (``engine_supervision.RestartSupervisor.restart``,
``weight_sync.sharded.EngineChannelWeightSync.rejoin``); this module only calls ``restart(cause)``.

Where in the step a restart happens, and why. The failure is noticed during generation, on the rollout rank, and
the engine is restarted there at once (its processes are the rank's own). Its weights, though, come from one actor
rank over a channel whose opening is collective with that rank, and the actor rank is then busy elsewhere (waiting
to collect the trajectories in the synchronous trainer, training in the asynchronous one). Reopening the channel
from a thread on the actor rank would interleave with its collectives on other groups; an extra collective over the
world in every step would make every rank pay for a rare event. So the weight resend is a service phase at two
points that every rank of an engine's channel group reaches anyway, in the same order: just before the
trajectories are collected (``RoleWorker.collect_rollouts``) and at the start of every weight round. There the
sender hears each of its engines point to point (``done``, ``restarted``, ``failed``) until each says ``done``: a
restarted engine's rank has been waiting in ``rejoin`` since its restart, gets the channel reopened and one round
of the current weights, continues its requests, and says ``done`` when its generation is over. No rank waits in a
collective that another rank skips, so nothing deadlocks; the cost when nothing fails is one small message per
engine at each point.

An engine that dies during a weight round goes the same way, one step later
(:mod:`hpc_rlhf.rollout.weight_round_failure` says which transports allow it and why): the round goes on without it
on both ends (the sender skips it, its rank lets the rest of the round go by), the engine is left dead, so that a
partial round never generates, and the restart happens where a death while idle would be noticed: at the rank's
next ``generate`` (the first attempt fails at once with the round's failure) or its next service point
(``checkpoint_engine``), whichever comes first; the new engine gets the whole current round there. The restart is
counted against the same bound, and a new engine that dies in the round that rejoins it is restarted again.

Resubmitted samples are not bit-identical to what an uninterrupted engine would have sampled: the seeded generator
of a continued request starts again at its seed. They are sampled with the same weights (the restarted engine
receives the weights the dead one had, in the synchronous trainer) and their logprobs are the ones they were
sampled with, which is what training needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from hpc_rlhf.rollout.base import FinishReason, GenerationRequest, GenerationResult

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (request index, sample index) of the original call
# One request of an attempt and the slots its ``n`` samples fill, in sample order.
Submission = tuple[GenerationRequest, list[Slot]]


class EngineFailure(Exception):
    """An attempt's engine died or stopped answering; ``cause`` says which and how (it goes into the log, the
    metrics' restart count and, past the bound, the job's error)."""

    def __init__(self, cause: str, incarnation: int | None = None):
        super().__init__(cause)
        self.cause = cause
        self.incarnation = incarnation  # which start of the engine failed (an engine may be restarted by another call)


class EngineRestartLimitError(RuntimeError):
    """The engine failed once more after ``rollout.max_engine_restarts`` restarts: the job ends with this error."""


@runtime_checkable
class Restartable(Protocol):
    """An engine that can be restarted in place (``vllm_server.VllmServerEngine``)."""

    def alive(self) -> bool: ...

    def round_failure(self) -> EngineFailure | None:
        """The engine's death during the last weight round, until a restart (its cause names the round)."""

    def restart(self, failure: EngineFailure) -> None: ...


class RejoinHook(Protocol):
    """What a restarted engine calls to get its weights back (``EngineChannelWeightSync`` on a rollout rank)."""

    def rejoin(self, engine: Any, cause: str) -> None:
        """Reopen ``engine``'s weight channel with its sender and receive the current weights (collective with the
        sender at its next service point)."""

    def give_up(self, error: str) -> None:
        """Tell the sender that this engine is past its bound, so it raises ``error`` too instead of waiting."""


@dataclass
class SampleProgress:
    """One sample so far: its generated token ids, their sampling logprobs, its finish reason once it finished,
    and the engine's expert routes of its latest request (opaque here; ``routes_from_vllm`` reads them)."""

    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    routes: Any = None


class GenerationProgress:
    """The samples of one ``generate(requests)`` call as they come back, across engine restarts."""

    def __init__(self, requests: Sequence[GenerationRequest]):
        self.requests = list(requests)
        self.samples: dict[Slot, SampleProgress] = {
            (i, j): SampleProgress() for i, request in enumerate(self.requests) for j in range(request.n)}
        self.attempts = 0

    def record(self, slot: Slot, new_ids: Sequence[int], new_logprobs: Sequence[float],
               finish_reason: str | None = None, routes: Any = None) -> None:
        """Append tokens the engine streamed back for ``slot`` (and its finish reason when it finished)."""
        if len(new_ids) != len(new_logprobs):
            raise ValueError(f"sample {slot}: {len(new_ids)} token ids but {len(new_logprobs)} logprobs")
        sample = self.samples[slot]
        sample.output_ids.extend(int(t) for t in new_ids)
        sample.output_logprobs.extend(float(x) for x in new_logprobs)
        if finish_reason is not None:
            sample.finish_reason = finish_reason
        if routes is not None:
            sample.routes = routes

    def done(self, slot: Slot) -> bool:
        """Whether ``slot`` needs no more tokens: it finished, or it has all its tokens or ends in a stop token (the
        engine died after sampling it, before reporting the finish)."""
        sample, params = self.samples[slot], self.requests[slot[0]].params
        if sample.finish_reason is not None:
            return True
        ids = sample.output_ids
        return len(ids) >= params.max_new_tokens or bool(ids and ids[-1] in params.stop_token_ids)

    def unfinished(self) -> list[Slot]:
        return [slot for slot in self.samples if not self.done(slot)]

    def submissions(self) -> list[Submission]:
        """What the next attempt submits: the original requests on the first attempt; afterwards one ``n=1``
        request per unfinished sample, continuing from its tokens with its own seed (empty when all finished)."""
        self.attempts += 1
        if self.attempts == 1:
            return [(request, [(i, j) for j in range(request.n)]) for i, request in enumerate(self.requests)]
        out = []
        for i, j in self.unfinished():
            request, sample = self.requests[i], self.samples[(i, j)]
            params = replace(request.params, max_new_tokens=request.params.max_new_tokens - len(sample.output_ids),
                             stop_token_ids=list(request.params.stop_token_ids),
                             seed=None if request.params.seed is None else request.params.seed + j)
            out.append((GenerationRequest(prompt_ids=request.prompt_ids + sample.output_ids, params=params, n=1,
                                          visual=request.visual), [(i, j)]))
        return out

    def num_carried_tokens(self) -> int:
        """Tokens of unfinished samples that a continuation keeps (not sampled again)."""
        return sum(len(self.samples[slot].output_ids) for slot in self.unfinished())

    def results(self, routes: Callable[[Any, int, str], Any] | None = None) -> list[GenerationResult]:
        """The call's results, ``n`` per request in request order (``base`` conventions). ``routes(raw, positions,
        where)`` converts the engine's routes of a sample (``vllm_external_launcher.routes_from_vllm``)."""
        out = []
        for (i, j), sample in self.samples.items():
            request = self.requests[i]
            where = f"request {i} sample {j}"
            reason = self._finish_reason(sample, request)
            positions = len(request.prompt_ids) + len(sample.output_ids)
            out.append(GenerationResult(
                prompt_ids=list(request.prompt_ids), output_ids=list(sample.output_ids),
                output_logprobs=list(sample.output_logprobs), finish_reason=reason, request_index=i,
                routed_experts=routes(sample.routes, positions, where) if routes is not None else None))
        return out

    @staticmethod
    def _finish_reason(sample: SampleProgress, request: GenerationRequest) -> FinishReason:
        ids = sample.output_ids
        if ids and ids[-1] in request.params.stop_token_ids:
            return "stop"  # also a stop token on the last allowed position: a complete answer
        reason = sample.finish_reason or "length"
        if reason not in ("stop", "length"):
            raise RuntimeError(f"request {request.prompt_ids[:8]}...: unexpected finish reason {reason!r}")
        return "stop" if reason == "stop" else "length"


@dataclass
class RestartBudget:
    """``max_restarts`` restarts of one engine over the run (``rollout.max_engine_restarts``)."""

    max_restarts: int
    engine_name: str
    restarts: int = 0
    causes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"rollout.max_engine_restarts={self.max_restarts} must be >= 0")

    def spend(self, failure: EngineFailure) -> None:
        """Count one restart for ``failure``, or raise :class:`EngineRestartLimitError` (from the failure) when the
        bound is spent."""
        if self.restarts >= self.max_restarts:
            history = f" (earlier restarts: {'; '.join(self.causes)})" if self.causes else ""
            raise EngineRestartLimitError(
                f"{self.engine_name} failed: {failure.cause}; it was restarted {self.restarts} time(s), the bound "
                f"rollout.max_engine_restarts={self.max_restarts}{history}") from failure
        self.restarts += 1
        self.causes.append(failure.cause)


def generate_with_restarts(requests: Sequence[GenerationRequest],
                           attempt: Callable[[list[Submission], GenerationProgress], None],
                           restart: Callable[[EngineFailure], None],
                           routes: Callable[[Any, int, str], Any] | None = None) -> list[GenerationResult]:
    """``generate(requests)`` over an engine that may fail: ``attempt(submissions, progress)`` streams what the
    engine samples into ``progress`` and raises :class:`EngineFailure` when the engine dies or stops answering;
    ``restart(failure)`` brings up a new engine (or raises, past the bound); the unfinished samples are then submitted
    again, continuing from their tokens. Returns the results as one uninterrupted call would (``base``
    conventions)."""
    progress = GenerationProgress(requests)
    while True:
        submissions = progress.submissions()
        if not submissions:
            return progress.results(routes)
        try:
            attempt(submissions, progress)
        except EngineFailure as failure:
            restart(failure)
            log.warning("resubmitting %d unfinished sample(s) of %d after the engine restart (%d token(s) already "
                        "sampled are kept)", len(progress.unfinished()), len(progress.samples),
                        progress.num_carried_tokens())
            continue
        missing = [slot for _, slots in submissions for slot in slots if not progress.done(slot)]
        if missing:
            raise RuntimeError(f"the engine returned without finishing samples {missing[:4]}")
