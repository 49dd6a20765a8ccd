"""The asynchronous trainer's role worker: a rollout rank's part of a generation round that outlives a step.

Beyond the synchronous worker (``role_worker``): a rollout rank times its engine's busy seconds (sent to rank 0 with
each training round's trajectories, for the engine idle fraction); with ``train.partial_rollout`` it keeps the batch
it cut short at ``rollout.partial_chunk_tokens`` (or, with a multi-turn agent, the episodes in flight,
``agents.in_flight``) until the next round finishes it with newer weights, and saves them in checkpoints. Every rank
counts the batches generated so far (``StartRollouts.seed_step`` says it; ``GeneratedSoFar`` after a resume).

Runs on every rank (the rollout ranks hold the state above).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from hpc_rlhf.agents.executor import GenerateFn, SingleTurnExecutor, timed_generate
from hpc_rlhf.agents.in_flight import InFlightEpisodes, in_flight_pool
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.trainers.rl.commands import CloseRollouts, CollectRollouts, GeneratedSoFar, StartRollouts
from hpc_rlhf.trainers.rl.controller_checkpoint import Buffers
from hpc_rlhf.trainers.rl.partial_rollout import continue_generation, stamp_versions
from hpc_rlhf.trainers.rl.role_worker import RoleWorker, sampling_seed
from hpc_rlhf.trainers.rl.roles import Generated


class AsyncRoleWorker(RoleWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.generated = 0  # batches generated so far (the training rounds' sampling seeds count them)
        self.in_flight: list[Trajectory] | None = None  # rollout ranks, partial mode: the batch cut at chunk_tokens
        # Rollout ranks, partial mode with agents: episodes carried across weight updates (``agents.in_flight``);
        # restored_episodes: the pool's checkpointed state until the pool is built.
        self.episodes: InFlightEpisodes | None = None
        self.restored_episodes: list[dict[str, Any]] | None = None
        self.round_busy_s = 0.0  # rollout ranks: seconds inside generate since the last collect
        self.engine_busy_s = 0.0  # rank 0: the engines' seconds inside generate in the latest round (slowest engine)

    def start_rollouts(self, command: StartRollouts, prompts: list[Prompt] | None) -> None:
        if not command.evaluation:
            self.generated = command.seed_step
        super().start_rollouts(command, prompts)

    def generated_so_far(self, command: GeneratedSoFar, _: None = None) -> None:
        self.generated = command.count

    def collect_rollouts(self, command: CollectRollouts, _: None = None) -> list[Generated] | None:
        """The round's trajectories, then (a training round) the engines' busy seconds of the round."""
        evaluation = self._round_is_eval
        gathered = super().collect_rollouts(command)
        if evaluation:
            return gathered
        rollout = self.handles.rollout
        busy = rollout.collect(([], self._take_busy_seconds()) if rollout.side is not None else None)
        if busy is not None:
            self.engine_busy_s = max(s for _, s in busy)
        return gathered

    def _take_busy_seconds(self) -> float:
        busy, self.round_busy_s = self.round_busy_s, 0.0
        return busy

    def run_rollouts(self, prompts: list[Prompt] | None, step: int) -> Generated:
        """Partial mode: finish the batch in flight with the current weights, then start the next one and stop it
        after ``rollout.partial_chunk_tokens`` tokens (it finishes after the next sync)."""
        rollout = self.handles.rollout.require_side()
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
        return timed_generate(generate, self._add_busy_seconds)

    def _add_busy_seconds(self, seconds: float) -> None:
        self.round_busy_s += seconds

    def checkpoint_rank_buffers(self) -> Buffers | None:
        if self.in_flight:
            return {"in_flight": self.in_flight}
        if self.episodes is not None and self.episodes.num_batches:
            return {"in_flight_episodes": self.episodes.state()}
        return None

    def restore_rank_buffers(self, buffers: Buffers) -> None:
        self.in_flight = buffers.get("in_flight")
        self.restored_episodes = buffers.get("in_flight_episodes")

    def close_rollouts(self, command: CloseRollouts, _: None = None) -> None:
        if self.episodes is not None:
            self.episodes.close()
        super().close_rollouts(command)
