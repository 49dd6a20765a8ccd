"""Asynchronous RL: rollout ranks generate the next batch while training ranks train on a ready one.

Needs the disaggregated layout (rollout ranks disjoint from the actor's). Every step:

    rank 0 -> rollout ranks: prompts of batch k + depth          (dispatch)
    rollout ranks: generate it      ||  actor/ref/critic: train on batch k from the ready queue
    rollout ranks -> rank 0: the new batch joins the queue       (collect)
    actor -> rollout ranks: new weights (policy version + 1)     (weight sync)

Before the first step the queue is filled with ``depth`` batches, so a trained sample is at most
``depth`` policy versions old; ``depth = train.async_queue_size`` (``wait``: clamped to
``train.max_staleness``; ``drop``: samples older than ``max_staleness`` are dropped and counted).
Each sample carries the policy version that generated it; off-policy corrections (``algo.is_correction``)
use the engine's logprobs. The ready queue is saved in checkpoints, so a resumed run regenerates nothing.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

import torch.distributed as dist

from hpc_rlhf.trainers.controller_math import rollout_metrics
from hpc_rlhf.trainers.ppo import PPOTrainer
from hpc_rlhf.utils.metrics import PhaseTimer

log = logging.getLogger(__name__)


class AsyncPPOTrainer(PPOTrainer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        train = self.cfg.train
        if train.colocate_all:
            raise ValueError("train.async_train=true needs train.colocate_all=false (rollout on its own ranks)")
        if any(r in self.world.roles["rollout"].ranks for r in self.world.roles["actor"].ranks):
            raise ValueError("train.async_train=true: rollout ranks must be disjoint from actor ranks")
        if train.partial_rollout:
            raise NotImplementedError("train.partial_rollout is not implemented yet: weights only change "
                                      "between rollout batches in this version")
        self.depth = train.async_queue_size
        if train.staleness_policy == "wait" and train.max_staleness < self.depth:
            log.warning("train.async_queue_size=%d > train.max_staleness=%d: generating at most %d batches ahead",
                        self.depth, train.max_staleness, train.max_staleness)
            self.depth = max(1, train.max_staleness)
        self.ready: deque[tuple[list, float]] = deque()  # rank 0: generated, not yet trained (+ seconds)
        self.generated = 0  # batches generated so far (every rank counts: it seeds the sampling)

    # ------------------------------------------------------------------ queue
    def _start_generation(self, wanted: bool) -> tuple[bool, Any]:
        """If rank 0 wants another batch (decision broadcast), send its prompts and start generating.

        Returns (started, this rank's pending result); rollout ranks have finished generating when it
        returns, the others have only sent or skipped the prompts.
        """
        if not self._broadcast_flag(self.rank == 0 and wanted and self.generated < self.num_steps):
            return False, None
        self.generated += 1
        prompts = self.data.next_prompts() if self.rank == 0 else None
        return True, self.run_rollouts(self.dispatch_prompts(prompts), self.generated)

    def _finish_generation(self, pending: Any) -> None:
        trajectories, seconds = self.collect_trajectories(pending)
        if self.rank == 0:
            self.ready.append((trajectories, seconds))

    def before_steps(self, start: int) -> None:
        """Fill the queue to ``depth`` batches (a resumed run already has its queue back)."""
        box = [self.generated]
        dist.broadcast_object_list(box, src=0)  # restored on rank 0 only
        self.generated = box[0]
        for _ in range(self.depth):
            started, pending = self._start_generation(self.rank == 0 and len(self.ready) < self.depth)
            if not started:
                break
            self._finish_generation(pending)

    # ------------------------------------------------------------------ one step
    def step(self, step: int, timer: PhaseTimer) -> dict[str, Any] | None:
        # Rollout ranks generate inside this call; the training ranks only send the prompts and go on,
        # as they share no collective with the rollout ranks until the collect below.
        more, pending = self._start_generation(True)
        popped, gen_seconds = self.ready.popleft() if self.rank == 0 else (None, 0.0)
        train_start = time.perf_counter()
        with timer("reward"):
            popped = self.score(popped)
        trajectories, staleness, dropped = self._drop_stale(popped) if self.rank == 0 else (None, [], 0)
        with timer("make_experience"):
            batch = self.make_experience(trajectories)
        with timer("train"):
            train_stats = self.train(batch)
        train_seconds = time.perf_counter() - train_start
        with timer("wait_for_rollout"):
            if more:
                self._finish_generation(pending)
        with timer("weight_sync"):
            self.sync_weights()
        if self.rank != 0:
            return None
        row = {**rollout_metrics(popped, batch, gen_seconds), **train_stats}
        row.update(self._async_metrics(staleness, dropped, gen_seconds, train_seconds, timer))
        return row

    def _drop_stale(self, trajectories: list) -> tuple[list, list[int], int]:
        """(kept trajectories, their staleness, number dropped).

        Staleness = policy versions the actor is ahead of the sample's generator when it trains on it
        (``policy_version`` counts weight syncs, one per optimizer update round).
        """
        staleness = [self.policy_version - t.policy_version for t in trajectories]
        if self.cfg.train.staleness_policy != "drop":
            return trajectories, staleness, 0
        limit = self.cfg.train.max_staleness
        keep = [s <= limit for s in staleness]
        kept = [t for t, k in zip(trajectories, keep, strict=True) if k]
        if len(kept) < len(trajectories):
            log.warning("dropped %d samples older than train.max_staleness=%d", len(trajectories) - len(kept), limit)
        return kept, [s for s, k in zip(staleness, keep, strict=True) if k], len(trajectories) - len(kept)

    def _async_metrics(self, staleness: list[int], dropped: int, gen_s: float, train_s: float,
                       timer: PhaseTimer) -> dict[str, float]:
        counts = Counter(staleness)
        wait = timer.seconds.get("wait_for_rollout", 0.0)
        step_s = max(train_s + wait, 1e-9)
        out = {f"async/staleness_{k}": float(v) for k, v in sorted(counts.items())}
        out.update({
            "async/staleness_max": float(max(staleness, default=0)),
            "async/dropped_stale": float(dropped),
            "async/queue_depth": float(len(self.ready)),
            "async/train_idle_s": wait,  # training ranks waiting for the rollout batch
            "async/rollout_idle_s": max(0.0, step_s - gen_s),  # rollout ranks waiting for the trainer
            "async/overlap_fraction": min(gen_s, train_s) / step_s,
            "async/generated_batches": float(self.generated),
            "policy_version": float(self.policy_version),
        })
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_buffers(self) -> Any:
        return {"ready": list(self.ready), "generated": self.generated}

    def restore_buffers(self, buffers: Any) -> None:
        if buffers:
            self.ready = deque(buffers["ready"])
            self.generated = buffers["generated"]


def trainer_class(cfg: Any) -> type[PPOTrainer]:
    return AsyncPPOTrainer if cfg.train.async_train else PPOTrainer
