"""Asynchronous RL, rank 0's story: the rollout ranks generate the next batch while the training ranks train on a
ready one.

Every step, as commands (``commands``):

    StartRollouts(batch k + depth)   rank 0 deals the prompts; the rollout ranks generate     (a future)
    score, RunForwards, RunUpdates    the training ranks train on batch k from the ready queue
    CollectRollouts                   the new batch joins the queue                          (the wait)
    SyncWeights                       actor -> rollout ranks (policy version + 1)

The commands reach a rollout rank busy generating as they are sent (``command_bus``: point to point, without
waiting), so the training ranks never wait for it until the collect. Before the first step the queue is filled with
``depth`` batches, so a trained sample is at most ``depth`` policy versions old; ``depth = train.async_queue_size``
(``wait``: clamped to ``train.max_staleness``; ``drop``: samples older than ``max_staleness`` are dropped and
counted). Each sample carries the policy version that generated it; off-policy corrections (``algo.is_correction``)
use the engine's logprobs. The ready queue is saved in checkpoints, so a resumed run regenerates nothing.

Runs on rank 0 only.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from typing import Any

from hpc_rlhf.agents.in_flight import versions_spanned
from hpc_rlhf.config.schema import TrainConfig
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.async_worker import AsyncRoleWorker
from hpc_rlhf.trainers.rl.commands import GeneratedSoFar, StartRollouts
from hpc_rlhf.trainers.rl.controller import RLController
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers
from hpc_rlhf.trainers.rl.controller_steps import rollout_metrics
from hpc_rlhf.trainers.rl.roles import Generated
from hpc_rlhf.trainers.run_skeleton import Row
from hpc_rlhf.utils.metrics import PhaseTimer

log = logging.getLogger(__name__)


def queue_depth(train: TrainConfig, warn: bool = False) -> int:
    """Batches generated ahead: ``train.async_queue_size``, clamped under ``staleness_policy=wait`` so that no sample
    is older than ``train.max_staleness`` (a partial rollout's first tokens are one version older than its batch).
    Raises ValueError when no depth fits."""
    extra = 1 if train.partial_rollout else 0
    depth = train.async_queue_size
    if train.staleness_policy != "wait" or train.max_staleness >= depth + extra:
        return depth
    if train.max_staleness - extra < 1:
        if train.partial_rollout:
            raise ValueError("train.partial_rollout=true needs train.max_staleness >= 2 (the first tokens of a sample "
                             "are one version older than the rest)")
        raise ValueError("train.async_train=true needs train.max_staleness >= 1 (a batch is generated while the "
                         "previous one trains, one policy version behind); for on-policy rollouts use "
                         "train.async_train=false")
    if warn:
        log.warning("train.async_queue_size=%d exceeds train.max_staleness=%d: generating %d batches ahead", depth,
                    train.max_staleness, train.max_staleness - extra)
    return train.max_staleness - extra


class AsyncRLController(RLController):
    worker: AsyncRoleWorker

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.depth = queue_depth(self.cfg.train, warn=True)
        self.ready: deque[Generated] = deque()  # generated, not yet trained (+ seconds)
        self.generated = 0  # batches generated so far
        self.partial_in_flight = False  # whether a cut-short batch waits to be finished

    # ------------------------------------------------------------------ queue
    def _start_generation(self, wanted: bool) -> bool:
        """Start a generation round if ``wanted`` and one is needed; whether it started. A round starts the next batch
        while prompts remain; with partial rollouts it also finishes the batch the previous round cut short."""
        more = self.generated < self.num_steps
        if not (wanted and (more or self.partial_in_flight)):
            return False
        prompts = []  # the last partial round only finishes the batch in flight
        if more:
            self.generated += 1
            prompts = self.state.next_prompts()
        self.partial_in_flight = self.cfg.train.partial_rollout and more
        self.call(StartRollouts(self.generated), prompts)
        return True

    def _finish_generation(self) -> None:
        trajectories, seconds = self.collect_trajectories()
        if trajectories:
            self.ready.append((trajectories, seconds))

    def before_steps(self, start: int) -> None:
        """Fill the queue to ``depth`` batches (a resumed run already has its queue back)."""
        self.call(GeneratedSoFar(self.generated))
        while self._start_generation(len(self.ready) < self.depth):
            self._finish_generation()

    # ------------------------------------------------------------------ one step
    def step(self, step: int, timer: PhaseTimer) -> Row:
        # The rollout ranks generate from here to the collect below; the training ranks serve the commands between.
        more = self._start_generation(True)
        popped, gen_seconds = self.ready.popleft()
        train_start = time.perf_counter()
        with timer("reward"):
            popped = self.score(popped)
        trajectories, staleness, dropped = self._drop_stale(popped)
        with timer("make_experience"):
            batch = self.make_experience(trajectories)
        self.dump_rollouts(step, popped)
        with timer("train"):
            train_stats = self.train(batch) if batch is not None else {"skipped_update": 1.0}
        train_seconds = time.perf_counter() - train_start
        with timer("wait_for_rollout"):
            if more:
                self._finish_generation()
        with timer("weight_sync"):
            self.sync_weights()
        self.state.health.observe(popped, step)
        row = {**rollout_metrics(popped, batch, gen_seconds), **train_stats,
               "weight_sync/bytes": float(self.worker.sync_bytes)}
        mixed = sum(len(set(t.token_versions or [])) > 1 for t in popped)
        row.update(self._async_metrics(staleness, dropped, gen_seconds, train_seconds, timer, mixed))
        row.update(token_version_metrics(trajectories, self.policy_version - 1))
        step_s = train_seconds + timer.seconds.get("wait_for_rollout", 0.0)
        row["async/engine_busy_s"] = self.worker.engine_busy_s
        row["async/engine_idle_fraction"] = max(0.0, 1.0 - self.worker.engine_busy_s / max(step_s, 1e-9))
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

    def restore_buffers(self, buffers: Buffers | None, same_world: bool = True) -> None:
        if buffers:
            self.ready = deque(buffers["ready"])
            self.generated = buffers["generated"]
            # Another layout dropped the rollout ranks' cut-short batch (its rank buffers): nothing to finish.
            self.partial_in_flight = buffers["partial_in_flight"] and same_world


def token_version_metrics(trajectories: list[Trajectory], trained_version: int) -> dict[str, float]:
    """Per-token policy versions of a trained batch: versions spanned per episode (mean, max) and generated tokens
    per version lag (``async/tokens_lag_<k>``: sampled ``k`` versions before the policy that trains on them,
    ``trained_version``), and the largest lag (``async/token_staleness_max``)."""
    lags: Counter[int] = Counter()
    spans = []
    for t in trajectories:
        versions = t.token_versions or [t.policy_version] * len(t.response_ids)
        for version, mask in zip(versions, t.action_mask, strict=True):
            if mask:
                lags[trained_version - version] += 1
        spans.append(versions_spanned(t))
    out = {f"async/tokens_lag_{k}": float(v) for k, v in sorted(lags.items())}
    out["async/token_staleness_max"] = float(max(lags, default=0))
    out["async/versions_per_episode"] = sum(spans) / max(len(spans), 1)
    out["async/versions_per_episode_max"] = float(max(spans, default=0))
    return out
