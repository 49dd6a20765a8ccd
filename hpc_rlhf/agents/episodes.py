"""One reset/step agent episode, turn by turn: the state machine behind ``MultiTurnAgentExecutor``.

``MultiTurnAgentExecutor.run`` (one step's episodes, start to end) and ``agents.in_flight.InFlightEpisodes``
(episodes that wait between turns for a weight update) drive episodes through the same calls, so an episode
gets the same tokens, seeds and trajectory whichever of them runs it:

* :func:`new_episodes` makes the ``Episode`` records of a step's prompts (P prompts x n samples, grouped
  per prompt);
* :meth:`EpisodeDriver.start` builds an episode's agent and runs its ``reset``;
* :meth:`EpisodeDriver.generate_round` makes one ``generate`` call holding the next turn of every active
  episode and appends each turn's tokens;
* :meth:`EpisodeDriver.step` runs the agent's ``step`` on the latest turn and appends its feedback, or
  ends the episode;
* :meth:`EpisodeDriver.trajectory` turns a finished episode into its ``Trajectory``.

The caller decides which episodes are active and when a round runs; the budgets, seeds, masks and failure
rules are the ones the ``hpc_rlhf.agents.multi_turn`` module docstring describes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from hpc_rlhf.agents.executor import GenerateFn
from hpc_rlhf.agents.images import AgentImageError, encode_observation, feedback_tokens, refuse_stray_placeholders
from hpc_rlhf.agents.step_output import AgentOutputError, apply_sampling, parse_step_output
from hpc_rlhf.data.prompts import Prompt, source_name, tokenize_prompts
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.routing_replay import continue_routes, pad_routes
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, decode_text
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, SamplingParams, Trajectory
from hpc_rlhf.rollout.placeholder_tokens import PLACEHOLDER_FINISH
from hpc_rlhf.utils.user_calls import UserCallRunner, UserCallTimeout
from hpc_rlhf.utils.user_code import accepted_kwargs

# Agent failures are logged under the executor's module name, so logging configured for it keeps applying.
logger = logging.getLogger("hpc_rlhf.agents.multi_turn")


class AgentTimeoutError(TimeoutError):
    """An agent call ran past ``step_timeout_s``."""


class SampledPlaceholderError(RuntimeError):
    """The rollout engine sampled a vision placeholder token in an episode's turn (``rollout.placeholder_tokens``)."""


@dataclass
class Episode:
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


@dataclass
class RunStats:
    """Counters over the episodes one driver ran (``MultiTurnAgentExecutor.last_run_stats``)."""

    num_episodes: int = 0
    agent_errors: int = 0
    agent_timeouts: int = 0
    generate_calls: int = 0
    num_requests: int = 0
    num_turns: int = 0
    truncated_max_len: int = 0
    truncated_max_turns: int = 0
    max_active: int = 0


class EpisodeSettings(Protocol):
    """What the episode logic reads of its executor (``MultiTurnAgentExecutor`` has all of it)."""

    tokenizer: Tokenizer
    prompt_max_len: int
    max_len: int | None
    max_turns: int
    step_timeout_s: float | None
    reward_mode: str
    train_on_failed_episodes: bool
    agent_instance_cls: type | None
    agent_kwargs: Mapping[str, Any]
    vision: VisionPromptEncoder | None


def new_episodes(prompts: list[Prompt], sampling: SamplingParams, n_samples_per_prompt: int) -> list[Episode]:
    """One episode per sample: episode ``g * n + s`` is sample ``s`` of ``prompts[g]``."""
    return [Episode(index=g * n_samples_per_prompt + s, group_index=g, prompt=prompt, params=sampling)
            for g, prompt in enumerate(prompts) for s in range(n_samples_per_prompt)]


def derive_seed(seed: int, episode_index: int, turn: int) -> int:
    """The sampling seed of an episode's turn (``turn`` 0 is the first), from the step's seed: the n samples of a
    prompt must not share a seed on engines with per-request seeds (vLLM), and a restarted episode gets its
    seeds again."""
    digest = hashlib.sha256(f"{seed}:{episode_index}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1  # 31 bits: valid for every engine


class EpisodeDriver:
    """Moves episodes through their turns under ``settings`` (read at each call), counting into ``stats``.

    Agent code runs on ``calls``, the driver's own ``UserCallRunner``: agent objects keep loop-bound state
    across calls, so one driver serves an episode from start to end; :meth:`close` when its episodes are done.
    """

    def __init__(self, settings: EpisodeSettings, stats: RunStats) -> None:
        self.settings = settings
        self.stats = stats
        self.calls = UserCallRunner()

    def close(self) -> None:
        self.calls.close()

    async def start(self, episode: Episode) -> None:
        """Build the episode's agent and ``reset`` it: sets the prompt (text, ids, images) or fails the episode."""
        settings = self.settings
        try:
            episode.agent = await self._agent_call(
                _construct_agent, settings.agent_instance_cls, dict(settings.agent_kwargs))
            states = {"observation": episode.prompt.text, "label": episode.prompt.label}
            reset = getattr(episode.agent, "reset", None)  # optional for duck-typed agents
            extra = accepted_kwargs(reset, dict(settings.agent_kwargs)) if reset is not None else {}
            result = await self._agent_call(reset, states, **extra) if reset is not None else states
            if not isinstance(result, dict) or not isinstance(result.get("observation"), str):
                raise AgentOutputError(f"reset must return a dict with a str 'observation', got {result!r:.200}")
            # The observation is the agent's text: its image placeholders must match the row's images.
            prompt_ids, visual = self.encode_prompt(episode.prompt, result["observation"])
            refuse_stray_placeholders(prompt_ids, visual, settings.vision, "the reset observation")
            episode.prompt_text = result["observation"]
        except Exception as err:  # noqa: BLE001 - any agent failure ends only this episode
            episode.prompt_text = episode.prompt.text
            episode.prompt_ids, episode.visual = self.encode_prompt(episode.prompt, episode.prompt_text)
            self.fail(episode, "reset", err)
            return
        episode.prompt_ids, episode.visual = prompt_ids, visual
        episode.observation_text = episode.prompt_text

    def encode_prompt(self, prompt: Prompt, text: str) -> tuple[list[int], Any]:
        """(prompt ids, its images or None): a prompt with images goes through the model's processor; the ids are
        cut (from the left) to ``prompt_max_len`` and to ``max_len - 1``."""
        settings = self.settings
        limit = settings.prompt_max_len if settings.max_len is None else min(settings.prompt_max_len,
                                                                              settings.max_len - 1)
        encoded = encode_observation(settings.vision, prompt, text, limit)
        return encoded if encoded is not None else (tokenize_prompts(settings.tokenizer, [text], limit)[0], None)

    def _remaining(self, episode: Episode) -> int | None:
        if self.settings.max_len is None:
            return None
        return self.settings.max_len - len(episode.prompt_ids) - len(episode.response_ids)

    def generate_round(self, active: list[Episode], generate: GenerateFn) -> None:
        """One engine call with the next turn of every active episode; appends the actions."""
        requests: list[GenerationRequest] = []
        members: list[list[Episode]] = []
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
                    params.seed = derive_seed(params.seed, episode.index, episode.num_turns)
                requests.append(GenerationRequest(prompt_ids=sequence, params=params, visual=episode.visual))
                members.append([episode])
            episode.turn_params = params
        for request, group in zip(requests, members, strict=True):
            request.n = len(group)
        self.stats.generate_calls += 1
        self.stats.num_requests += len(requests)
        results = _split_results(generate(requests), requests)
        for group, group_results in zip(members, results, strict=True):
            for episode, result in zip(group, group_results, strict=True):
                self._append_action(episode, result)

    def _append_action(self, episode: Episode, result: GenerationResult) -> None:
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
        episode.action_text = decode_text(self.settings.tokenizer, output_ids, skip_special_tokens=True)
        if result.finish_reason == PLACEHOLDER_FINISH:  # the turn was cut before it (rollout.placeholder_tokens)
            self.fail(episode, "generate", SampledPlaceholderError(
                "the engine sampled a vision placeholder token, which only the image processor may place; the turn "
                "was cut before it and the episode ends here (a later turn's prompt could not carry it)"))
            episode.finish_reason = PLACEHOLDER_FINISH

    async def step(self, episode: Episode) -> None:
        """The agent's ``step`` on the latest turn: takes its reward, then ends the episode (done, out of turns or
        of ``max_len``, failure) or appends its feedback for the next turn. An episode that ended in its turn (a
        sampled placeholder) takes no step."""
        if episode.finished:
            return
        settings, stats = self.settings, self.stats
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
            self.fail(episode, "step", err)
            return

        reward = parsed["rewards"]
        episode.reward = reward if settings.reward_mode == "last" else episode.reward + reward
        episode.score = parsed["scores"] if parsed["scores"] is not None else episode.reward
        episode.extra_logs = parsed["extra_logs"]
        episode.params = params
        if parsed["done"]:
            episode.end(episode.last_finish or "stop")
            return
        if episode.num_turns >= settings.max_turns:
            stats.truncated_max_turns += 1
            episode.end("max_turns", truncated=True)
            return
        feedback = parsed["environment_feedback"]
        try:
            feedback_ids, visual = feedback_tokens(settings.vision, settings.tokenizer, feedback,
                                                   parsed["environment_images"], episode.prompt, episode.visual)
        except AgentImageError as err:
            self.fail(episode, "step", err)
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

    async def _agent_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)`` off this loop (see ``utils.user_calls``) under ``step_timeout_s``; abandoned on timeout."""
        timeout_s = self.settings.step_timeout_s
        try:
            return await self.calls.call(fn, *args, timeout_s=timeout_s, **kwargs)
        except UserCallTimeout:
            raise AgentTimeoutError(f"{getattr(fn, '__qualname__', fn)} did not return within "
                                    f"step_timeout_s={timeout_s}") from None

    def fail(self, episode: Episode, phase: str, err: BaseException) -> None:
        """End ``episode`` as an agent failure in ``phase`` ("reset", "step", "execute"): logged, counted,
        reward 0."""
        stats = self.stats
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

    def trajectory(self, episode: Episode) -> Trajectory:
        """The episode as a checked ``Trajectory``: a failed one's tokens are kept with ``action_mask`` 0 unless
        ``train_on_failed_episodes``; ``extra_logs`` gains ``num_turns``, ``agent_error``, ``agent_timeout``."""
        mask, logprobs = episode.action_mask, episode.logprobs
        if episode.failure is not None and not self.settings.train_on_failed_episodes:
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


def _params_key(params: SamplingParams) -> tuple:
    return (params.max_new_tokens, params.temperature, params.top_p, params.top_k,
            tuple(params.stop_token_ids), params.seed)


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
