"""Run a function on N gloo ranks in fresh processes (one torch.distributed world per call).

The ranks are forked from a fork server that imported torch, transformers, deepspeed and peft once per test session
(where torch is a CPU-only build), not started as new interpreters that import them again: those imports are ~4 s
of CPU per rank, paid by every rank of every spawn at once on a 2-core machine. Nothing else runs in the server,
so each rank still starts from a clean interpreter state. As with spawn, a rank has the caller's sys.path, working
directory and environment at the time of the call (the server's environment is that of its start: it is replaced
before the function and its arguments are unpickled, which imports the test module). A torch built with CUDA (or
ROCm) keeps the spawn start method: deepspeed's accelerator detection would initialise the CUDA driver in the
server, and a process forked after that cannot use CUDA.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

# What the ranks import anyway (trainers, engine, the tiny models' classes, LoRA), imported once in the server.
PRELOADED = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils",
             "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto", "deepspeed",
             "peft")
START_METHOD = "spawn" if torch.backends.cuda.is_built() else "forkserver"
if START_METHOD == "forkserver":
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOADED))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, environ: dict[str, str], call: bytes, world_size: int, port: int, results: Any) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's at its start
    os.environ.update(environ)
    fn, args = pickle.loads(call)
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
    call = pickle.dumps((fn, args))
    mp.start_processes(_entry, args=(dict(os.environ), call, world_size, _free_port(), results), nprocs=world_size,
                       join=True, start_method=START_METHOD)
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
