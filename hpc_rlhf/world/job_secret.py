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


def job_secret(env: LaunchEnv, environ: MutableMapping[str, str] | None = None) -> str:
    """This job's secret (see the module docstring for where it comes from), also put into ``environ``
    (default ``os.environ``) as ``HPC_RLHF_JOB_SECRET``, so that processes this rank starts (vLLM's engine and
    workers, which join the weight-transfer store) hold the same one.

    Raises:
        JobSecretError: the secret given is too short, or the user's key file is not private.
    """
    env_vars = os.environ if environ is None else environ
    given = env_vars.get(JOB_SECRET_ENV, "").strip()
    if given:
        if len(given) < MIN_SECRET_CHARS:
            raise JobSecretError(f"{JOB_SECRET_ENV} has {len(given)} characters, fewer than {MIN_SECRET_CHARS}: "
                                 "use a random one, e.g. `export HPC_RLHF_JOB_SECRET=$(python -c 'import secrets; "
                                 "print(secrets.token_hex(32))')`")
        secret = given
    else:
        secret = derived_job_secret(read_or_create_user_key(user_key_path(env_vars)), env)
    env_vars[JOB_SECRET_ENV] = secret
    return secret


def inherited_job_secret(environ: Mapping[str, str] | None = None) -> str:
    """The secret a process started by one of the job's ranks inherited (vLLM's processes). Raises
    JobSecretError when there is none: such a process cannot derive it (its launch variables are removed)."""
    env = os.environ if environ is None else environ
    secret = env.get(JOB_SECRET_ENV, "").strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise JobSecretError(f"{JOB_SECRET_ENV} is {'too short' if secret else 'not set'} in this process "
                             f"(pid {os.getpid()}): it is inherited from the rank that started it, which sets it in "
                             "hpc_rlhf.world.groups.init_world; start this process from an initialised rank, or "
                             "export the job's secret before starting it")
    return secret
