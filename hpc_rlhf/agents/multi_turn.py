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
seed on engines with per-request seeds, e.g. vLLM).

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
import hashlib
import inspect
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from hpc_rlhf.agents.executor import AgentExecutor, GenerateFn, check_samples_per_prompt
from hpc_rlhf.agents.images import AgentImageError, encode_observation, feedback_tokens
from hpc_rlhf.agents.step_output import AgentOutputError, apply_sampling, numeric_logs, parse_step_output, to_float
from hpc_rlhf.data.prompts import Prompt, source_name, tokenize_prompts
from hpc_rlhf.models.routing_replay import continue_routes, pad_routes
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, SamplingParams, Trajectory
from hpc_rlhf.utils.user_calls import UserCallRunner, UserCallTimeout, run_to_completion
from hpc_rlhf.utils.user_code import accepted_kwargs

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


class AgentTimeoutError(TimeoutError):
    """An agent call ran past ``step_timeout_s``."""


@dataclass
class _Episode:
    """The state of one sample while it runs."""

    index: int
    group_index: int
    prompt: Prompt
    params: SamplingParams
    agent: Any = None
    prompt_text: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    observation_text: str = ""
    response_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    num_turns: int = 0
    turn_params: SamplingParams | None = None
    action_text: str = ""
    last_finish: str = ""
    routes: Any = None  # (positions, L, k) experts as first computed (routing_replay.continue_routes), or None
    visual: Any = None  # every image of prompt_ids + response_ids so far (PromptVisual, agents.images), or None
    reward: float = 0.0
    score: float = 0.0
    extra_logs: dict = field(default_factory=dict)
    finished: bool = False
    truncated: bool = False
    finish_reason: str = ""
    failure: str | None = None  # "agent_error" / "agent_timeout"
    error: str | None = None  # the failure's phase and message, for the failure limit's report
    entered: asyncio.Future | None = None  # execute overrides: set when the override reached super().execute
    # execute overrides: set when the episode ends
    done_signal: concurrent.futures.Future[None] | None = None

    def end(self, finish_reason: str, truncated: bool = False) -> None:
        self.finished, self.finish_reason, self.truncated = True, finish_reason, truncated
        if self.done_signal is not None and not self.done_signal.done():
            self.done_signal.set_result(None)


# The episode whose ``execute`` override is running (set on the user loop, read by the base ``execute``).
_CURRENT_EPISODE: contextvars.ContextVar[_Episode | None] = contextvars.ContextVar("hpc_rlhf_episode", default=None)


@dataclass
class _RunStats:
    num_episodes: int = 0
    agent_errors: int = 0
    agent_timeouts: int = 0
    generate_calls: int = 0
    num_requests: int = 0
    num_turns: int = 0
    truncated_max_len: int = 0
    truncated_max_turns: int = 0
    max_active: int = 0


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

    def __init__(self, agent_instance_cls: type | None = None, tokenizer: Any = None,
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
        self._runner: UserCallRunner | None = None

    def configure(self, *, tokenizer: Any, prompt_max_len: int, max_len: int | None = None,
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
        self._validate()
        return self

    def _validate(self) -> None:
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
        self._validate()
        stats = _RunStats(num_episodes=len(prompts) * n_samples_per_prompt)
        episodes = [_Episode(index=g * n_samples_per_prompt + s, group_index=g, prompt=prompt, params=sampling)
                    for g, prompt in enumerate(prompts) for s in range(n_samples_per_prompt)]
        if episodes:
            run_to_completion(lambda: self._run_episodes(episodes, generate, stats))
        trajectories = [self._trajectory(episode) for episode in episodes]
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

    def _overrides_execute(self) -> bool:
        return type(self).execute is not MultiTurnAgentExecutor.execute

    async def _run_episodes(self, episodes: list[_Episode], generate: GenerateFn, stats: _RunStats) -> None:
        waiting = deque(episodes)
        active: list[_Episode] = []
        self._runner = UserCallRunner()
        overrides: dict[int, asyncio.Future] = {}
        try:
            while waiting or active:
                admitted = [waiting.popleft() for _ in range(min(len(waiting), self.num_concurrent - len(active)))]
                if admitted:
                    if self._overrides_execute():
                        await asyncio.gather(*(self._enter_execute(e, overrides, stats) for e in admitted))
                    await asyncio.gather(*(self._start(e, stats) for e in admitted if not e.finished))
                    active += [episode for episode in admitted if not episode.finished]
                if not active:
                    continue
                stats.max_active = max(stats.max_active, len(active))
                self._generate_round(active, generate, stats)
                await asyncio.gather(*(self._step(episode, stats) for episode in active))
                active = [episode for episode in active if not episode.finished]
            await asyncio.gather(*(self._leave_execute(e, overrides[e.index], stats)
                                   for e in episodes if e.index in overrides))
        finally:
            self._runner.close()
            self._runner = None

    async def _enter_execute(self, episode: _Episode, overrides: dict[int, asyncio.Future], stats: _RunStats) -> None:
        """Start the user's ``execute`` override for ``episode`` and wait until it calls ``super().execute``."""
        episode.entered = asyncio.get_running_loop().create_future()
        episode.done_signal = concurrent.futures.Future()

        async def drive() -> Any:
            _CURRENT_EPISODE.set(episode)
            return await self.execute(episode.prompt.text, episode.prompt.label, episode.params)

        task = self._user_calls().submit(drive())
        overrides[episode.index] = task
        done, _ = await asyncio.wait({episode.entered, task}, timeout=self.step_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if episode.entered in done:
            return
        episode.prompt_ids, episode.visual = self._encode_prompt(episode.prompt, episode.prompt.text)
        episode.prompt_text = episode.prompt.text
        if task in done:
            err = task.exception() or AgentOutputError(
                f"{type(self).__name__}.execute returned without awaiting super().execute(prompt, label, "
                "sampling_params): generation is the executor's, so execute may only wrap super().execute; "
                "move custom per-turn logic into AgentInstance.step")
            self._fail(episode, "execute", err, stats)
        else:
            self._fail(episode, "execute", AgentTimeoutError(
                f"execute did not reach super().execute within step_timeout_s={self.step_timeout_s}"), stats)

    async def _leave_execute(self, episode: _Episode, task: asyncio.Future, stats: _RunStats) -> None:
        """Let the override finish after ``super().execute`` returned; apply what it returned."""
        if episode.failure is not None and not task.done():
            task.cancel()
            return
        try:
            result = await asyncio.wait_for(asyncio.shield(task), self.step_timeout_s)
        except asyncio.TimeoutError:
            task.cancel()
            self._fail(episode, "execute", AgentTimeoutError(
                f"execute did not return within step_timeout_s={self.step_timeout_s} after its episode ended"),
                stats)
            return
        except Exception as err:  # noqa: BLE001 - any agent failure ends only this episode
            if episode.failure is None:
                self._fail(episode, "execute", err, stats)
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
                self._fail(episode, "execute", err, stats)

    async def _start(self, episode: _Episode, stats: _RunStats) -> None:
        try:
            episode.agent = await self._agent_call(
                _construct_agent, self.agent_instance_cls, dict(self.agent_kwargs))
            states = {"observation": episode.prompt.text, "label": episode.prompt.label}
            reset = getattr(episode.agent, "reset", None)  # optional for duck-typed agents
            extra = accepted_kwargs(reset, dict(self.agent_kwargs)) if reset is not None else {}
            result = await self._agent_call(reset, states, **extra) if reset is not None else states
            if not isinstance(result, dict) or not isinstance(result.get("observation"), str):
                raise AgentOutputError(f"reset must return a dict with a str 'observation', got {result!r:.200}")
            episode.prompt_text = result["observation"]
        except Exception as err:  # noqa: BLE001 - any agent failure ends only this episode
            episode.prompt_text = episode.prompt.text
            episode.prompt_ids, episode.visual = self._encode_prompt(episode.prompt, episode.prompt_text)
            self._fail(episode, "reset", err, stats)
            return
        episode.prompt_ids, episode.visual = self._encode_prompt(episode.prompt, episode.prompt_text)
        episode.observation_text = episode.prompt_text

    def _tokenize_prompt(self, text: str) -> list[int]:
        limit = self.prompt_max_len if self.max_len is None else min(self.prompt_max_len, self.max_len - 1)
        return tokenize_prompts(self.tokenizer, [text], limit)[0]

    def _encode_prompt(self, prompt: Prompt, text: str) -> tuple[list[int], Any]:
        """(prompt ids, its images or None): a prompt with images goes through the model's processor."""
        limit = self.prompt_max_len if self.max_len is None else min(self.prompt_max_len, self.max_len - 1)
        encoded = encode_observation(self.vision, prompt, text, limit)
        return encoded if encoded is not None else (self._tokenize_prompt(text), None)

    def _remaining(self, episode: _Episode) -> int | None:
        if self.max_len is None:
            return None
        return self.max_len - len(episode.prompt_ids) - len(episode.response_ids)

    def _generate_round(self, active: list[_Episode], generate: GenerateFn, stats: _RunStats) -> None:
        """One engine call with the next turn of every active episode; appends the actions."""
        requests: list[GenerationRequest] = []
        members: list[list[_Episode]] = []
        by_key: dict[tuple, int] = {}
        for episode in active:
            remaining = self._remaining(episode)
            cap = episode.params.max_new_tokens if remaining is None else min(episode.params.max_new_tokens, remaining)
            params = dataclasses.replace(episode.params, max_new_tokens=cap,
                                         stop_token_ids=list(episode.params.stop_token_ids))
            sequence = episode.prompt_ids + episode.response_ids
            key = (tuple(sequence), _params_key(params), id(episode.visual))  # same tokens, other images: apart
            if key in by_key:
                members[by_key[key]].append(episode)
            else:
                by_key[key] = len(requests)
                if params.seed is not None:
                    params.seed = _derive_seed(params.seed, episode.index, episode.num_turns)
                requests.append(GenerationRequest(prompt_ids=sequence, params=params, visual=episode.visual))
                members.append([episode])
            episode.turn_params = params
        for request, group in zip(requests, members, strict=True):
            request.n = len(group)
        stats.generate_calls += 1
        stats.num_requests += len(requests)
        results = _split_results(generate(requests), requests)
        for group, group_results in zip(members, results, strict=True):
            for episode, result in zip(group, group_results, strict=True):
                self._append_action(episode, result)

    def _append_action(self, episode: _Episode, result: GenerationResult) -> None:
        output_ids = list(result.output_ids)
        logprobs = [float(x) for x in result.output_logprobs]
        if len(logprobs) != len(output_ids):
            raise RuntimeError(f"rollout engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs "
                               f"(episode {episode.index}, turn {episode.num_turns + 1})")
        episode.response_ids += output_ids
        episode.action_mask += [1] * len(output_ids)
        episode.logprobs += logprobs
        episode.routes = (result.routed_experts if episode.num_turns == 0
                          else continue_routes(episode.routes, result.routed_experts))
        episode.num_turns += 1
        episode.last_finish = result.finish_reason
        episode.action_text = self.tokenizer.decode(output_ids, skip_special_tokens=True)

    async def _step(self, episode: _Episode, stats: _RunStats) -> None:
        stats.num_turns += 1
        states = {
            "observation_text": episode.observation_text,
            "action_text": episode.action_text,
            "label": episode.prompt.label,
            "sampling_params": episode.turn_params,
        }
        try:
            parsed = parse_step_output(await self._agent_call(episode.agent.step, states))
            params = apply_sampling(episode.params, parsed["sampling_params"])
        except Exception as err:  # noqa: BLE001 - any agent failure ends only this episode
            self._fail(episode, "step", err, stats)
            return

        reward = parsed["rewards"]
        episode.reward = reward if self.reward_mode == "last" else episode.reward + reward
        episode.score = parsed["scores"] if parsed["scores"] is not None else episode.reward
        episode.extra_logs = parsed["extra_logs"]
        episode.params = params
        if parsed["done"]:
            episode.end(episode.last_finish or "stop")
            return
        if episode.num_turns >= self.max_turns:
            stats.truncated_max_turns += 1
            episode.end("max_turns", truncated=True)
            return
        feedback = parsed["environment_feedback"]
        try:
            feedback_ids, visual = feedback_tokens(self.vision, self.tokenizer, feedback,
                                                   parsed["environment_images"], episode.prompt, episode.visual)
        except AgentImageError as err:
            self._fail(episode, "step", err, stats)
            return
        remaining = self._remaining(episode)
        if remaining is not None and len(feedback_ids) >= remaining:
            stats.truncated_max_len += 1  # no room for the feedback plus one generated token
            episode.end("max_len", truncated=True)
            return
        episode.observation_text += episode.action_text + feedback
        episode.response_ids += feedback_ids
        episode.action_mask += [0] * len(feedback_ids)
        episode.logprobs += [0.0] * len(feedback_ids)
        episode.visual = visual

    def _user_calls(self) -> UserCallRunner:
        """The runner of user code of the ``run`` in progress."""
        if self._runner is None:
            raise RuntimeError("agent code runs only inside MultiTurnAgentExecutor.run")
        return self._runner

    async def _agent_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` off this loop (see ``utils.user_calls``) under ``step_timeout_s``; abandoned on timeout."""
        try:
            return await self._user_calls().call(fn, *args, timeout_s=self.step_timeout_s, **kwargs)
        except UserCallTimeout:
            raise AgentTimeoutError(f"{getattr(fn, '__qualname__', fn)} did not return within "
                                    f"step_timeout_s={self.step_timeout_s}") from None

    def _fail(self, episode: _Episode, phase: str, err: BaseException, stats: _RunStats) -> None:
        timeout = isinstance(err, AgentTimeoutError)
        if timeout:
            stats.agent_timeouts += 1
        else:
            stats.agent_errors += 1
        first = stats.agent_errors + stats.agent_timeouts == 1
        logger.warning(
            "agent %s failed for sample %d (prompt %d, %s row %s) in turn %d: %s: %s",
            phase, episode.index, episode.group_index, episode.prompt.source, episode.prompt.index,
            episode.num_turns, type(err).__name__, err,
            exc_info=(type(err), err, err.__traceback__) if first and not timeout else None)
        episode.failure = "agent_timeout" if timeout else "agent_error"
        episode.error = f"{phase}: {type(err).__name__}: {str(err)[:300]}"
        episode.reward = episode.score = 0.0
        episode.extra_logs = {}
        episode.end(episode.failure)

    def _trajectory(self, episode: _Episode) -> Trajectory:
        mask, logprobs = episode.action_mask, episode.logprobs
        if episode.failure is not None and not self.train_on_failed_episodes:
            mask, logprobs = [0] * len(mask), [0.0] * len(logprobs)
        extra_logs = {
            **episode.extra_logs,
            "num_turns": float(episode.num_turns),
            "agent_error": float(episode.failure is not None),
            "agent_timeout": float(episode.failure == "agent_timeout"),
        }
        trajectory = Trajectory(
            prompt=episode.prompt_text, label=episode.prompt.label, prompt_ids=list(episode.prompt_ids),
            response_ids=list(episode.response_ids), action_mask=list(mask), rollout_logprobs=list(logprobs),
            reward=float(episode.reward), score=float(episode.score), truncated=episode.truncated,
            finish_reason=episode.finish_reason, extra_logs=extra_logs, group_index=episode.group_index,
            failure=episode.error, data_source=source_name(episode.prompt),
            routed_experts=pad_routes(episode.routes, len(episode.prompt_ids) + len(episode.response_ids)),
            visual=episode.visual)
        trajectory.check()
        return trajectory


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
                 max_length: int | None = None, llm_engine: Any = None, hf_tokenizer: Any = None,
                 result_queue: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(agent_instance_cls, hf_tokenizer, max_len=max_length,
                         max_turns=max_steps if max_steps is not None else 8)
        self.max_steps, self.max_length = max_steps, max_length
        self.llm_engine, self.hf_tokenizer, self.result_queue = llm_engine, hf_tokenizer, result_queue


# ---------------------------------------------------------------------- helpers


def _construct_agent(cls: Any, agent_kwargs: dict[str, Any]) -> Any:
    """``cls(**agent_kwargs it accepts)``; for ``async def __init__`` (seen in OpenRLHF examples) a coroutine
    that builds it, which the caller awaits on the user loop. ``cls``: the user's agent class (``Any``: user code
    whose ``__new__`` / ``__init__`` are called as it defines them)."""
    init = cls.__init__
    kwargs = accepted_kwargs(init, agent_kwargs)
    if inspect.iscoroutinefunction(init):
        async def build() -> Any:
            agent = cls.__new__(cls)
            await agent.__init__(**kwargs)
            return agent
        return build()
    return cls(**kwargs)


def _set_if_pending(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)



def _params_key(params: SamplingParams) -> tuple:
    return (params.max_new_tokens, params.temperature, params.top_p, params.top_k,
            tuple(params.stop_token_ids), params.seed)


def _derive_seed(seed: int, episode_index: int, turn: int) -> int:
    digest = hashlib.sha256(f"{seed}:{episode_index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1  # 31 bits: valid for every engine


def _split_results(results: list[GenerationResult], requests: list[GenerationRequest]) -> list[list[GenerationResult]]:
    """Results per request (``request.n`` each), tolerant of engines that return them out of order."""
    expected = sum(request.n for request in requests)
    if len(results) != expected:
        raise RuntimeError(f"rollout engine returned {len(results)} results for {len(requests)} requests "
                           f"({expected} samples)")
    groups: list[list[GenerationResult]] = [[] for _ in requests]
    for result in results:
        if not 0 <= result.request_index < len(requests):
            raise RuntimeError(f"rollout engine returned request_index {result.request_index} "
                               f"outside [0, {len(requests)})")
        groups[result.request_index].append(result)
    for index, (group, request) in enumerate(zip(groups, requests, strict=True)):
        if len(group) != request.n:
            raise RuntimeError(f"rollout engine returned {len(group)} samples for request {index}, "
                               f"expected {request.n}")
    return groups

