"""The job's secret and the run's outputs, seen from the rest of the node.

A trainer's child process (a tool's subprocess, an agent's, anything model-written code starts outside the sandbox)
must not inherit the secret that seals the job's rendezvous stores; what the run writes must not be readable by
other users. Both run through the real start-up path (``start_run``: config, umask, ``init_world``) in a process of
its own, which then does what a tool and the rollout dump do.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from hpc_rlhf.rollout.vllm_server_launch import server_process_env
from hpc_rlhf.world.job_secret import JOB_SECRET_ENV, new_job_secret

pytestmark = pytest.mark.security

# The trainer: the one start-up path of every entry point, then a tool's subprocess and a rollout dump.
_TRAINER = textwrap.dedent("""
    import json, os, subprocess, sys
    from hpc_rlhf.cli.startup import start_run
    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.rollout_dump import write_rollouts

    cfg, env = start_run("train_ppo", sys.argv[1:], load_config)
    tool = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('HPC_RLHF_JOB_SECRET', ''))"],
                          capture_output=True, text=True, timeout=60, check=True)
    dump = write_rollouts(cfg.train.output_dir, 1, [{"response": "the model's answer"}])
    print(json.dumps({"tool_saw": tool.stdout.strip(), "dump": str(dump),
                      "in_environ": os.environ.get("HPC_RLHF_JOB_SECRET", "")}))
""")
_TRAINER_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """Runs the trainer once; returns ``(secret, its report, output_dir)``."""
    out = tmp_path_factory.mktemp("run") / "out"
    secret = new_job_secret()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    env.update({JOB_SECRET_ENV: secret, "OMP_NUM_THREADS": "1"})
    try:
        proc = subprocess.run([sys.executable, "-c", _TRAINER, f"train.output_dir={out}"], env=env,
                              capture_output=True, text=True, timeout=_TRAINER_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the trainer did not finish in {_TRAINER_TIMEOUT_S} s: {err.stderr!r}"[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return secret, json.loads(proc.stdout.strip().splitlines()[-1]), out


def test_a_child_of_the_trainer_does_not_inherit_the_job_secret(trainer_run):
    secret, report, _ = trainer_run
    assert report["tool_saw"] != secret, "a tool's subprocess inherited the job's secret"
    assert report["tool_saw"] == "", f"a tool's subprocess saw {JOB_SECRET_ENV}={report['tool_saw'][:8]}..."
    assert report["in_environ"] == "", "the trainer kept the secret in its environment after reading it"


def test_only_vllm_s_processes_are_handed_the_secret():
    environ = {"PATH": "/bin", JOB_SECRET_ENV: "x" * 64}
    assert JOB_SECRET_ENV not in server_process_env(environ, devices=None)
    assert server_process_env(environ, devices=None, job_secret="y" * 64)[JOB_SECRET_ENV] == "y" * 64


def test_a_rollout_dump_is_private_by_default(trainer_run):
    _, report, _ = trainer_run
    dump_mode = stat.S_IMODE(os.stat(report["dump"]).st_mode)
    folder_mode = stat.S_IMODE(os.stat(os.path.dirname(report["dump"])).st_mode)
    assert dump_mode == 0o600, f"the rollout dump is {oct(dump_mode)}: other users may read it"
    assert folder_mode == 0o700, f"the rollouts folder is {oct(folder_mode)}: other users may list it"
