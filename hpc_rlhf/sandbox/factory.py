"""The entry points that build the sandbox a reward or a tool asks for: by arguments (:func:`make_sandbox`) or from
the run's ``sandbox`` config section (:func:`run_sandbox`, one shared per process)."""

from __future__ import annotations

import threading

from hpc_rlhf.config.sandbox import SandboxConfig
from hpc_rlhf.sandbox.isolation import SandboxUnavailableError
from hpc_rlhf.sandbox.limits import SandboxLimits
from hpc_rlhf.sandbox.local import LocalSandbox
from hpc_rlhf.sandbox.remote import SandboxFusionClient
from hpc_rlhf.sandbox.result import Sandbox


def make_sandbox(isolation: str = "auto", *, url: str | None = None, limits: SandboxLimits | None = None,
                 max_workers: int | None = None, python: str | None = None) -> Sandbox:
    """``isolation`` ``remote`` (with ``url``) -> a SandboxFusion client; otherwise a :class:`LocalSandbox`.

    Raises:
        SandboxUnavailableError: the level asked for cannot be given on this node.
        ValueError: an unknown level, or ``remote`` without a URL.
    """
    if isolation == "remote":
        if not url:
            raise ValueError("sandbox isolation 'remote' needs the SandboxFusion service's url")
        return SandboxFusionClient(url, limits=limits, max_workers=max_workers or 8)
    if url:
        raise ValueError(f"a sandbox url is only used with isolation 'remote', not {isolation!r}")
    return LocalSandbox(isolation, limits=limits, max_workers=max_workers, python=python)


# The run's sandbox section (set by the trainer on every rank before user files load) and the sandbox built from
# it on first use: one pool per process, shared by the reward function and every agent episode.
_run_config: SandboxConfig | None = None
_run_sandbox: Sandbox | None = None
_lock = threading.Lock()


def configure_run_sandbox(config: SandboxConfig) -> None:
    """Record the run's ``sandbox`` section for :func:`run_sandbox` (a sandbox built from an older one is dropped).

    A config that names ``sandbox.isolation`` demands that level: the sandbox is built here, at start-up, so a node
    without it refuses the run before any model loads rather than at the first reward. A config that leaves the
    section out builds it on first use (most runs execute no model-written code and need no bubblewrap).

    Raises:
        SandboxUnavailableError: the level the config names is not there on this node.
    """
    global _run_config, _run_sandbox
    if config is _run_config:  # the trainer records its section before the reward file and again before the agent's
        return
    built = sandbox_from_config(config) if "isolation" in config.model_fields_set else None
    with _lock:
        _run_config, _run_sandbox = config, built


def sandbox_from_config(config: SandboxConfig) -> Sandbox:
    """Build the sandbox the ``sandbox`` section asks for.

    Raises:
        SandboxUnavailableError: the isolation level asked for is not there on this node; the message names
            ``sandbox.isolation`` and the level.
    """
    limits = SandboxLimits(wall_time_s=config.wall_time_s, cpu_time_s=config.cpu_time_s, memory_mb=config.memory_mb,
                           output_bytes=config.output_bytes, open_files=config.open_files,
                           processes=config.processes)
    try:
        return make_sandbox(config.isolation, url=config.url, limits=limits, max_workers=config.max_workers,
                            python=config.python)
    except SandboxUnavailableError as err:
        raise SandboxUnavailableError(f"sandbox.isolation={config.isolation}: {err}") from err


def run_sandbox_config() -> SandboxConfig:
    """The run's ``sandbox`` section (its defaults when no trainer configured one)."""
    return _run_config or SandboxConfig()


def run_sandbox() -> Sandbox:
    """The process's shared sandbox, built on first use from the run's ``sandbox`` section (its defaults when no
    trainer configured one, e.g. a reward file called from a test)."""
    global _run_sandbox
    with _lock:
        if _run_sandbox is None:
            _run_sandbox = sandbox_from_config(run_sandbox_config())
        return _run_sandbox
