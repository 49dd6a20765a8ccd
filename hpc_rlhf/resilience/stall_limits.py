"""How long each phase of a run may go without progress before it counts as a hang.

    limits = StallLimits(floor_s=60, step_factor=4, first_step_s=1800, checkpoint_s=1800)
    limits.for_phase("step")        # 1800: nothing measured yet, the first step gets its own allowance
    limits.observe_step(12.0)       # the first step (compilation, warm-up): not used to size later steps
    limits.observe_step(10.0)
    limits.for_phase("step")        # max(60, 4 x 10) = 60
    limits.for_phase("checkpoint")  # 1800

Why adaptive: a fixed limit is either too long for a run with 2 s steps (a hang burns half an hour of the
allocation) or too short for one whose long-CoT generation takes ten minutes. The slowest step seen so far
times a factor follows the run; the floor keeps a run of very fast steps from tripping on ordinary noise
(a slow filesystem, a garbage collection). The first step after a (re)start is excluded from the slowest
step when a later one exists: it pays for compilation and engine warm-up once.

Pure and torch-free: the trainers' guard (``hpc_rlhf.resilience.stall_guard``) applies the limits to the
watchdog and to the collective timeout of every process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PHASES = ("startup", "first_step", "step", "eval", "checkpoint")


@dataclass
class StallLimits:
    """Per-phase time limits in seconds (see the module docstring).

    Args:
        floor_s: no step limit is shorter than this.
        step_factor: a step may take this many times the slowest step so far.
        first_step_s: the first step after a (re)start, and each evaluation.
        checkpoint_s: one checkpoint save or load.
        startup_s: start-up (process group init, model loading); the configured collective timeout.
    """

    floor_s: float
    step_factor: float = 4.0
    first_step_s: float = 1800.0
    checkpoint_s: float = 1800.0
    startup_s: float = 1800.0
    _step_seconds: list[float] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.floor_s <= 0:
            raise ValueError(f"floor_s must be > 0 (0 disables the watchdog before this is built), got {self.floor_s}")
        if self.step_factor < 1:
            raise ValueError(f"step_factor must be >= 1, got {self.step_factor}")

    def observe_step(self, seconds: float) -> None:
        """Record a completed step's wall time (without checkpoint saves, which have their own limit)."""
        self._step_seconds.append(float(seconds))

    @property
    def slowest_step_s(self) -> float | None:
        """The slowest step so far, leaving out the first one once a later step exists."""
        measured = self._step_seconds[1:] or self._step_seconds
        return max(measured) if measured else None

    def for_phase(self, phase: str) -> float:
        """The limit of ``phase`` (one of PHASES); ``"step"`` before any step completed is the first step."""
        if phase == "startup":
            return self.startup_s
        if phase == "checkpoint":
            return self.checkpoint_s
        slowest = self.slowest_step_s
        # An evaluation's length is as unknown as the first step's (another data set, other sampling): same allowance.
        if phase in ("first_step", "eval") or (phase == "step" and slowest is None):
            return max(self.first_step_s, self.floor_s)
        if phase == "step" and slowest is not None:
            return max(self.floor_s, self.step_factor * slowest)
        raise ValueError(f"unknown phase {phase!r}; one of {PHASES}")
