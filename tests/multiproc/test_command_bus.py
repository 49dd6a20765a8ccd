"""The command bus (``hpc_rlhf.trainers.rl.command_bus``) on three gloo ranks: every worker receives rank 0's
commands in the order they were sent, and a worker that is busy does not hold rank 0 (or the free workers) up:
rank 0 sends all its commands and then meets rank 1 in a collective of their own while rank 2 has not yet asked
for its first command. Commands posted by a bus that is then freed still arrive."""

from __future__ import annotations

import pytest

from hpc_rlhf.config import load_config
from tests.multiproc.spawn import run_on_ranks

LAYOUT = ["train.colocate_all=false", "actor.num_ranks=2", "rollout.num_engines=1"]


def _serve(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from hpc_rlhf.trainers.rl.command_bus import CommandBus
    from hpc_rlhf.trainers.rl.commands import EndPhase, Save, StartRollouts, SyncWeights
    from hpc_rlhf.world.groups import build_world_groups, new_group
    from hpc_rlhf.world.placement import build_placement

    world = build_world_groups(build_placement(load_config(None, LAYOUT), world_size))
    bus = CommandBus(world)
    pair = new_group([0, 1])  # rank 0 and the free worker, apart from the bus (every rank creates it)
    sent = [StartRollouts(3), Save(3), SyncWeights(4), StartRollouts(4, evaluation=True), EndPhase()]
    if rank == 0:
        for command in sent:
            bus.send(command)
        # The busy worker (rank 2) has received nothing yet: the sends did not wait for it.
        flag = torch.zeros(1)
        dist.all_reduce(flag, group=pair)
        done_before_rank_2_asks = torch.ones(1)
        dist.broadcast(done_before_rank_2_asks, src=0)  # now rank 2 may start receiving
        bus.flush()
        return {"sent": bus.sent}
    if rank == 2:
        started = torch.zeros(1)
        dist.broadcast(started, src=0)  # busy until rank 0 has sent everything and met rank 1
    received = []
    while not isinstance(command := bus.receive(), EndPhase):
        received.append(command)
    if rank == 1:
        dist.all_reduce(torch.zeros(1), group=pair)
        dist.broadcast(torch.zeros(1), src=0)
    return {"received": received, "expected": sent[:-1]}


@pytest.mark.slow
def test_commands_arrive_in_order_and_a_busy_worker_holds_nobody_up():
    results = run_on_ranks(_serve, 3)
    assert results[0] == {"sent": 5}
    for rank in (1, 2):
        assert results[rank]["received"] == results[rank]["expected"], rank


def _serve_after_the_bus_is_gone(rank: int, world_size: int) -> list:
    import datetime
    import gc

    import torch.distributed as dist

    from hpc_rlhf.trainers.rl.command_bus import CommandBus
    from hpc_rlhf.trainers.rl.commands import EndPhase, Save, SyncWeights
    from hpc_rlhf.world import groups
    from hpc_rlhf.world.groups import build_world_groups
    from hpc_rlhf.world.placement import build_placement

    if rank != 0:  # a lost command ends a worker in seconds, before rank 0's 120 s, with the message below. A
        # group's timeout at its creation is the one gloo's point-to-point receive keeps (set_collective_timeouts
        # changes that of collectives only), hence the world's value for the groups made next.
        groups._collective_timeout = datetime.timedelta(seconds=15)
    world = build_world_groups(build_placement(load_config(None, LAYOUT), world_size))
    bus = CommandBus(world)
    received = []
    if rank == 0:
        for command in (Save(1), SyncWeights(2), EndPhase()):
            bus.send(command)
        del bus  # what a script that drives a trainer by hand does when it returns (no flush)
        gc.collect()
    dist.barrier()  # the workers ask only after rank 0 freed the bus: its sends are still pending then
    if rank != 0:
        try:
            while not isinstance(command := bus.receive(), EndPhase):
                received.append(command)
        except RuntimeError as err:
            raise AssertionError(f"rank {rank}: rank 0's commands were lost when it freed its bus; "
                                 f"received {received}") from err
    dist.barrier()
    return received


@pytest.mark.slow
def test_commands_of_a_freed_bus_still_arrive():
    from hpc_rlhf.trainers.rl.commands import Save, SyncWeights

    results = run_on_ranks(_serve_after_the_bus_is_gone, 3)
    assert results[1] == results[2] == [Save(1), SyncWeights(2)]
