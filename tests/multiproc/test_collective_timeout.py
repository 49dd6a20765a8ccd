"""``train.collective_timeout_s`` bounds a hang on every process group, not only the default one; so does a
timeout set after the groups exist (``set_collective_timeouts``, what the trainers do per phase).

Rank 1 SIGSTOPs itself (a hung node); rank 0 then runs a collective on each kind of group the trainers make and
must get gloo's timeout error within seconds, where torch's own default for a new group is 30 minutes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import pytest

from tests.multiproc.spawn import _free_port

pytestmark = pytest.mark.slow
TIMEOUT_S = 3
JOIN_LIMIT_S = 90  # startup on 2 busy cores + 4 timeouts of TIMEOUT_S; without the fix rank 0 waits 30 minutes


def _groups_under_test(world_size: int) -> dict:
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups

    from hpc_rlhf.config import load_config
    from hpc_rlhf.training.topology import dp_setup, init_deepspeed_dist
    from hpc_rlhf.world.groups import build_world_groups, tensor_data_parallel_groups
    from hpc_rlhf.world.placement import build_placement

    cfg = load_config(None, ["algo.advantage_estimator=gae", "algo.kl.init_coef=0.01"])
    world = build_world_groups(build_placement(cfg, world_size))
    tp_group, _ = tensor_data_parallel_groups(world_size)  # the offline trainers' tp x dp grid
    init_deepspeed_dist()
    dp_setup(None)  # a world-spanning DeepSpeed engine: ZeRO's clone of the world group
    found = {"role group": world.roles["actor"].group, "command group": world.command_group,
             "offline tp group": tp_group, "deepspeed world clone": ds_groups._clone_world_group()}
    assert all(g is not None and g is not dist.group.WORLD for g in found.values()), found
    return found


def _rank(rank: int, world_size: int, port: int, out: str, set_after_creation: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from hpc_rlhf.world.groups import init_world, set_collective_timeouts

    torch.set_num_threads(1)
    # Either the timeout given at init, or a long one at init (start-up) shortened afterwards (a step's phase).
    init_world(timeout_s=1800 if set_after_creation else TIMEOUT_S, backend="gloo")
    groups = _groups_under_test(world_size)
    if set_after_creation:
        assert set_collective_timeouts(TIMEOUT_S)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung: alive, holds its sockets, answers nothing
        return
    time.sleep(0.5)
    waited = {}
    for name, group in groups.items():
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            waited[name] = "completed"
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError on a timeout
            waited[name] = [time.monotonic() - start, str(exc)[:300]]
    with open(out, "w") as f:
        json.dump(waited, f)
    os._exit(0)  # the world is broken on purpose; skip destroy_process_group


MODES = {"at-init": False, "set-per-phase": True}  # set_after_creation


@pytest.fixture(scope="module")
def stopped_worlds(tmp_path_factory):
    """Both worlds of the module's test, started together (each is mostly waiting: its rank 1 stopped, its rank 0 in
    a collective until the timeout): {mode: (rank processes, where rank 0 writes what it waited)}."""
    ctx = multiprocessing.get_context("spawn")
    worlds = {}
    for mode, set_after_creation in MODES.items():
        out = tmp_path_factory.mktemp(f"collective_timeout_{mode}") / "waited.json"
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, 2, port, str(out), set_after_creation)) for r in range(2)]
        for p in procs:
            p.start()
        worlds[mode] = (procs, out)
    yield worlds
    for procs, _ in worlds.values():
        for p in procs:
            if p.is_alive():
                p.kill()  # SIGKILL also ends a stopped process
                p.join()


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stopped_rank_times_out_every_group(stopped_worlds, mode):
    procs, out = stopped_worlds[mode]
    procs[0].join(JOIN_LIMIT_S)
    assert not procs[0].is_alive(), f"rank 0 still waiting {JOIN_LIMIT_S}s after rank 1 stopped"
    procs[1].kill()  # stopped since the barrier
    procs[1].join()
    waited = json.loads(out.read_text())
    for name, result in waited.items():
        assert result != "completed", f"{name}: a collective with a stopped peer completed"
        seconds, message = result
        assert seconds < 10 * TIMEOUT_S, (name, seconds, message)
        assert "timed out" in message.lower() or "timeout" in message.lower(), (name, message)
