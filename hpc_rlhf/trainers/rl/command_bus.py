"""Rank 0's commands to every other rank, in order: the RL run's control stream.

The controller (rank 0) sends each command to every other rank before it runs its own part of it; each worker rank
receives the commands one after another and serves them (``role_worker``). A command is small (a step number, the
roles to move, a directory): the data it concerns travels over the roles' own channels (``hpc_rlhf.world.channel``)
inside the command's work, so the bus never carries a batch.

Point to point, not a broadcast: a worker busy with a long command (a rollout rank generating in the asynchronous
trainer) must not hold up the commands that rank 0 sends to the ranks that are free, so rank 0 posts each send
without waiting for it (``isend``) and a busy worker finds its commands queued, in order, when it asks for the next.
gloo matches the sends and receives of one pair of ranks in the order they were posted, which is what keeps a
worker's commands in rank 0's order. The bus has a gloo group of its own (``WorldGroups.command_group``) whatever
the world's backend, so its messages never interleave with a role's traffic.

A posted send lives in this module (``_UNDELIVERED``), not in the bus, until it is known to be delivered: gloo loses a
send whose work handle is freed before the receiver took it (the peer then waits out its timeout, or sees the
connection close), and a script that drives a trainer phase by phase frees its trainer, bus included, right after
the last phase's ``EndPhase`` was posted.

Each message is two sends: the payload's length (one int64), then the pickled command (bytes). Only rank 0 writes
to the bus and the group is the job's own (its rendezvous is sealed, ``hpc_rlhf.world.sealed_store``), which is why
unpickling what arrives is as safe as the ``broadcast_object_list`` it replaces.

Runs on every rank: rank 0 sends, the others receive.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from hpc_rlhf.world.groups import WorldGroups

CONTROLLER = 0

# Rank 0's posted sends not known to be delivered: (group, work, the tensors it reads), of every bus of this process.
_UNDELIVERED: list[tuple[Any, Any, tuple[torch.Tensor, ...]]] = []


class CommandBus:
    """The control stream of one run over ``world.command_group``."""

    def __init__(self, world: WorldGroups) -> None:
        self.rank, self.world_size = world.rank, world.placement.world_size
        self.group = world.command_group
        self.sent = 0  # rank 0: commands sent so far (each to every other rank)

    def send(self, command: Any) -> None:
        """Rank 0: post ``command`` to every other rank; returns without waiting for any of them."""
        if self.rank != CONTROLLER:
            raise RuntimeError(f"rank {self.rank} sent a command; only rank {CONTROLLER} (the controller) does")
        _forget_delivered()
        payload = torch.frombuffer(bytearray(pickle.dumps(command)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        for dst in range(1, self.world_size):
            for tensor in (length, payload):
                _UNDELIVERED.append((self.group, dist.isend(tensor, dst, group=self.group), (length, payload)))
        self.sent += 1

    def receive(self) -> Any:
        """A worker rank: the next command from rank 0 (blocks until it comes, within the group's timeout)."""
        if self.rank == CONTROLLER:
            raise RuntimeError("rank 0 (the controller) sends commands; it receives none")
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, CONTROLLER, group=self.group)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(payload, CONTROLLER, group=self.group)
        return pickle.loads(payload.numpy().tobytes())

    def flush(self) -> None:
        """Rank 0: wait until every command sent has been received (at the end of a run: nothing left in flight
        when the process group goes away)."""
        for group, work, _ in _UNDELIVERED:
            if group is self.group:
                work.wait()
        _forget_delivered()


def _forget_delivered() -> None:
    """Drop the sends that completed (their works and buffers were kept alive until then)."""
    _UNDELIVERED[:] = [entry for entry in _UNDELIVERED if not entry[1].is_completed()]
