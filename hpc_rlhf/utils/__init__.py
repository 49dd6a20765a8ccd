"""Small helpers shared across subsystems: metrics sinks, per-rank seeding, calls into user code, host malloc."""
