"""Asynchronous RL on one rank: the rollout ranks generate the next batch while the training ranks train on a ready
one (the story: ``async_controller``; a rollout rank's part: ``async_worker``).

Needs the disaggregated layout (rollout ranks disjoint from the actor's); checked on every rank before any engine
is built.

Runs on every rank.
"""

from __future__ import annotations

from typing import cast

from hpc_rlhf.config import RunConfig
from hpc_rlhf.trainers.rl.async_controller import AsyncRLController, queue_depth, token_version_metrics
from hpc_rlhf.trainers.rl.async_worker import AsyncRoleWorker
from hpc_rlhf.trainers.rl.loop import PPOTrainer
from hpc_rlhf.world.groups import WorldGroups

__all__ = ["AsyncPPOTrainer", "token_version_metrics", "trainer_class"]


def check_async_layout(cfg: RunConfig, world: WorldGroups) -> None:
    """Raise ValueError when ``train.async_train`` cannot run on this layout or with these staleness settings."""
    if cfg.train.colocate_all:
        raise ValueError("train.async_train=true needs train.colocate_all=false (rollout on its own ranks)")
    if any(r in world.roles["rollout"].ranks for r in world.roles["actor"].ranks):
        raise ValueError("train.async_train=true: rollout ranks must be disjoint from actor ranks")
    queue_depth(cfg.train)


class AsyncPPOTrainer(PPOTrainer):
    worker_class = AsyncRoleWorker
    controller_class = AsyncRLController

    def __init__(self, cfg: RunConfig, world: WorldGroups) -> None:
        check_async_layout(cfg, world)
        super().__init__(cfg, world)

    @property
    def generated(self) -> int:
        """Batches generated so far (every rank knows it)."""
        return cast(AsyncRoleWorker, self.worker).generated


def trainer_class(cfg: RunConfig) -> type[PPOTrainer]:
    return AsyncPPOTrainer if cfg.train.async_train else PPOTrainer
