"""How a vLLM engine in processes of its own (``vllm_server.VllmServerEngine``) starts them: the environment they
inherit (our launch variables out, the engine's GPUs and the job secret in), the signal mask of the thread that
starts them, and ``vllm.AsyncEngineArgs`` keywords. Imports no vLLM.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hpc_rlhf.resilience.preemption import shield_children_from_time_limit_signal
from hpc_rlhf.world.job_secret import JOB_SECRET_ENV

# Our launch layer's variables (torchrun / srun via hpc_rlhf.world): vLLM's processes must not see
# them, or they would read our world's rank and size as theirs.
LAUNCH_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def server_process_env(environ: dict[str, str], devices: Sequence[int] | None,
                       job_secret: str | None = None) -> dict[str, str]:
    """The environment vLLM's processes start with: our world's launch variables removed, the engine's
    GPUs made visible (``devices``: node-local indices, one per tensor-parallel worker), worker processes
    spawned (the rollout rank may already hold a CUDA context) and vLLM's engine core in its own process.

    ``job_secret``: handed to vLLM's processes as ``HPC_RLHF_JOB_SECRET`` (their workers join the gloo weight
    channel's sealed store with it); the only child processes of a rank that get it (``hpc_rlhf.world.job_secret``).
    """
    env = {k: v for k, v in environ.items() if k not in LAUNCH_ENV_VARS and k != JOB_SECRET_ENV}
    if job_secret is not None:
        env[JOB_SECRET_ENV] = job_secret
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return env


@contextmanager
def isolated_environ(env: dict[str, str]) -> Iterator[None]:
    """Run the block with ``os.environ == env`` (vLLM's child processes inherit it); restore afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_shielded_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Target of the engine's event-loop thread: SIGUSR1 blocked first, so that the vLLM processes it starts
    ignore SLURM's time-limit warning (``preemption.shield_children_from_time_limit_signal``)."""
    shield_children_from_time_limit_signal()
    loop.run_forever()


def server_engine_kwargs(model_path: str, *, tensor_parallel_size: int, gpu_memory_utilization: float, seed: int,
                         enforce_eager: bool, enable_prefix_caching: bool, logprobs_mode: str,
                         **extra: Any) -> dict[str, Any]:
    """``vllm.AsyncEngineArgs`` keywords (without ``weight_transfer_config``, added by the engine)."""
    return {"model": model_path, "tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": "mp", "gpu_memory_utilization": gpu_memory_utilization,
            "seed": seed, "enforce_eager": enforce_eager, "enable_prefix_caching": enable_prefix_caching,
            "logprobs_mode": logprobs_mode, **extra}
