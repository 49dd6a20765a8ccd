"""Who watches a vLLM engine in processes of its own, and where fault tests break it.

``vllm_server.VllmServerEngine`` makes vLLM's calls; the two collaborators here hold what is about the engine's
life rather than about vLLM, so that the engine class reads as its vLLM calls:

- :class:`RestartSupervisor`: the restart lock, which start of the engine is current (its incarnation), the death
  of the engine in a weight round (until it is restarted), the silence that counts as a hang
  (``rollout.engine_timeout_s``, not while generation is held by a weight round or an adapter load), the restart
  bound (``RestartBudget``) and the loop of :meth:`RestartSupervisor.restart`: spend the budget, replace the
  processes, load the adapter again, rejoin the weight channel, and once more if the new engine died meanwhile.
  :mod:`hpc_rlhf.rollout.engine_restart` says where in the step a restart happens and why.
- :class:`FaultHooks`: fault tests only (``tests/faults/test_engine_restart.py``): the fault points where the test
  driver kills vLLM's engine core, mid-generation (the requests in flight held, tokens kept, so that the fault lands
  there whatever the engine's speed) or in a weight round. Inert unless a fault is armed
  (``hpc_rlhf.resilience.fault_injection``).

Both run on the rollout rank that drives the engine, from the threads of its ``generate`` / ``submit`` calls and
weight rounds; the supervisor's lock orders them (a restart waits for a round in progress, and the reverse).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from hpc_rlhf.resilience.fault_injection import fault_armed, fault_point
from hpc_rlhf.rollout.engine_restart import EngineFailure, EngineRestartLimitError, RejoinHook, RestartBudget

log = logging.getLogger(__name__)
# Fault tests (tests/faults) stop here, once tokens of a generate call came back, to kill the engine-core process.
FAULT_PHASE = "engine_generating"
# ... and here, in a weight round (its n-th on this engine object), just before the engine is told about the first
# bucket: the sender is then waiting in that bucket's broadcast.
ROUND_FAULT_PHASE = "engine_weight_round"

FaultPoint = tuple[str, int, int]  # (phase, count, world rank or -1): ``fault_point``'s arguments


class SupervisedEngine(Protocol):
    """What the supervisor asks of the engine it restarts (``vllm_server.VllmServerEngine``)."""

    def stop_processes(self) -> None:
        """Stop what is left of the engine's processes (best effort); its weight channel is gone with them."""

    def start_processes(self) -> None:
        """Start new processes, from the checkpoint's weights."""

    def reload_adapter(self) -> EngineFailure | None:
        """Load the last synced LoRA adapter into the new processes; their own death meanwhile, else None."""

    def restored(self) -> str:
        """What the new engine got back, for the log."""


class RestartSupervisor:
    """Restart supervision of one engine: its incarnations, its death in a weight round, hang detection by
    silence, the restart budget and the restart itself (see the module docstring).

    Args:
        engine: the engine it restarts.
        max_restarts: ``rollout.max_engine_restarts``.
        timeout_s: ``rollout.engine_timeout_s``: silence (no token back) that counts as a hang; None: never.
        name: the engine, in logs and errors.
    """

    def __init__(self, engine: SupervisedEngine, *, max_restarts: int, timeout_s: float | None, name: str) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"VllmServerEngine: timeout_s={timeout_s} must be > 0 (rollout.engine_timeout_s)")
        self.engine = engine
        self.name = name
        self.budget = RestartBudget(max_restarts, name)
        self.timeout_s = timeout_s
        self.rejoin: RejoinHook | None = None  # set by the trainer: channel reopened, current weights received
        # Concurrent generate calls (agents) restart the engine once, and not in the middle of a weight round; a
        # restart's own round (rejoin) takes it again on the same thread.
        self.lock = threading.RLock()
        self.round_failure: EngineFailure | None = None  # the engine died in a weight round; not restarted yet
        self.incarnation = 0  # engines started so far - 1: a failure of an older one needs no new restart
        self._last_output = time.monotonic()  # when the engine last streamed tokens back (or was resumed)
        self._held = False  # a weight round or an adapter load holds generation: silence then is no hang

    def heard(self) -> None:
        """The engine streamed tokens back, or (re)started: its silence counts from now."""
        self._last_output = time.monotonic()

    @contextlib.contextmanager
    def generation_held(self) -> Iterator[None]:
        """A weight round or an adapter load holds generation: the silence meanwhile is no hang
        (``rollout.engine_timeout_s`` counts from its end)."""
        self._held = True
        try:
            yield
        finally:
            self._last_output = time.monotonic()
            self._held = False

    def hang(self, incarnation: int) -> EngineFailure | None:
        """The engine's silence as a failure of ``incarnation`` when it exceeds ``timeout_s`` outside held
        generation; None otherwise."""
        silent = time.monotonic() - self._last_output
        if self.timeout_s is None or self._held or silent <= self.timeout_s:
            return None
        return EngineFailure(f"no token for {silent:.0f} s (rollout.engine_timeout_s={self.timeout_s:g}): vLLM's "
                             "processes stopped answering", incarnation)

    def give_up(self, error: str) -> None:
        """Nothing on this rank can restore the engine: tell the weight sync's other end before ``error`` raises."""
        if self.rejoin is not None:
            self.rejoin.give_up(error)

    def restart(self, failure: EngineFailure) -> None:
        """Replace a failed engine: stop what is left of its processes, start new ones (the checkpoint's weights),
        load the last synced LoRA adapter again under ``ds.lora.sync=adapter``, then :attr:`rejoin` (the trainer's
        weight sync reopens the channel with the sender and sends the current weights). A new engine that dies in
        that round or that load is replaced again. Counted against the bound: past it,
        :class:`EngineRestartLimitError` names the engine and the cause. Thread-safe: a failure of an engine that
        another call already replaced restarts nothing; a restart waits for a weight round or an adapter load in
        progress to end."""
        with self.lock:
            if failure.incarnation is not None and failure.incarnation != self.incarnation:
                return  # another caller restarted it after this failure
            while True:
                try:
                    self.budget.spend(failure)
                except EngineRestartLimitError as err:
                    self.give_up(str(err))
                    raise
                log.warning("%s: restart %d of at most %d: %s", self.name, self.budget.restarts,
                            self.budget.max_restarts, failure.cause)
                self.engine.stop_processes()
                self.round_failure = None
                self.engine.start_processes()
                self.incarnation += 1
                lost = self.engine.reload_adapter()
                if lost is None and self.rejoin is not None:
                    self.rejoin.rejoin(self.engine, failure.cause)
                    lost = self.round_failure
                if lost is None:
                    break
                failure = lost  # the new engine died while its weights or its adapter were loaded: once more
            log.warning("%s: restarted (%s)", self.name, self.engine.restored())


class FaultHooks:
    """Fault tests only: where the test driver kills vLLM's engine core (``FAULT_PHASE``, ``ROUND_FAULT_PHASE``).

    Mid-generation: :meth:`arm` before an attempt; the engine's stream then pauses its requests once the first
    tokens came back (:meth:`take_hold`, :meth:`mark_paused`) and the attempt's wait calls :meth:`hold` when
    :meth:`paused` says so. In a round: :meth:`round_point` counts the round and names its fault point.
    """

    def __init__(self) -> None:
        self.rank: int | None = None  # the world rank driving this engine, for fault_point (tests/faults)
        self.generate_calls = 0  # generate calls with requests so far (fault tests count calls by it)
        self.weight_rounds = 0  # receive_weights calls so far (fault tests count rounds by it)
        self._hold: threading.Event | None = None  # set once the stream paused for an armed fault
        self._paused = threading.Event()

    def _point(self, phase: str, count: int) -> FaultPoint:
        return (phase, count, -1 if self.rank is None else self.rank)

    def arm(self, first_attempt: bool) -> FaultPoint | None:
        """Before an attempt of the current generate call: its fault point when a fault is armed there (first
        attempts only: a continued attempt after a restart is not held again), else None."""
        point = self._point(FAULT_PHASE, self.generate_calls)
        armed = first_attempt and fault_armed(*point)
        self._hold = threading.Event() if armed else None
        self._paused.clear()
        return point if armed else None

    def take_hold(self) -> bool:
        """On the engine's loop, after an output: whether to pause the requests now (once per armed attempt)."""
        if self._hold is not None and not self._hold.is_set():
            self._hold.set()
            return True
        return False

    def mark_paused(self) -> None:
        """The stream paused the requests (tokens kept)."""
        self._paused.set()

    def paused(self) -> bool:
        return self._paused.is_set()

    def hold(self, point: FaultPoint, resume: Callable[[], None]) -> None:
        """The requests in flight are held while the driver kills vLLM's engine core at ``point``; then
        ``resume`` (the engine resumes generation unless the driver killed it)."""
        self._hold = None
        fault_point(*point)
        resume()

    def round_point(self) -> FaultPoint:
        """A weight round starts: its fault point (the rounds of this engine object counted from 1)."""
        self.weight_rounds += 1
        return self._point(ROUND_FAULT_PHASE, self.weight_rounds)
