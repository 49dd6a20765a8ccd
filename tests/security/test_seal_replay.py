"""Replaying sealed values: a stranger who recorded what one store held writes it into another store of the job.

Sealing (``hpc_rlhf.world.sealed_store``) binds a value to its key and to the store's namespace; these tests check
that the namespaces differ where a replay would matter: between two weight channels of one job, and between two
starts of one job (a requeue keeps the job id, often the port, and a secret derived from the user's key).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from hpc_rlhf.weight_sync.vllm_gloo_transfer import GlooSenderChannel
from hpc_rlhf.world.job_secret import JOB_SECRET_ENV, new_job_secret
from hpc_rlhf.world.launch_env import free_port
from hpc_rlhf.world.sealed_store import SEALED_KEY_PREFIX, StoreTamperedError

pytestmark = pytest.mark.security

_STRANGER_TIMEOUT = datetime.timedelta(seconds=10)


def _sealed_names(port: int) -> tuple[dist.TCPStore, list[str]]:
    stranger = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_STRANGER_TIMEOUT)
    return stranger, [key for key in stranger.list_keys() if key.startswith(SEALED_KEY_PREFIX)]


def test_a_value_sealed_for_one_weight_channel_does_not_open_in_another(monkeypatch):
    monkeypatch.setenv(JOB_SECRET_ENV, new_job_secret())
    first, second = GlooSenderChannel(num_workers=1, timeout_s=30), GlooSenderChannel(num_workers=1, timeout_s=30)
    try:
        first.group.store.set("bucket_info", b"first channel's")
        second.group.store.set("bucket_info", b"second channel's")
        stranger, recorded = _sealed_names(first.group.port)
        values = [stranger.get(key) for key in recorded]
        target, names = _sealed_names(second.group.port)
        opened = []
        for name in names:  # every sealed value of the first store, in place of every one of the second
            for value in values:
                target.set(name, value)
                try:
                    opened.append(second.group.store.get("bucket_info"))
                except StoreTamperedError:
                    pass
        assert names and values, "the stranger saw no sealed key"
        assert b"first channel's" not in opened, "a value sealed for one channel opened in another"
    finally:
        first.close()
        second.close()


# Two starts of one job in one process (a requeue: same job id, same secret), each a 1-rank world through
# init_world; a stranger records the first start's store and replays every value onto every sealed key of the second.
_TWO_STARTS = textwrap.dedent("""
    import datetime, json, os, sys
    import torch.distributed as dist
    from hpc_rlhf.world import groups
    from hpc_rlhf.world.groups import init_world
    from hpc_rlhf.world.sealed_store import SEALED_KEY_PREFIX, StoreTamperedError

    def start(restart, port):
        os.environ.update(MASTER_PORT=str(port), SLURM_RESTART_COUNT=str(restart))
        init_world(timeout_s=30, backend="gloo")
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))

    stranger = start(0, int(sys.argv[1]))
    groups._world_store.set("marker", b"first start's")  # the world's sealed store, under no prefix of torch's
    recorded = [stranger.get(k) for k in stranger.list_keys() if k.startswith(SEALED_KEY_PREFIX)]
    dist.destroy_process_group()
    stranger = start(1, int(sys.argv[2]))
    store = groups._world_store
    store.set("marker", b"second start's")
    opened = []
    for name in [k for k in stranger.list_keys() if k.startswith(SEALED_KEY_PREFIX)]:
        for value in recorded:
            stranger.set(name, value)
            try:
                opened.append(store.get("marker").decode(errors="replace"))
            except StoreTamperedError:
                pass
    print(json.dumps({"recorded": len(recorded), "opened": opened}))
    os._exit(0)  # the world's store was overwritten on purpose: no orderly shutdown through it
""")
_TWO_STARTS_TIMEOUT_S = 120


def test_a_value_sealed_in_one_start_of_a_job_does_not_open_in_the_next():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update({JOB_SECRET_ENV: new_job_secret(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "TORCHELASTIC_RUN_ID": "job-7",
                "OMP_NUM_THREADS": "1"})
    try:
        proc = subprocess.run([sys.executable, "-c", _TWO_STARTS, str(free_port()), str(free_port())], env=env,
                              capture_output=True, text=True, timeout=_TWO_STARTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"two starts of a 1-rank world did not finish in {_TWO_STARTS_TIMEOUT_S} s: {err.stderr!r}"[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["recorded"], "the stranger recorded no sealed value"
    assert "first start's" not in report["opened"], "a value sealed in the first start opened in the requeued one"
