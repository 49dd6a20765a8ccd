"""Run untrusted Python on this node: one sandboxed child per execution, a bounded pool for a batch.

Every execution gets a fresh scratch directory (deleted afterwards), the code written there as ``main.py``,
stdin from a string, and stdout/stderr written to files the parent opened outside the scratch directory
(so ``RLIMIT_FSIZE`` caps the output too and a flood never sits in the trainer's memory). The parent waits
for the wall-clock limit and then kills the whole process group; under ``bwrap`` the pid namespace takes
every descendant with it, also those that started a new session.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from hpc_rlhf.sandbox.isolation import bwrap_argv, default_python, resolve_level
from hpc_rlhf.sandbox.limits import NOBODY_ID, SandboxLimits, rlimit_setter
from hpc_rlhf.sandbox.result import ExecRequest, ExecResult, ExecStatus

log = logging.getLogger(__name__)


def num_workers_from_allocation() -> int:
    """Concurrent executions this task may run: the CPUs SLURM gave it, else the CPUs it may run on."""
    for key in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return max(1, len(os.sched_getaffinity(0)))


def _read_capped(path: str, limit: int) -> tuple[str, bool]:
    """The first ``limit`` bytes of a file as text, and whether it held more (or was cut by RLIMIT_FSIZE)."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) >= limit


def _status(returncode: int, timed_out: bool, output_full: bool, stderr: str) -> ExecStatus:
    if timed_out or returncode in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "timeout"
    # Python ignores SIGXFSZ, so a write past RLIMIT_FSIZE raises OSError EFBIG ("[Errno 27] File too large").
    if output_full or returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "[Errno 27]" in stderr[-2000:]:
        return "output_limit"
    if "MemoryError" in stderr[-2000:]:
        return "memory_limit"
    return "ok" if returncode == 0 else "error"


class LocalSandbox:
    """Runs Python code under the isolation level in force; thread-safe, one child per ``run``.

    Args:
        isolation: ``auto`` (bwrap, refusing to start without it), ``bwrap`` or ``rlimits``.
        limits: default limits; a request's ``time_limit_s`` overrides the wall and CPU time.
        max_workers: executions at once in :meth:`run_many` (default: the CPUs of this task).
        python: interpreter inside the sandbox (default: :func:`default_python`).
    """

    def __init__(self, isolation: str = "auto", limits: SandboxLimits | None = None,
                 max_workers: int | None = None, python: str | None = None):
        self.python = python or default_python()
        self.level = resolve_level(isolation, self.python)
        self.limits = limits or SandboxLimits()
        self.max_workers = max_workers or num_workers_from_allocation()
        self._run_as = NOBODY_ID if os.geteuid() == 0 else None
        self._bwrap = shutil.which("bwrap") if self.level == "bwrap" else None
        log.info("sandbox: isolation %s, %d workers, interpreter %s%s", self.level, self.max_workers, self.python,
                 " (running as uid 65534: the trainer is root)" if self._run_as is not None else "")

    def _limits_for(self, request: ExecRequest) -> SandboxLimits:
        if request.time_limit_s is None:
            return self.limits
        seconds = float(request.time_limit_s)
        return SandboxLimits(wall_time_s=seconds, cpu_time_s=max(1, int(seconds + 0.999)),
                             memory_mb=self.limits.memory_mb, output_bytes=self.limits.output_bytes,
                             open_files=self.limits.open_files, processes=self.limits.processes)

    def run(self, request: ExecRequest) -> ExecResult:
        """Run one request; never raises for what the code does (that is in the result's status)."""
        limits = self._limits_for(request)
        with tempfile.TemporaryDirectory(prefix="hpc-rlhf-run-") as work:
            if self._run_as is not None:
                os.chmod(work, 0o711)  # the unprivileged user must reach scratch/, not list or read the rest
            scratch = os.path.join(work, "scratch")
            os.mkdir(scratch, 0o700)
            with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
                f.write(request.code)
            for name, content in request.files.items():
                if os.path.isabs(name) or ".." in name.split("/"):
                    raise ValueError(f"sandbox file name {name!r} must be a relative path inside the scratch dir")
                path = os.path.join(scratch, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(content)
            if self._run_as is not None:
                for root, dirs, files in os.walk(scratch):
                    for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
                        os.chown(name, self._run_as, self._run_as)
            return self._run_in(work, scratch, request.stdin, limits)

    def _run_in(self, work: str, scratch: str, stdin: str, limits: SandboxLimits) -> ExecResult:
        if self._bwrap is not None:
            # prlimit runs inside the new user namespace, so the process limit counts this sample's processes only.
            argv = [*bwrap_argv(self._bwrap, scratch, self.python), "prlimit", f"--nproc={limits.processes}",
                    "--", self.python, "main.py"]
            env: dict[str, str] = {}
        else:
            argv = [self.python, "main.py"]
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": scratch, "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
        stdin_path, stdout_path, stderr_path = (os.path.join(work, n) for n in ("stdin", "stdout", "stderr"))
        with open(stdin_path, "w", encoding="utf-8") as f:
            f.write(stdin)
        start = time.monotonic()
        timed_out = False
        with open(stdin_path, "rb") as fin, open(stdout_path, "wb") as fout, open(stderr_path, "wb") as ferr:
            try:
                proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, env=env,
                                        cwd=scratch, start_new_session=True, close_fds=True,
                                        preexec_fn=rlimit_setter(limits, self._run_as))
            except OSError as exc:
                return ExecResult(status="sandbox_error", stderr=f"could not start the sandbox: {exc}")
            try:
                proc.wait(timeout=limits.wall_time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                self._kill_group(proc)
        wall_s = time.monotonic() - start
        stdout, out_full = _read_capped(stdout_path, limits.output_bytes)
        stderr, err_full = _read_capped(stderr_path, limits.output_bytes)
        returncode = proc.returncode
        status = _status(returncode, timed_out, out_full or err_full, stderr)
        return ExecResult(status=status, returncode=returncode, stdout=stdout, stderr=stderr, wall_s=wall_s)

    @staticmethod
    def _kill_group(proc: subprocess.Popen[bytes]) -> None:
        """Kill the child's whole process group (also after a normal exit: it may have left children)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def run_many(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
        """Run a batch, at most ``max_workers`` at once; results in the order of ``requests``."""
        if not requests:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(requests)),
                                thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.run, requests))
