"""Stop cleanly before SLURM kills the job: checkpoint, requeue, resume.

SLURM sends ``SIGUSR1`` (``--signal=USR1@<grace>``) before the time limit and ``SIGTERM`` on
preemption. The handler only sets a flag; at the next step boundary all ranks agree with one tiny
all-reduce (any rank signalled -> every rank stops), so the checkpoint that follows is collective and
consistent. Rank 0 then asks SLURM to requeue the job; the next run resumes from ``LATEST``.

Importing this module costs no torch (the collective imports it when it runs): ``hpc-rlhf submit``'s job
wrapper installs the requeue handler before the trainer is imported.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

log = logging.getLogger(__name__)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# sysexits' EX_TEMPFAIL ("try again later"): the run stopped on SIGUSR1/SIGTERM after checkpointing and was not
# requeued (outside SLURM, slurm.requeue=false, or scontrol failed). Not 0, which means finished with the model
# exported, so a wrapper can tell "stopped, resume me with ckpt.load=true" from "done".
STOPPED_EXIT_CODE = 75


class PreemptionGuard:
    def __init__(self) -> None:
        self.received: int | None = None

    def install(self) -> PreemptionGuard:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self.received = signum
        log.warning("received %s: will checkpoint and stop at the end of this step", signal.Signals(signum).name)

    def agreed_stop(self) -> bool:
        """Collective over the world: True on every rank if any rank was signalled."""
        # Here, not at the top: this module stays torch-free (see the module docstring).
        import torch
        import torch.distributed as dist

        from hpc_rlhf.world.groups import comm_device

        flag = torch.tensor([1 if self.received is not None else 0], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def shield_children_from_time_limit_signal() -> None:
    """Block ``SIGUSR1`` in the calling thread, so that processes started from it (fork, or fork and exec: both keep
    the signal mask) never act on it. Call it first thing in a thread that starts helper processes.

    SLURM delivers ``--signal=USR1@<grace>`` (and ``scancel --signal=USR1``) to every process of a job step, the
    rank's descendants included (every ``ProctrackType`` signals the step's whole process tree or cgroup). A helper
    that installs no handler for it dies on its default action: vLLM's engine-core and worker processes would all
    die at the time-limit warning, and the rank would spend the grace restarting its engine instead of finishing its
    step and checkpointing. The rank alone acts on the warning (its :class:`PreemptionGuard`) and stops its helpers
    itself. The rank's own threads are unaffected: a process-directed signal goes to a thread that does not block
    it, and Python runs its handler on the main thread. ``SIGTERM`` is left alone: vLLM stops its own workers
    with it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})


_GUARD: PreemptionGuard | None = None


def preemption_guard() -> PreemptionGuard:
    """The process-wide guard, installed on first use. Entry points call it before loading anything,
    so a signal that arrives during start-up is remembered instead of killing the rank."""
    global _GUARD
    if _GUARD is None:
        _GUARD = PreemptionGuard().install()
    return _GUARD


def requeue_if_enabled(enabled: bool, rank: int) -> bool:
    """After the stop checkpoint: rank 0 requeues the job when the recipe allows it (``slurm.requeue``).

    Returns whether the job is being requeued: rank 0's ``scontrol`` outcome; on other ranks whether rank 0
    will try (enabled and inside a SLURM job)."""
    if rank != 0:
        return enabled and _slurm_job_id() is not None
    if enabled:
        return requeue_slurm_job()
    log.warning("slurm.requeue=false: the job is not requeued; resume it with ckpt.load=true")
    return False


def exit_if_stopped(trainer: object) -> None:
    """End the process with STOPPED_EXIT_CODE when ``trainer`` stopped on a signal and the job is not being
    requeued; return otherwise. Call it last in an entry point, after the process group is torn down."""
    if getattr(trainer, "stopped_by_signal", False) and not getattr(trainer, "requeued", False):
        log.warning("stopped on a signal after checkpointing: exit status %d; run again with ckpt.load=true to "
                    "resume", STOPPED_EXIT_CODE)
        sys.exit(STOPPED_EXIT_CODE)


def _slurm_job_id() -> str | None:
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{array_task}" if array_job and array_task else os.environ.get("SLURM_JOB_ID")


def requeue_slurm_job() -> bool:
    """``scontrol requeue $SLURM_JOB_ID`` (rank 0 only). Returns whether a requeue was requested."""
    job_id = _slurm_job_id()
    if not job_id:
        log.warning("stopped on a signal outside SLURM: resume with ckpt.load=true")
        return False
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if proc.returncode != 0:
        log.error("scontrol requeue %s failed (%s): resume by hand with ckpt.load=true", job_id, proc.stderr.strip())
        return False
    log.warning("job %s requeued; it will resume from the last checkpoint", job_id)
    return True
