"""Multi-turn episodes that outlive a weight update (asynchronous RL, ``train.partial_rollout``).

A rollout rank of the asynchronous trainer keeps the episodes of up to two batches alive across its calls:
the batch it finishes now (started one call earlier, under the previous weights) and the batch it just
started. Each call runs *rounds* (one ``generate`` call holding the next turn of every active episode of
both batches, then every ``step``) until the older batch is finished, and at least one round so that the new
batch advances; the new batch's episodes then wait between turns while the weight update lands, and their
later turns run under the new weights. The engine's batches stay full: the short episodes of the new batch
fill the slots the older batch's long episodes leave, instead of the engine idling at the older batch's tail.

Every response token records the policy version that sampled it (``Trajectory.token_versions``; environment
feedback takes the version of the turn it answers) and keeps the engine's logprob, so off-policy corrections
see each token's behaviour policy. An episode spans at most two versions; ``Trajectory.policy_version`` is its
oldest token's, which the trainer's staleness bound (``train.max_staleness``) applies to.

Checkpoints: agent objects are user code and are not pickled. :meth:`InFlightEpisodes.state` keeps each batch's
prompts, sampling parameters and the trajectories of its finished episodes; after a resume the unfinished
episodes start again from their first turn with the same per-episode, per-turn seeds (``episodes.derive_seed``
of the same step seed, episode index and turn), so nothing finished is regenerated and no prompt is skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpc_rlhf.agents.episodes import Episode, EpisodeDriver, RunStats, new_episodes
from hpc_rlhf.agents.executor import GenerateFn, check_samples_per_prompt, timed_generate
from hpc_rlhf.agents.multi_turn import MultiTurnAgentExecutor
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.rollout.base import SamplingParams, Trajectory
from hpc_rlhf.utils.user_calls import run_to_completion


@dataclass
class _Batch:
    """One step's episodes while some still run."""

    step: int  # the generation round that started it (seeds its sampling)
    prompts: list[Prompt]
    sampling: SamplingParams
    n: int
    episodes: list[Episode]
    versions: dict[int, list[int]] = field(default_factory=dict)  # episode index -> version per response token
    done: dict[int, Trajectory] = field(default_factory=dict)  # episode index -> its finished trajectory
    started: set[int] = field(default_factory=set)  # episodes whose agent was built and reset

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.episodes)

    def trajectories(self) -> list[Trajectory]:
        return [self.done[e.index] for e in self.episodes]


def versions_spanned(t: Trajectory) -> int:
    """How many policy versions sampled the trained tokens of ``t`` (1 when ``token_versions`` is unset)."""
    if not t.token_versions:
        return 1
    return len({v for v, m in zip(t.token_versions, t.action_mask, strict=True) if m}) or 1




class InFlightEpisodes:
    """The episodes a rollout rank carries across weight updates (see the module docstring).

    Args:
        executor: the run's reset/step agent executor (``MultiTurnAgentExecutor``); its settings drive the
            episodes through the same ``agents.episodes`` logic as its ``run``, one round at a time. Executors
            overriding ``execute`` are refused: their override holds an episode inside one call of the executor.
    """

    def __init__(self, executor: MultiTurnAgentExecutor) -> None:
        if executor.overrides_execute():
            raise ValueError(f"{type(executor).__name__} overrides execute(): its episodes cannot wait between calls "
                             "for a weight update; with train.partial_rollout=true write the per-turn logic in "
                             "AgentInstance.step, or set train.partial_rollout=false")
        executor.validate_settings()
        self.executor = executor
        self.batches: list[_Batch] = []
        self.stats = RunStats()
        self.generate_seconds = 0.0  # inside the engine's generate calls, over all calls so far
        self._driver: EpisodeDriver | None = None  # lives as long as the agents it runs

    # ------------------------------------------------------------------ batches
    def add(self, prompts: list[Prompt], sampling: SamplingParams, n: int, step: int,
            done: dict[int, Trajectory] | None = None) -> None:
        """Queue a batch's episodes (``done``: trajectories of episodes already finished, e.g. restored)."""
        check_samples_per_prompt(n)
        episodes = new_episodes(prompts, sampling, n)
        batch = _Batch(step=step, prompts=list(prompts), sampling=sampling, n=n, episodes=episodes,
                       done=dict(done or {}))
        self.stats.num_episodes += len(episodes) - len(batch.done)
        self.batches.append(batch)

    @property
    def num_batches(self) -> int:
        return len(self.batches)

    def advance(self, generate: GenerateFn, version: int, finish_all: bool = False) -> list[Trajectory]:
        """Run rounds until every batch but the newest is finished (all of them with ``finish_all``), and at least
        one round while the newest has active episodes; returns the finished batches' trajectories in batch order,
        each batch's in its prompt order, and keeps the newest batch unless it finished."""
        if not self.batches:
            return []
        timed = self._timed(generate)
        run_to_completion(lambda: self._rounds(timed, version, finish_all))
        out: list[Trajectory] = []
        newest = self.batches[-1]
        while self.batches and self.batches[0].finished and (finish_all or self.batches[0] is not newest):
            out += self.batches.pop(0).trajectories()
        return out

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> list[dict[str, Any]]:
        """Picklable: per batch its step, prompts, sampling, samples per prompt and finished trajectories (agent
        objects are user code and not kept: unfinished episodes start again from their first turn)."""
        return [{"step": b.step, "prompts": b.prompts, "sampling": b.sampling, "n": b.n, "done": dict(b.done)}
                for b in self.batches]

    def restore(self, state: list[dict[str, Any]]) -> None:
        self.batches = []
        for b in state:
            self.add(b["prompts"], b["sampling"], b["n"], b["step"], done=b["done"])

    # ------------------------------------------------------------------ rounds
    def _timed(self, generate: GenerateFn) -> GenerateFn:
        return timed_generate(generate, self._add_generate_seconds)

    def _add_generate_seconds(self, seconds: float) -> None:
        self.generate_seconds += seconds

    async def _rounds(self, generate: GenerateFn, version: int, finish_all: bool) -> None:
        if self._driver is None:
            self._driver = EpisodeDriver(self.executor, self.stats)
        driver = self._driver
        rounds = 0
        while True:
            await self._admit(driver, version)
            active = [(b, e) for b in self.batches for e in b.episodes
                      if e.index in b.started and e.index not in b.done]
            older_running = any(not b.finished for b in (self.batches if finish_all else self.batches[:-1]))
            if not active or not (older_running or rounds == 0):
                break
            self.stats.max_active = max(self.stats.max_active, len(active))
            episodes = [e for _, e in active]
            driver.generate_round(episodes, generate)
            await _gather(driver.step(e) for e in episodes)
            for batch, episode in active:
                stamped = batch.versions.setdefault(episode.index, [])
                stamped += [version] * (len(episode.response_ids) - len(stamped))
                if episode.finished:
                    self._finish(driver, batch, episode, version)
            rounds += 1

    async def _admit(self, driver: EpisodeDriver, version: int) -> None:
        """Build and reset queued episodes while fewer than ``num_concurrent`` run. An episode whose ``reset``
        fails ends here and is stamped ``version`` (the weights current now), like any episode finished now."""
        alive = sum(len(b.started) - len(b.done.keys() & b.started) for b in self.batches)
        room = self.executor.num_concurrent - alive
        todo = [(b, e) for b in self.batches for e in b.episodes
                if e.index not in b.started and e.index not in b.done][:max(room, 0)]
        if not todo:
            return
        await _gather(driver.start(e) for _, e in todo)
        for batch, episode in todo:
            batch.started.add(episode.index)
            if episode.finished:  # reset failed
                self._finish(driver, batch, episode, version)

    def _finish(self, driver: EpisodeDriver, batch: _Batch, episode: Episode, version: int) -> None:
        trajectory = driver.trajectory(episode)
        stamped = batch.versions.get(episode.index, [])
        fill = stamped[-1] if stamped else version
        versions = stamped + [fill] * (len(trajectory.response_ids) - len(stamped))
        trajectory.token_versions = versions
        trajectory.policy_version = min(versions, default=fill)  # the oldest token's
        episode.agent = None  # user code: released as soon as its episode ends
        batch.done[episode.index] = trajectory


async def _gather(coroutines: Any) -> None:
    await asyncio.gather(*coroutines)


def in_flight_pool(executor: object) -> Callable[[], InFlightEpisodes]:
    """A factory of the pool for ``executor``, or a clear error for executors that cannot carry episodes across
    weight updates (OpenAI-client agents: their episodes run the user's own code between calls)."""
    if not isinstance(executor, MultiTurnAgentExecutor):
        raise ValueError(f"train.partial_rollout=true with agents needs a reset/step agent (AgentInstance / "
                         f"MultiTurnAgentExecutor); {type(executor).__name__} (OpenAI-client agents) is not supported "
                         "there yet: set train.partial_rollout=false")
    return lambda: InFlightEpisodes(executor)
