"""Bounded faults: the progress watchdog, per-phase stall limits and the guard that applies them, SLURM preemption
signals (checkpoint, requeue) and the named fault-injection points the fault tests use."""
