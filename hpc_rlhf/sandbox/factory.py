"""One entry point that builds the sandbox a reward or a tool asks for."""

from __future__ import annotations

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
