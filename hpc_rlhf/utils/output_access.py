"""Who may read what a run writes: ``train.output_access``, applied as the process's umask at start-up.

A run folder holds what other users of a shared cluster should not read by default: the rollout dumps (prompts,
responses, and whatever an agent's tool printed), checkpoints and exports (the trained weights), metrics, the
resolved config. Every rank sets its umask before it writes anything (``hpc_rlhf.cli.startup.start_run``), so the
files it creates, and those of the processes it starts (vLLM's, DeepSpeed's conversion scripts), are private
without each writer choosing a mode. ``group`` widens it for a team that shares a project folder: the user's group
may read, never write.

Folders that exist before the run keep their mode (the run folder a user made by hand); what the run creates in
them follows the umask.
"""

from __future__ import annotations

import os

OUTPUT_UMASKS: dict[str, int] = {
    "private": 0o077,  # files 0600, folders 0700
    "group": 0o027,  # files 0640, folders 0750
}


def apply_output_access(access: str) -> int:
    """Set this process's umask for ``access`` (``"private"`` or ``"group"``); returns the umask it replaced.

    Raises:
        ValueError: ``access`` is neither (naming the key ``train.output_access``).
    """
    if access not in OUTPUT_UMASKS:
        raise ValueError(f"train.output_access={access!r}: choose one of {sorted(OUTPUT_UMASKS)}")
    return os.umask(OUTPUT_UMASKS[access])
