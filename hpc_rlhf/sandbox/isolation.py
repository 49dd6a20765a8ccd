"""Isolation levels for model-written code and the check of which one this node can give.

Levels, strongest first:

* ``bwrap``: bubblewrap (a Debian/RHEL package, no root and no daemon needed) puts the code in new user,
  pid, network, ipc, uts and cgroup namespaces: no network interface but a loopback of its own, a
  read-only view of ``/usr`` (and the interpreter's prefix) and nothing else of the host's files, a private
  ``/proc`` that shows only its own processes, an empty environment, and one writable directory (a fresh
  scratch directory, mounted at ``/tmp`` and as the working directory). rlimits bound it as well, the process
  count among them (``prlimit`` from util-linux, inside the sandbox's user namespace).
* ``rlimits``: a plain child process with rlimits (no process-count limit: see :mod:`.limits`), its own
  session, an empty environment and a private working directory. It sees the node's files and network as the
  trainer's user does: for code you trust (tests of your own reward), never for a policy's output on a shared
  cluster.

``remote`` (a SandboxFusion service, :mod:`hpc_rlhf.sandbox.remote`) is chosen by pointing at a URL; its
isolation is whatever that service gives.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile

from hpc_rlhf.sandbox.limits import NOBODY_ID

LEVELS = ("bwrap", "rlimits")


class SandboxUnavailableError(RuntimeError):
    """The isolation level the config asks for cannot be given on this node."""


def default_python() -> str:
    """The interpreter the code runs under: the system's ``/usr/bin/python3`` when present.

    The trainer's own interpreter often lives in a home directory (conda, pyenv) that the sandbox should not
    see, and as root (CI) the code runs as an unprivileged user who may not be able to read it.
    """
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def interpreter_roots(python: str) -> list[str]:
    """Directories outside ``/usr`` that ``python`` needs (its install prefix), to mount read-only."""
    real = os.path.realpath(python)
    if real.startswith("/usr/"):
        return []
    prefix = os.path.dirname(os.path.dirname(real))  # <prefix>/bin/python3.x -> <prefix>
    return [prefix]


def bwrap_argv(bwrap: str, scratch_dir: str, python: str) -> list[str]:
    """The bubblewrap command line that runs ``python`` inside the sandbox (the caller appends its args)."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for root in interpreter_roots(python):
        argv += ["--ro-bind", root, root]
    argv += ["--proc", "/proc", "--dev", "/dev", "--bind", scratch_dir, "/tmp", "--chdir", "/tmp",
             "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
             "--setenv", "PYTHONHASHSEED", "0",
             # bwrap's root and /dev are tmpfs mounts the code could write to (memory of the node): read-only.
             "--remount-ro", "/dev", "--remount-ro", "/", "--"]
    return argv


@functools.cache
def probe_bwrap(python: str) -> str | None:
    """Why bubblewrap cannot run code here, or None when it can (tried once per process and interpreter)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap; RHEL: dnf install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="hpc-rlhf-sandbox-probe-") as scratch:
        run_as = NOBODY_ID if os.geteuid() == 0 else None
        if run_as is not None:
            os.chown(scratch, run_as, run_as)
        argv = [*bwrap_argv(bwrap, scratch, python), "prlimit", "--nproc=8", "--", python, "-c", "print('ok')"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                                  user=run_as, group=run_as, extra_groups=[] if run_as is not None else None)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap failed to start: {exc}"
    if done.returncode != 0 or done.stdout.strip() != "ok":
        return (f"bwrap is installed but cannot create its namespaces here (exit {done.returncode}: "
                f"{done.stderr.strip()[:300]}); unprivileged user namespaces may be disabled on this node")
    return None


def resolve_level(requested: str, python: str) -> str:
    """The level in force for ``requested`` (``auto``, ``bwrap`` or ``rlimits``); refuses what is not there.

    ``auto`` takes ``bwrap`` when it works and otherwise raises too: falling back to no isolation silently is
    the failure this module exists to prevent. Ask for ``rlimits`` by name to run without isolation.
    """
    if requested not in ("auto", *LEVELS):
        raise ValueError(f"sandbox isolation must be one of auto, {', '.join(LEVELS)}; got {requested!r}")
    if requested == "rlimits":
        return "rlimits"
    reason = probe_bwrap(python)
    if reason is not None:
        raise SandboxUnavailableError(
            f"sandbox isolation {requested!r} needs bubblewrap: {reason}. Install it, point the sandbox at a "
            f"SandboxFusion service, or ask for isolation 'rlimits' (no file-system or network isolation)")
    return "bwrap"
