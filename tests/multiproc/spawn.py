"""Run a function on N gloo ranks in fresh processes (one torch.distributed world per call)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch

    # torch is already imported here, so OMP_NUM_THREADS above comes too late for it: 4 ranks with 2
    # threads each on 2 cores thrash.
    torch.set_num_threads(1)
    from hpc_rlhf.world.groups import init_world

    init_world(timeout_s=120, backend="gloo")
    results[rank] = fn(rank, world_size, *args)
    import torch.distributed as dist

    if dist.is_initialized():  # a vLLM engine closed by ``fn`` took the world down with it
        dist.barrier()
        dist.destroy_process_group()


def run_on_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled into spawned processes).
    """
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_entry, args=(fn, world_size, _free_port(), args, results), nprocs=world_size, join=True)
    return [results[r] for r in range(world_size)]


def _each(rank: int, world_size: int, fn: Callable, args_by_name: dict[str, tuple]) -> dict[str, Any]:
    results = {}
    for name, args in args_by_name.items():
        try:
            results[name] = fn(rank, world_size, *args)
        except Exception as exc:  # name the run: the spawn reports only the traceback
            raise RuntimeError(f"rank {rank}: the run {name!r} failed") from exc
    return results


def run_each_on_ranks(fn: Callable, world_size: int, args_by_name: dict[str, tuple]) -> dict[str, list[Any]]:
    """``{name: run_on_ranks(fn, world_size, *args)}`` for every entry, one after another in one spawn.

    Starting the ranks and importing torch / deepspeed / transformers into them costs more than a tiny run, so
    tests that make several independent runs on the same number of ranks share one spawn. ``fn`` must build
    everything it uses (trainer, engines, groups, output folder) itself, as in a process of its own; it must
    not patch modules or keep process-global state that a later run would see. A failing run fails them all,
    naming itself.
    """
    per_rank = run_on_ranks(_each, world_size, fn, args_by_name)
    return {name: [results[name] for results in per_rank] for name in args_by_name}


def signal_after(steps: int | None) -> None:
    """In a spawned rank: behave as if SLURM's time-limit signal arrived during step ``steps`` (None: never), by
    wrapping the preemption guard's collective agreement: every rank stops, checkpoints and exits at that step."""
    from hpc_rlhf.resilience import preemption

    seen = {"n": 0}
    original = preemption.PreemptionGuard.agreed_stop

    def agreed_stop(guard):
        seen["n"] += 1
        return original(guard) or seen["n"] == steps

    preemption.PreemptionGuard.agreed_stop = agreed_stop
