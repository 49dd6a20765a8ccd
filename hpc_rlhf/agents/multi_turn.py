"""Multi-turn agents (reset / step environments), token in / token out, with OpenRLHF's user API.

A user file (``train.agent_func_path``) written for OpenRLHF works with only the import changed::

    from hpc_rlhf.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor

    class AgentInstance(AgentInstanceBase):
        async def reset(self, states: dict, **kwargs) -> dict:
            # states: {"observation": prompt text, "label": dataset label}
            return {"observation": states["observation"]}      # the text the model is prompted with

        async def step(self, states: dict, **kwargs) -> dict:
            # states: {"observation_text": text before this turn's action (prompt + earlier actions and
            #          feedback), "action_text": the model's latest turn, "label": ...,
            #          "sampling_params": this turn's SamplingParams}
            return {
                "rewards": 1.0,                    # float or 1-element tensor
                "scores": 1.0,                     # optional, default rewards (filtering / logging)
                "environment_feedback": "...",     # text appended before the next turn ("" for none)
                "environment_images": [],          # optional images (screenshots) in the feedback
                "done": False,                     # end the episode
                "sampling_params": {"temperature": 0.6},  # optional overrides, kept for later turns
                "extra_logs": {"name": 0.5},       # optional numbers, logged as means
            }

    class AgentExecutor(MultiTurnAgentExecutor):
        pass      # or: def __init__(self): super().__init__(AgentInstance)

One ``AgentInstance`` is created (no arguments; ``async def __init__`` is accepted too) per sample:
a step with P prompts and n samples per prompt runs P*n independent episodes.

Token in, token out
-------------------
The first prompt is the reset observation tokenized like single-turn prompts (``tokenize_prompts``,
``prompt_max_len``, left truncation). After that no text is ever re-tokenized: turn k's prompt is
``prompt_ids + response_ids`` so far, where ``response_ids`` concatenates each turn's generated
token ids exactly as the engine returned them (``action_mask`` 1, the engine's ``rollout_logprobs``)
and each ``environment_feedback`` tokenized on its own without special tokens (``action_mask`` 0,
logprob 0.0). Feedback after the last turn (done, or out of turns) is not appended: nothing would be
conditioned on it. ``action_text`` is the decoded turn with special tokens skipped (as vLLM's text).

Budgets and ends
----------------
* ``max_len`` bounds prompt + response tokens; each turn asks for ``min(max_new_tokens, remaining)``
  new tokens. Running out (or feedback that does not fit with room for one more token) ends the
  episode with ``truncated=True``, ``finish_reason="max_len"``; the overflowing feedback is dropped.
* ``max_turns`` bounds the model turns: ending there gives ``truncated=True``,
  ``finish_reason="max_turns"``.
* ``done`` from the environment ends the episode with ``truncated=False`` and the last
  generation's finish reason (``"stop"`` / ``"length"``). The env sees every action, also the last.

Rewards: ``Trajectory.reward`` is the *last* step's ``rewards`` (``reward_mode = "last"``; set
``reward_mode = "sum"`` on your executor class to add the steps' rewards, as recent OpenRLHF
versions do); ``score`` the last step's ``scores`` (default: the reward); ``extra_logs`` the last
step's ``extra_logs`` plus ``num_turns``, ``agent_error`` and ``agent_timeout`` (0/1).

Scheduling
----------
Episodes run concurrently on one asyncio loop, at most ``num_concurrent`` at a time, in *rounds*:
start newly admitted episodes (create + ``reset``), make **one** ``generate`` call holding the next
turn of every active episode (the engine is synchronous and batched; identical prompts with identical
sampling parameters, e.g. the n samples of a prompt in turn 1, become one request with ``n`` > 1 so
the engine shares the prefix), then run all ``step`` calls concurrently. When a sampling seed is set,
each episode and turn gets its own seed derived from it (the n samples of a prompt must not share a
seed on engines with per-request seeds, e.g. vLLM). The per-episode logic (start, a round, a step, the
trajectory) is ``hpc_rlhf.agents.episodes``'s, shared with the asynchronous trainer's ``agents.in_flight``.

Failures: a ``reset``/``step`` (or agent constructor) that raises, returns malformed output, or runs
longer than ``step_timeout_s`` ends only its episode: reward 0.0, ``extra_logs["agent_error"] = 1``,
``finish_reason`` ``"agent_error"`` / ``"agent_timeout"``, ``truncated=False``. Its tokens are kept
but with ``action_mask`` 0 (``train_on_failed_episodes = False``), so an environment failure does
not push the policy away from what it generated. Each failure is logged with its cause and counted
in ``executor.last_run_stats``. Agent code never runs on the executor's own loop
(``utils.user_calls``): ``async`` methods run on a private loop in a daemon thread, plain ``def`` methods
in daemon threads, so a timeout holds even for blocking code inside ``async def``, a timed-out call is
abandoned (never joined), and a hung call cannot keep the process alive when training ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

# AgentTimeoutError: raised by the episode logic, imported from here by agent code and the API reference.
from hpc_rlhf.agents.episodes import AgentTimeoutError, Episode, EpisodeDriver, RunStats, new_episodes
from hpc_rlhf.agents.executor import AgentExecutor, GenerateFn, check_samples_per_prompt
from hpc_rlhf.agents.step_output import AgentOutputError, numeric_logs, to_float
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.rollout.base import SamplingParams, Trajectory
from hpc_rlhf.utils.user_calls import run_to_completion

logger = logging.getLogger(__name__)


class AgentInstanceBase(ABC):
    """One environment episode. Subclass it and implement ``step`` (and usually ``reset``)."""

    # Not abstract: OpenRLHF agents call super().__init__(*args, **kwargs), which must accept and ignore them.
    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """Return ``{"observation": str}``, the prompt text; ``states`` has ``observation`` and ``label``."""
        return {"observation": states["observation"]}

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        """Judge ``states["action_text"]``; return rewards, scores, environment_feedback, done (see module doc)."""


# The episode whose ``execute`` override is running (set on the user loop, read by the base ``execute``).
_CURRENT_EPISODE: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("hpc_rlhf_episode", default=None)


class MultiTurnAgentExecutor(AgentExecutor):
    """Runs ``AgentInstance`` episodes against the rollout engine (see the module docstring).

    Args:
        agent_instance_cls: the ``AgentInstance`` class (or set the class attribute of a subclass;
            the loader fills it from the agent file).
        tokenizer: as every executor; may be given later with :meth:`configure`.
        prompt_max_len: as every executor; may be given later with :meth:`configure`.
        max_len: prompt + response token budget per episode; None for no budget beyond ``max_turns``.
        max_turns: model turns per episode.
        num_concurrent: episodes alive at once (bounds environment load and open agent objects).
        step_timeout_s: limit for each ``reset`` / ``step`` call; None for none.
    """

    agent_instance_cls: type | None = None
    reward_mode: str = "last"  # or "sum"
    train_on_failed_episodes: bool = False
    # train.agent_kwargs: given to AgentInstance(...) and reset(...); read-only here, so no instance shares a dict
    agent_kwargs: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, agent_instance_cls: type | None = None, tokenizer: Tokenizer | None = None,
                 prompt_max_len: int | None = None, *, max_len: int | None = None, max_turns: int = 8,
                 num_concurrent: int = 256, step_timeout_s: float | None = 300.0) -> None:
        super().__init__(tokenizer, prompt_max_len)  # type: ignore[arg-type]
        if agent_instance_cls is not None:
            self.agent_instance_cls = agent_instance_cls
        self.max_len = max_len
        self.max_turns = max_turns
        self.num_concurrent = num_concurrent
        self.step_timeout_s = step_timeout_s
        self.last_run_stats: dict[str, float] = {}

    def configure(self, *, tokenizer: Tokenizer, prompt_max_len: int, max_len: int | None = None,
                  max_turns: int | None = None, num_concurrent: int | None = None,
                  step_timeout_s: float | Literal["unchanged"] | None = "unchanged",
                  agent_kwargs: dict[str, Any] | None = None) -> MultiTurnAgentExecutor:
        """Set the run settings after construction (user executors are built with no arguments)."""
        self.tokenizer, self.prompt_max_len, self.max_len = tokenizer, prompt_max_len, max_len
        if agent_kwargs is not None:
            self.agent_kwargs = dict(agent_kwargs)
        if max_turns is not None:
            self.max_turns = max_turns
        if num_concurrent is not None:
            self.num_concurrent = num_concurrent
        if step_timeout_s != "unchanged":
            self.step_timeout_s = step_timeout_s
        self.validate_settings()
        return self

    def validate_settings(self) -> None:
        """Raise ``ValueError`` naming the setting no episode can run under (no agent class with ``step`` or no
        tokenizer; ``prompt_max_len``, ``max_len``, ``max_turns``, ``num_concurrent``, ``step_timeout_s`` or
        ``reward_mode`` out of range)."""
        cls = self.agent_instance_cls
        if cls is None or not callable(getattr(cls, "step", None)):
            raise ValueError(f"{type(self).__name__}: agent_instance_cls must be a class with a step() method, "
                             f"got {cls!r}")
        if self.tokenizer is None:
            raise ValueError(f"{type(self).__name__}: no tokenizer (pass it or call configure())")
        if self.prompt_max_len is None or self.prompt_max_len < 1:
            raise ValueError(f"{type(self).__name__}: prompt_max_len must be >= 1, got {self.prompt_max_len}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 (a prompt token and a response token), got {self.max_len}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.num_concurrent < 1:
            raise ValueError(f"num_concurrent must be >= 1, got {self.num_concurrent}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 or None, got {self.step_timeout_s}")
        if self.reward_mode not in ("last", "sum"):
            raise ValueError(f"reward_mode must be 'last' or 'sum', got {self.reward_mode!r}")

    # ------------------------------------------------------------------ the contract

    def run(self, prompts: list[Prompt], generate: GenerateFn, sampling: SamplingParams,
            n_samples_per_prompt: int) -> list[Trajectory]:
        check_samples_per_prompt(n_samples_per_prompt)
        self.validate_settings()
        stats = RunStats(num_episodes=len(prompts) * n_samples_per_prompt)
        episodes = new_episodes(prompts, sampling, n_samples_per_prompt)
        driver = EpisodeDriver(self, stats)
        if episodes:
            run_to_completion(lambda: self._run_episodes(episodes, generate, driver))
        trajectories = [driver.trajectory(episode) for episode in episodes]
        self.last_run_stats = dataclasses.asdict(stats)
        failed = stats.agent_errors + stats.agent_timeouts
        if failed:
            logger.warning("multi-turn rollout: %d of %d episodes ended by agent failures (%d errors, %d timeouts)",
                           failed, stats.num_episodes, stats.agent_errors, stats.agent_timeouts)
        return trajectories

    # ------------------------------------------------------------------ scheduling

    async def execute(self, prompt: str, label: Any, sampling_params: Any = None, *args: Any, **kwargs: Any) -> dict:
        """One episode, for OpenRLHF-style ``execute`` overrides that wrap ``super().execute(...)``.

        The executor calls your override once per episode; the base implementation takes the (possibly
        changed) prompt, label and sampling parameters, lets the executor run the episode token in / token
        out, and returns ``{"prompt", "label", "reward", "scores", "extra_logs"}``. Whatever of ``reward``,
        ``scores`` and ``extra_logs`` your override returns in a dict becomes the episode's.
        """
        episode = _CURRENT_EPISODE.get()
        if episode is None or episode.done_signal is None or episode.entered is None:
            raise RuntimeError("execute() is called by the executor once per episode; do not call it yourself")
        if prompt != episode.prompt.text or label != episode.prompt.label:
            episode.prompt = dataclasses.replace(episode.prompt, text=str(prompt), label=label)
        if isinstance(sampling_params, SamplingParams):
            episode.params = sampling_params
        entered = episode.entered
        entered.get_loop().call_soon_threadsafe(_set_if_pending, entered)
        await asyncio.wrap_future(episode.done_signal)
        return {"prompt": episode.prompt_text, "label": episode.prompt.label, "reward": episode.reward,
                "scores": episode.score, "extra_logs": dict(episode.extra_logs)}

    def overrides_execute(self) -> bool:
        """Whether this executor's class overrides :meth:`execute` (each episode then runs inside that call)."""
        return type(self).execute is not MultiTurnAgentExecutor.execute

    async def _run_episodes(self, episodes: list[Episode], generate: GenerateFn, driver: EpisodeDriver) -> None:
        waiting = deque(episodes)
        active: list[Episode] = []
        overrides: dict[int, asyncio.Future] = {}
        stats = driver.stats
        try:
            while waiting or active:
                admitted = [waiting.popleft() for _ in range(min(len(waiting), self.num_concurrent - len(active)))]
                if admitted:
                    if self.overrides_execute():
                        await asyncio.gather(*(self._enter_execute(e, overrides, driver) for e in admitted))
                    await asyncio.gather(*(driver.start(e) for e in admitted if not e.finished))
                    active += [episode for episode in admitted if not episode.finished]
                if not active:
                    continue
                stats.max_active = max(stats.max_active, len(active))
                driver.generate_round(active, generate)
                await asyncio.gather(*(driver.step(episode) for episode in active))
                active = [episode for episode in active if not episode.finished]
            await asyncio.gather(*(self._leave_execute(e, overrides[e.index], driver)
                                   for e in episodes if e.index in overrides))
        finally:
            driver.close()

    async def _enter_execute(self, episode: Episode, overrides: dict[int, asyncio.Future],
                             driver: EpisodeDriver) -> None:
        """Start the user's ``execute`` override for ``episode`` and wait until it calls ``super().execute``."""
        episode.entered = asyncio.get_running_loop().create_future()
        episode.done_signal = concurrent.futures.Future()

        async def drive() -> Any:
            _CURRENT_EPISODE.set(episode)
            return await self.execute(episode.prompt.text, episode.prompt.label, episode.params)

        task = driver.calls.submit(drive())
        overrides[episode.index] = task
        done, _ = await asyncio.wait({episode.entered, task}, timeout=self.step_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if episode.entered in done:
            return
        episode.prompt_ids, episode.visual = driver.encode_prompt(episode.prompt, episode.prompt.text)
        episode.prompt_text = episode.prompt.text
        if task in done:
            err = task.exception() or AgentOutputError(
                f"{type(self).__name__}.execute returned without awaiting super().execute(prompt, label, "
                "sampling_params): generation is the executor's, so execute may only wrap super().execute; "
                "move custom per-turn logic into AgentInstance.step")
            driver.fail(episode, "execute", err)
        else:
            driver.fail(episode, "execute", AgentTimeoutError(
                f"execute did not reach super().execute within step_timeout_s={self.step_timeout_s}"))

    async def _leave_execute(self, episode: Episode, task: asyncio.Future, driver: EpisodeDriver) -> None:
        """Let the override finish after ``super().execute`` returned; apply what it returned."""
        if episode.failure is not None and not task.done():
            task.cancel()
            return
        try:
            result = await asyncio.wait_for(asyncio.shield(task), self.step_timeout_s)
        except asyncio.TimeoutError:
            task.cancel()
            driver.fail(episode, "execute", AgentTimeoutError(
                f"execute did not return within step_timeout_s={self.step_timeout_s} after its episode ended"))
            return
        except Exception as err:  # noqa: BLE001 - any agent failure ends only this episode
            if episode.failure is None:
                driver.fail(episode, "execute", err)
            return
        if isinstance(result, dict) and episode.failure is None:
            try:
                if result.get("reward") is not None:
                    episode.reward = to_float(result["reward"], "reward")
                if result.get("scores") is not None:
                    episode.score = to_float(result["scores"], "scores")
                if isinstance(result.get("extra_logs"), dict):
                    episode.extra_logs = numeric_logs(result["extra_logs"])
            except AgentOutputError as err:
                driver.fail(episode, "execute", err)


class AgentExecutorBase(MultiTurnAgentExecutor):
    """OpenRLHF's ``AgentExecutorBase`` constructor shape, for agent files written against it::

        class AgentExecutor(AgentExecutorBase):
            def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
                super().__init__(AgentInstance, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)

            async def execute(self, prompt, label, sampling_params):   # optional; must wrap super().execute
                return await super().execute(prompt, label, sampling_params)

    The loader supplies the arguments the file's ``__init__`` names: ``max_steps`` (``train.agent_max_turns``),
    ``max_length`` (``data.max_len``), ``hf_tokenizer``, and ``None`` for ``llm_engine`` and ``result_queue``:
    generation and result collection are the executor's (token in / token out), so code that calls the
    vLLM engine itself cannot run here; such logic belongs in ``AgentInstance.step``.
    """

    def __init__(self, agent_instance_cls: type | None = None, max_steps: int | None = None,
                 max_length: int | None = None, llm_engine: Any = None, hf_tokenizer: Tokenizer | None = None,
                 result_queue: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(agent_instance_cls, hf_tokenizer, max_len=max_length,
                         max_turns=max_steps if max_steps is not None else 8)
        self.max_steps, self.max_length = max_steps, max_length
        self.llm_engine, self.hf_tokenizer, self.result_queue = llm_engine, hf_tokenizer, result_queue


def _set_if_pending(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
