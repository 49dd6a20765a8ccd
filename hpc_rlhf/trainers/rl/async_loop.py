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
from dataclasses import replace

import torch.distributed as dist

from hpc_rlhf.config import RunConfig
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.controller_steps import rollout_metrics
from hpc_rlhf.trainers.rl.loop import Buffers, PPOTrainer, sampling_seed
from hpc_rlhf.trainers.rl.partial_rollout import continue_generation, stamp_versions
from hpc_rlhf.trainers.rl.roles import Generated
from hpc_rlhf.trainers.run_skeleton import Row
from hpc_rlhf.utils.metrics import PhaseTimer
from hpc_rlhf.world.groups import WorldGroups

log = logging.getLogger(__name__)


class AsyncPPOTrainer(PPOTrainer):
    def __init__(self, cfg: RunConfig, world: WorldGroups) -> None:
        super().__init__(cfg, world)
        train = self.cfg.train
        if train.colocate_all:
            raise ValueError("train.async_train=true needs train.colocate_all=false (rollout on its own ranks)")
        if any(r in self.world.roles["rollout"].ranks for r in self.world.roles["actor"].ranks):
            raise ValueError("train.async_train=true: rollout ranks must be disjoint from actor ranks")
        if train.partial_rollout and train.agent_func_path:
            raise ValueError("train.partial_rollout works with single-turn rollouts; unset train.agent_func_path")
        # A partial rollout's first tokens are one policy version older than its batch's queue position.
        extra = 1 if train.partial_rollout else 0
        self.depth = train.async_queue_size
        if train.staleness_policy == "wait" and train.max_staleness < self.depth + extra:
            if train.max_staleness - extra < 1:
                if train.partial_rollout:
                    raise ValueError("train.partial_rollout=true needs train.max_staleness >= 2 (the first tokens of "
                                     "a sample are one version older than the rest)")
                raise ValueError("train.async_train=true needs train.max_staleness >= 1 (a batch is generated while "
                                 "the previous one trains, one policy version behind); for on-policy rollouts use "
                                 "train.async_train=false")
            log.warning("train.async_queue_size=%d exceeds train.max_staleness=%d: generating %d batches ahead",
                        self.depth, train.max_staleness, train.max_staleness - extra)
            self.depth = train.max_staleness - extra
        self.ready: deque[Generated] = deque()  # rank 0: generated, not yet trained (+ seconds)
        self.generated = 0  # batches generated so far (every rank counts: it seeds the sampling)
        self.in_flight: list[Trajectory] | None = None  # rollout ranks, partial mode: the batch cut at chunk_tokens
        self.partial_in_flight = False  # every rank: whether a cut-short batch waits to be finished

    # ------------------------------------------------------------------ queue
    def _start_generation(self, wanted: bool) -> tuple[bool, Generated | None]:
        """One generation round, if rank 0 wants it and one is needed (decision broadcast to all).

        Returns (ran, this rank's pending result); rollout ranks have finished generating when it
        returns, the others have only sent the prompts. A round starts the next batch while prompts
        remain; with partial rollouts it also finishes the batch the previous round cut short.
        """
        more = self.generated < self.num_steps
        needed = more or self.partial_in_flight
        if not self._broadcast_flag(self.rank == 0 and wanted and needed):
            return False, None
        prompts: list[Prompt] | None = None
        if more:
            self.generated += 1
            prompts = self.controller.next_prompts() if self.rank == 0 else None
        elif self.rank == 0:
            prompts = []  # last partial round: only finish the batch in flight
        self.partial_in_flight = self.cfg.train.partial_rollout and more
        return True, self.run_rollouts(self.dispatch_prompts(prompts), self.generated)

    def _finish_generation(self, pending: Generated | None) -> None:
        trajectories, seconds = self.collect_trajectories(pending)
        if self.rank == 0 and trajectories:
            self.ready.append((trajectories, seconds))

    def run_rollouts(self, prompts: list[Prompt] | None, step: int) -> Generated | None:
        """Partial mode: finish the batch in flight with the current weights, then start the next one
        and stop it after ``rollout.partial_chunk_tokens`` tokens (it finishes after the next sync)."""
        if not self.cfg.train.partial_rollout or self.handles.rollout.side is None:
            return super().run_rollouts(prompts, step)
        start = time.perf_counter()
        rollout = self.handles.rollout.side
        sampling = rollout.sampling(sampling_seed(self.cfg.train.seed, step, self.handles.rollout.engine_index))
        finished: list[Trajectory] = []
        if self.in_flight:
            finished = continue_generation(self.in_flight, rollout.engine.generate, sampling, self.policy_version,
                                           self.cfg.rollout.generate_max_len)
        self.in_flight = None
        if prompts:
            chunk = replace(sampling, max_new_tokens=min(self.cfg.rollout.partial_chunk_tokens,
                                                         self.cfg.rollout.generate_max_len))
            self.in_flight = rollout.executor.run(prompts, rollout.engine.generate, chunk,
                                                  self.cfg.rollout.n_samples_per_prompt)
            stamp_versions(self.in_flight, self.policy_version)
        return finished, time.perf_counter() - start

    def before_steps(self, start: int) -> None:
        """Fill the queue to ``depth`` batches (a resumed run already has its queue back)."""
        box = [(self.generated, self.partial_in_flight)]
        dist.broadcast_object_list(box, src=0)  # restored on rank 0 only
        self.generated, self.partial_in_flight = box[0]
        while True:
            ran, pending = self._start_generation(self.rank == 0 and len(self.ready) < self.depth)
            if not ran:
                break
            self._finish_generation(pending)

    # ------------------------------------------------------------------ one step
    def step(self, step: int, timer: PhaseTimer) -> Row | None:
        # Rollout ranks generate inside this call; the training ranks only send the prompts and go on,
        # as they share no collective with the rollout ranks until the collect below.
        more, pending = self._start_generation(True)
        popped, gen_seconds = self.ready.popleft() if self.rank == 0 else (None, 0.0)
        train_start = time.perf_counter()
        with timer("reward"):
            popped = self.score(popped)
        trajectories, staleness, dropped = self._drop_stale(popped) if popped is not None else (None, [], 0)
        with timer("make_experience"):
            trains, batch = self.make_experience(trajectories)
        self.dump_rollouts(step, popped)
        with timer("train"):
            train_stats = self.train(batch) if trains else {"skipped_update": 1.0}
        train_seconds = time.perf_counter() - train_start
        with timer("wait_for_rollout"):
            if more:
                self._finish_generation(pending)
        with timer("weight_sync"):
            self.sync_weights()
        if popped is None:  # not the controller
            return None
        self.controller.health.observe(popped, step)
        row = {**rollout_metrics(popped, batch, gen_seconds), **train_stats,
               "weight_sync/bytes": float(self.sync_bytes)}
        mixed = sum(len(set(t.token_versions or [])) > 1 for t in popped)
        row.update(self._async_metrics(staleness, dropped, gen_seconds, train_seconds, timer, mixed))
        return row

    def _drop_stale(self, trajectories: list[Trajectory]) -> tuple[list[Trajectory], list[int], int]:
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
                       timer: PhaseTimer, mixed: int) -> dict[str, float]:
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
            "async/mixed_version_samples": float(mixed),
            "policy_version": float(self.policy_version),
        })
        return out

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_buffers(self) -> Buffers | None:
        return {"ready": list(self.ready), "generated": self.generated, "partial_in_flight": self.partial_in_flight}

    def checkpoint_rank_buffers(self) -> Buffers | None:
        return {"in_flight": self.in_flight} if self.in_flight else None

    def restore_rank_buffers(self, buffers: Buffers) -> None:
        self.in_flight = buffers["in_flight"]

    def restore_buffers(self, buffers: Buffers | None, same_world: bool = True) -> None:
        if buffers:
            self.ready = deque(buffers["ready"])
            self.generated = buffers["generated"]
            # Another layout dropped the rollout ranks' cut-short batch (its rank buffers): nothing to finish.
            self.partial_in_flight = buffers["partial_in_flight"] and same_world


def trainer_class(cfg: RunConfig) -> type[PPOTrainer]:
    return AsyncPPOTrainer if cfg.train.async_train else PPOTrainer
