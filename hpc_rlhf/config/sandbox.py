"""The ``sandbox`` section: where model-written code runs (code rewards, the agents' code interpreter).

Read by :func:`hpc_rlhf.sandbox.factory.run_sandbox`, which builds the one sandbox a process shares. Imports no
torch (the config tree loads on a login node).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from hpc_rlhf.config.section import Section


class SandboxConfig(Section):
    isolation: Literal["auto", "bwrap", "rlimits", "remote"] = Field(
        "auto", description="auto: bubblewrap, refusing to start without it; bwrap: the same, by name; rlimits: "
        "limits only, no file-system or network isolation (trusted code only); remote: a SandboxFusion service "
        "at sandbox.url")
    url: str | None = Field(None, description="sandbox.isolation=remote: the SandboxFusion service (http://host:port)")
    python: str | None = Field(
        None, description="interpreter inside a local sandbox (default /usr/bin/python3; another one's install "
        "prefix is mounted read-only, e.g. a conda env with numpy)")
    max_workers: int | None = Field(
        None, ge=1, description="executions at once (default: the CPUs SLURM gave the task; remote: 8)")
    wall_time_s: float = Field(
        5.0, gt=0, description="wall-clock seconds of one execution (one unit test; one interpreter call); the "
        "whole process group is killed after it")
    cpu_time_s: int = Field(5, ge=1, description="CPU seconds of one execution (RLIMIT_CPU)")
    memory_mb: int = Field(1024, ge=1, description="address space of one execution in MiB (RLIMIT_AS)")
    output_bytes: int = Field(
        1 << 20, ge=1, description="bytes of stdout and of stderr kept per execution; also the largest file it may "
        "write (RLIMIT_FSIZE)")
    open_files: int = Field(64, ge=1, description="open files per execution (RLIMIT_NOFILE)")
    processes: int = Field(32, ge=1, description="processes per execution (RLIMIT_NPROC in bwrap's user namespace)")
    code_reward: Literal["fraction", "all_pass"] = Field(
        "fraction", description="examples/reward_funcs/code_tests.py: the reward is the share of a sample's tests "
        "passed (fraction) or 1.0 only when all pass (all_pass)")

    @model_validator(mode="after")
    def _url_with_remote(self) -> SandboxConfig:
        if self.isolation == "remote" and not self.url:
            raise ValueError("sandbox.isolation=remote needs sandbox.url (the SandboxFusion service)")
        if self.url and self.isolation != "remote":
            raise ValueError(f"sandbox.url is only used with sandbox.isolation=remote, not {self.isolation!r}")
        return self
