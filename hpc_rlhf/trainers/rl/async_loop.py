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

Runs on every rank: rank 0 keeps the ready queue and the step's story; the rollout ranks generate; the
training ranks score and train (through ``loop``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from dataclasses import replace
from typing import Any

import torch.distributed as dist

from hpc_rlhf.agents.executor import GenerateFn, SingleTurnExecutor
from hpc_rlhf.agents.in_flight import InFlightEpisodes, in_flight_pool, versions_spanned
from hpc_rlhf.config import RunConfig
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, Trajectory
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers
from hpc_rlhf.trainers.rl.controller_steps import rollout_metrics
from hpc_rlhf.trainers.rl.loop import PPOTrainer, sampling_seed
from hpc_rlhf.trainers.rl.partial_rollout import continue_generation, stamp_versions
from hpc_rlhf.trainers.rl.roles import Generated, RolloutResult
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
        # Rollout ranks, partial mode with agents: episodes carried across weight updates (``agents.in_flight``);
        # restored_episodes: the pool's checkpointed state until the pool is built.
        self.episodes: InFlightEpisodes | None = None
        self.restored_episodes: list[dict[str, Any]] | None = None
        self.round_busy_s = 0.0  # rollout ranks: seconds inside generate since the last collect
        self.engine_busy_s = 0.0  # rank 0: the engines' seconds inside generate in the latest round (slowest engine)

    # ------------------------------------------------------------------ queue
    def _start_generation(self, wanted: bool) -> tuple[bool, RolloutResult | None]:
        """One generation round, if rank 0 wants it and one is needed (decision broadcast to all).

        Returns (ran, this rank's pending result); rollout ranks have finished generating when it
        returns, the others have only sent the prompts. A round starts the next batch while prompts
        remain; with partial rollouts it also finishes the batch the previous round cut short.
        """
        more = self.generated < self.num_steps
        needed = more or self.partial_in_flight
        if not self._broadcast_flag(self.world.is_controller and wanted and needed):
            return False, None
        prompts: list[Prompt] | None = None
        if more:
            self.generated += 1
            prompts = self.controller.next_prompts() if self.world.is_controller else None
        elif self.world.is_controller:
            prompts = []  # last partial round: only finish the batch in flight
        self.partial_in_flight = self.cfg.train.partial_rollout and more
        mine = self.dispatch_prompts(prompts)
        return True, self.serve_rollouts(lambda: self.run_rollouts(mine, self.generated))

    def _finish_generation(self, pending: RolloutResult | None) -> None:
        trajectories, seconds = self.collect_trajectories(pending)
        if self.world.is_controller and trajectories:
            self.ready.append((trajectories, seconds))
        # The engines' busy seconds of this round (time inside generate), for the engine idle fraction.
        busy = self.handles.rollout.collect(([], self._take_busy_seconds()) if self.handles.rollout.side else None)
        if busy is not None:
            self.engine_busy_s = max(s for _, s in busy)

    def _take_busy_seconds(self) -> float:
        busy, self.round_busy_s = self.round_busy_s, 0.0
        return busy

    def run_rollouts(self, prompts: list[Prompt] | None, step: int) -> Generated | None:
        """Partial mode: finish the batch in flight with the current weights, then start the next one
        and stop it after ``rollout.partial_chunk_tokens`` tokens (it finishes after the next sync)."""
        if self.handles.rollout.side is None:
            return None
        rollout = self.handles.rollout.side
        if not self.cfg.train.partial_rollout:
            return super().run_rollouts(prompts, step)
        if not isinstance(rollout.executor, SingleTurnExecutor):
            return self._run_agent_rollouts(prompts, step)
        start = time.perf_counter()
        sampling = rollout.sampling(sampling_seed(self.cfg.train.seed, step, self.handles.rollout.engine_index))
        generate = self.engine_generate(rollout.engine.generate)
        finished: list[Trajectory] = []
        if self.in_flight:
            finished = continue_generation(self.in_flight, generate, sampling, self.policy_version,
                                           self.cfg.rollout.generate_max_len)
        self.in_flight = None
        if prompts:
            chunk = replace(sampling, max_new_tokens=min(self.cfg.rollout.partial_chunk_tokens,
                                                         self.cfg.rollout.generate_max_len))
            self.in_flight = rollout.executor.run(prompts, generate, chunk, self.cfg.rollout.n_samples_per_prompt)
            stamp_versions(self.in_flight, self.policy_version)
        return finished, time.perf_counter() - start

    def _run_agent_rollouts(self, prompts: list[Prompt] | None, step: int) -> Generated:
        """Partial mode with a multi-turn agent: the new batch's episodes join those of the batch in flight, rounds
        run until that one is finished (``agents.in_flight``), and the new batch waits between turns for the weight
        update. Returns the finished batch (empty on the first round)."""
        start = time.perf_counter()
        side = self.handles.rollout.require_side()
        pool = self._episode_pool()
        if prompts:
            sampling = side.sampling(sampling_seed(self.cfg.train.seed, step, self.handles.rollout.engine_index))
            pool.add(prompts, sampling, self.cfg.rollout.n_samples_per_prompt, step)
        busy = pool.generate_seconds
        finished = pool.advance(side.engine.generate, self.policy_version, finish_all=not prompts)
        self.round_busy_s += pool.generate_seconds - busy
        return finished, time.perf_counter() - start

    def _episode_pool(self) -> InFlightEpisodes:
        if self.episodes is None:
            self.episodes = in_flight_pool(self.handles.rollout.require_side().executor)()
            if self.restored_episodes:
                self.episodes.restore(self.restored_episodes)
            self.restored_episodes = None
        return self.episodes

    def engine_generate(self, generate: GenerateFn) -> GenerateFn:
        """``generate`` counting its seconds into this round's engine busy time."""
        def timed(requests: list[GenerationRequest]) -> list[GenerationResult]:
            start = time.perf_counter()
            try:
                return generate(requests)
            finally:
                self.round_busy_s += time.perf_counter() - start
        return timed

    def before_steps(self, start: int) -> None:
        """Fill the queue to ``depth`` batches (a resumed run already has its queue back)."""
        box = [(self.generated, self.partial_in_flight)]
        dist.broadcast_object_list(box, src=0)  # restored on rank 0 only
        self.generated, self.partial_in_flight = box[0]
        while True:
            ran, pending = self._start_generation(self.world.is_controller and len(self.ready) < self.depth)
            if not ran:
                break
            self._finish_generation(pending)

    # ------------------------------------------------------------------ one step
    def step(self, step: int, timer: PhaseTimer) -> Row | None:
        # Rollout ranks generate inside this call; the training ranks only send the prompts and go on,
        # as they share no collective with the rollout ranks until the collect below.
        more, pending = self._start_generation(True)
        popped, gen_seconds = self.ready.popleft() if self.world.is_controller else (None, 0.0)
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
        row.update(token_version_metrics(trajectories or [], self.policy_version - 1))
        step_s = train_seconds + timer.seconds.get("wait_for_rollout", 0.0)
        row["async/engine_busy_s"] = self.engine_busy_s
        row["async/engine_idle_fraction"] = max(0.0, 1.0 - self.engine_busy_s / max(step_s, 1e-9))
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
        if self.in_flight:
            return {"in_flight": self.in_flight}
        if self.episodes is not None and self.episodes.num_batches:
            return {"in_flight_episodes": self.episodes.state()}
        return None

    def restore_rank_buffers(self, buffers: Buffers) -> None:
        self.in_flight = buffers.get("in_flight")
        self.restored_episodes = buffers.get("in_flight_episodes")

    def after_steps(self) -> None:
        if self.episodes is not None:
            self.episodes.close()
        super().after_steps()

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


def trainer_class(cfg: RunConfig) -> type[PPOTrainer]:
    return AsyncPPOTrainer if cfg.train.async_train else PPOTrainer
