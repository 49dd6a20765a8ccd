"""What a sandbox is asked to run and what it reports back, shared by the local and the remote sandbox."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

# ok: exit status 0; error: any other exit (an exception, a failed assert, a syntax error);
# timeout: the wall-clock or CPU limit; output_limit: stdout/stderr/a file hit the size limit;
# memory_limit: a MemoryError under the address-space limit; sandbox_error: the sandbox itself failed.
ExecStatus = Literal["ok", "error", "timeout", "output_limit", "memory_limit", "sandbox_error"]
EXEC_STATUSES: tuple[ExecStatus, ...] = ("ok", "error", "timeout", "output_limit", "memory_limit", "sandbox_error")


@dataclass(frozen=True)
class ExecRequest:
    """One Python program to run: ``code`` becomes ``main.py`` in a fresh scratch directory."""

    code: str
    stdin: str = ""
    time_limit_s: float | None = None  # overrides the sandbox's wall and CPU time for this request
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text, written beside main.py


@dataclass(frozen=True)
class ExecResult:
    status: ExecStatus
    returncode: int | None = None  # negative: killed by that signal
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0


class Sandbox(Protocol):
    """What code rewards and the code-interpreter tool need: the local sandbox and the remote client give it."""

    level: str

    def run(self, request: ExecRequest) -> ExecResult: ...

    def run_many(self, requests: list[ExecRequest]) -> list[ExecResult]: ...
