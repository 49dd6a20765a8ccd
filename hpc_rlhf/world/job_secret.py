"""The job's secret: the key that makes its rendezvous stores private (:mod:`hpc_rlhf.world.sealed_store`).

torch.distributed's ``TCPStore`` has no authentication: anyone who can reach its port can list, read, write and
delete its keys. Every key and value the job puts there is therefore sealed with a secret that only the job's own
processes hold. Where it comes from, first match wins:

1. ``HPC_RLHF_JOB_SECRET`` in the environment: the sbatch recipes (``slurm/launch.sh``), ``hpc-rlhf submit`` and
   ``launchers/torchrun_local.sh`` generate a fresh one per job before starting the ranks, and ``srun`` /
   ``torchrun`` pass the environment on. A process's environment is readable by its own user (and root) only.
2. Otherwise it is derived from the user's key file (``HPC_RLHF_USER_KEY_FILE``, default
   ``${XDG_CONFIG_HOME:-~/.config}/hpc_rlhf/store.key``, created on first use with mode 0600) and the job's identity
   (launcher, job id, master address and port), so that ranks started by a plain ``srun`` or ``torchrun`` agree
   without talking. Across nodes this needs a home directory that every node shares; where the nodes derive
   different secrets, the check in :func:`hpc_rlhf.world.sealed_store.check_job_secret` stops the job at start-up
   with an error saying so, instead of a silent hang.

Its reach: the first read takes it out of the environment (``os.environ``), and the process keeps it in this
module. So the processes a rank starts do not inherit it: not a tool's subprocess, not an agent's, not a sandbox, not
DeepSpeed's helper scripts. The one kind of child that needs it, vLLM's engine in processes of its own (whose workers
join the gloo weight channel's sealed store), gets it explicitly in the environment it is started with
(``vllm_server_launch.server_process_env``), and its worker takes it out again on first use. What this
does not hide: ``/proc/<pid>/environ`` of a rank shows the environment the rank was started with, to the same user
and root; code run as that user outside a sandbox can read it (the sandbox's ``/proc`` shows its own processes only).

Torch-free: ``plan`` and the login-node CLI import the launch modules without torch.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from hpc_rlhf.world.launch_env import LaunchEnv

JOB_SECRET_ENV = "HPC_RLHF_JOB_SECRET"
USER_KEY_FILE_ENV = "HPC_RLHF_USER_KEY_FILE"
# 32 characters of a hex token are 128 bits; the launchers generate 64 (256 bits).
MIN_SECRET_CHARS = 32
_USER_KEY_BYTES = 32
_KEY_FILE_WAIT_S = 5.0  # another rank may be writing the key file this instant
# The secret this process holds once it was read (and taken out of os.environ): see the module docstring.
_held_secret: str | None = None


class JobSecretError(RuntimeError):
    """The job's secret is missing, too short, unreadable or not private."""


def new_job_secret() -> str:
    """A fresh secret for one job: 64 hex characters (256 bits) from the OS's CSPRNG."""
    return secrets.token_hex(32)


def user_key_path(environ: Mapping[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get(USER_KEY_FILE_ENV):
        return Path(env[USER_KEY_FILE_ENV]).expanduser()
    config_home = Path(env["XDG_CONFIG_HOME"]) if env.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return config_home / "hpc_rlhf" / "store.key"


def _check_private(path: Path) -> None:
    info = path.stat()
    if info.st_uid != os.getuid():
        raise JobSecretError(f"key file {path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}); "
                             f"remove it, or point {USER_KEY_FILE_ENV} at a file of yours")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise JobSecretError(f"key file {path} has mode {stat.filemode(info.st_mode)}: other users may read it, so "
                             f"it keeps no job private. Run `chmod 600 {path}` (or delete it: a new one is made)")


def read_or_create_user_key(path: Path) -> bytes:
    """The user's long-lived key at ``path``: read, or created (0600, in a 0700 directory) if absent.

    Ranks that start at once may race to create it: one creates it exclusively, the others wait for its content.
    """
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as file:
                file.write(secrets.token_hex(_USER_KEY_BYTES) + "\n")
    _check_private(path)
    deadline = time.monotonic() + _KEY_FILE_WAIT_S
    while True:
        key = path.read_text().strip()
        if len(key) >= MIN_SECRET_CHARS:
            return key.encode()
        if time.monotonic() > deadline:
            raise JobSecretError(f"key file {path} holds {len(key)} characters, fewer than {MIN_SECRET_CHARS}; "
                                 "delete it (a new one is made) or write a longer random key into it")
        time.sleep(0.05)


def derived_job_secret(key: bytes, env: LaunchEnv) -> str:
    """The secret of the job ``env`` describes, from the user's key: identical on every rank of the job."""
    identity = f"{env.launcher}|{env.job_id or ''}|{env.master_addr}|{env.master_port}"
    return hmac.new(key, identity.encode(), hashlib.sha256).hexdigest()


def _check_length(secret: str, what: str) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise JobSecretError(f"{what} has {len(secret)} characters, fewer than {MIN_SECRET_CHARS}: use a random "
                             "one, e.g. `export HPC_RLHF_JOB_SECRET=$(python -c 'import secrets; "
                             "print(secrets.token_hex(32))')`")
    return secret


def job_secret(env: LaunchEnv, environ: MutableMapping[str, str] | None = None) -> str:
    """This job's secret (see the module docstring for where it comes from), taken out of ``environ`` (default
    ``os.environ``), so that the processes this rank starts do not inherit it. With the default ``environ`` the
    process keeps it: a second call (a world initialised again) returns the same one, and
    :func:`held_job_secret` hands it to the one child that needs it (vLLM's engine).

    Raises:
        JobSecretError: the secret given is too short, or the user's key file is not private.
    """
    global _held_secret
    process_wide = environ is None
    env_vars = os.environ if environ is None else environ
    given = env_vars.pop(JOB_SECRET_ENV, "").strip()
    if given:
        secret = _check_length(given, JOB_SECRET_ENV)
    elif process_wide and _held_secret:
        return _held_secret
    else:
        secret = derived_job_secret(read_or_create_user_key(user_key_path(env_vars)), env)
    if process_wide:
        _held_secret = secret
    return secret


def held_job_secret(environ: MutableMapping[str, str] | None = None) -> str:
    """The secret this process holds: the one handed to it in ``HPC_RLHF_JOB_SECRET`` (taken out of ``environ``,
    default ``os.environ``, on the first call; a newer one handed replaces it), else the one read before.

    A rank holds it once ``init_world`` ran; a process a rank started explicitly with it (vLLM's engine: see
    :func:`hpc_rlhf.rollout.vllm_server_launch.server_process_env`) holds it from its environment.

    Raises:
        JobSecretError: none was handed and none is held: such a process cannot derive it (its launch variables
            are removed).
    """
    global _held_secret
    process_wide = environ is None
    env = os.environ if environ is None else environ
    handed = env.pop(JOB_SECRET_ENV, "").strip()
    if handed:
        secret = _check_length(handed, f"{JOB_SECRET_ENV} in this process (pid {os.getpid()})")
        if process_wide:
            _held_secret = secret
        return secret
    if process_wide and _held_secret:
        return _held_secret
    raise JobSecretError(f"{JOB_SECRET_ENV} is not set in this process (pid {os.getpid()}) and it holds no job "
                         "secret: a rank reads it in hpc_rlhf.world.groups.init_world and hands it to vLLM's "
                         "engine only; start this process from an initialised rank, or export the job's secret "
                         "before starting it")
