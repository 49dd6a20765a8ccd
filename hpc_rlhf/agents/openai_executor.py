"""Agents written against the OpenAI API, trained as they are: episodes -> trajectories.

An agent file (``train.agent_func_path``) defines a function::

    async def run_episode(client, prompt, label, **agent_kwargs):
        reply = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
        return 1.0 if reply.choices[0].message.content.strip() == label else 0.0

or a workflow class, AReaL's ``RolloutWorkflow`` shape with the client in the place of AReaL's engine,
built once per rollout rank as ``MyWorkflow(**agent_kwargs)``::

    class MyWorkflow:
        def __init__(self, temperature=1.0): ...
        async def arun_episode(self, client, data):   # data: {"prompt", "label", "messages"}
            ...
            return reward

``client`` is an ``openai.AsyncOpenAI`` pointed at this rank's endpoint (``openai_endpoint``), its API key the
episode id; ``agent_kwargs`` are ``train.agent_kwargs`` (the names the function / constructor accepts). Return
the reward (a number), a dict ``{"reward": float, "score": float, "extra_logs": {name: number}}``, or None to
let the configured reward function / reward model score the trajectory.

Each of the step's ``len(prompts) * n_samples_per_prompt`` episodes runs once; at most ``num_concurrent`` at a
time, each on its own event loop in its own daemon thread, while the calling thread - the one that owns the
engine - batches their requests into ``generate`` calls. An episode that blocks its thread (``time.sleep`` or a
blocking HTTP call inside ``async def``) so delays only itself: the engine thread keeps serving the others and
ends it at ``episode_timeout_s`` as that episode's timeout; a thread that never returns is abandoned (it is a
daemon, so it never keeps the process alive). Objects an agent creates are bound to its episode's loop: a
workflow object shared by all episodes must not keep loop-bound state (an ``asyncio.Lock``, an aiohttp session)
from one episode to the next. When an episode ends, its recorded calls become its
training rows (``openai_recording.episode_sequences``): one per linear chain of calls (branch), with the
model's tokens at ``action_mask`` 1 and everything between calls at 0. A linear chat is one row; an ``n > 1``
call whose choices are continued, or a call that does not extend an earlier prompt + output, starts another
branch. The rows of an episode are consecutive, numbered by ``Trajectory.branch_index``, and share the
episode's reward and extra logs (as AReaL does); group statistics count the episode once
(``hpc_rlhf.algos.episodes``).

Failures (an exception, no model call at all, a request the engine failed on (``openai_endpoint``), or running
past ``episode_timeout_s``) end only that episode:
reward 0.0, ``finish_reason`` ``"agent_error"`` / ``"agent_timeout"``, the tokens kept with ``action_mask`` 0, and
``Trajectory.failure`` set, so the trainer's failure bound (``train.max_agent_failure_fraction``) applies. A
timed-out episode is abandoned, never joined, and its later requests are refused.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import logging
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hpc_rlhf.agents.endpoint_limits import EndpointLimits
from hpc_rlhf.agents.executor import AgentExecutor, GenerateFn, check_samples_per_prompt
from hpc_rlhf.agents.openai_endpoint import OpenAIEndpoint, run_batch
from hpc_rlhf.agents.openai_images import row_visual
from hpc_rlhf.agents.openai_recording import CompletionRecord, TokenSequence, episode_sequences
from hpc_rlhf.agents.tool_parsers import OutputParser
from hpc_rlhf.data.prompts import Prompt, source_name
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, decode_text, eos_id
from hpc_rlhf.rollout.base import SamplingParams, Trajectory
from hpc_rlhf.rollout.placeholder_tokens import PLACEHOLDER_FINISH
from hpc_rlhf.utils.user_calls import run_to_completion
from hpc_rlhf.utils.user_code import accepted_kwargs

logger = logging.getLogger(__name__)

_POLL_S = 0.02  # how often the engine thread checks deadlines while no request is queued


def import_openai() -> Any:
    try:
        import openai
    except ImportError as err:
        raise ImportError("OpenAI-client agents need the `openai` package: pip install 'hpc-rlhf[agents]' "
                          "(or pip install openai)") from err
    return openai


@dataclass
class _Episode:
    index: int
    group_index: int
    prompt: Prompt
    episode_id: str
    started: float | None = None  # monotonic time the agent began (None while it waits for a slot)
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    engine_failure: str | None = None  # the engine failed on one of its requests (EpisodeRecorder.fail)
    records: list[CompletionRecord] = field(default_factory=list)


def episode_data(prompt: Prompt) -> dict[str, Any]:
    """What a workflow's ``arun_episode(client, data)`` receives: the prompt text, its label, and the prompt as
    one user message (AReaL's data rows carry ``messages``)."""
    return {"prompt": prompt.text, "label": prompt.label, "messages": [{"role": "user", "content": prompt.text}],
            "data_source": prompt.data_source}


def is_workflow(agent: Any) -> bool:
    """Whether ``agent`` (an object or a class) has an ``async def arun_episode`` method."""
    return inspect.iscoroutinefunction(getattr(agent, "arun_episode", None))


class OpenAIAgentExecutor(AgentExecutor):
    """Runs OpenAI-client agents against this rank's OpenAI-compatible endpoint (see the module docstring).

    Args:
        run_episode: ``async def run_episode(client, prompt, label, **agent_kwargs)``, or a workflow object
            with ``async def arun_episode(self, client, data)`` (built by the caller; ``agent_kwargs`` then
            went to its constructor and are not passed again).
        tokenizer: as every executor.
        prompt_max_len: as every executor.
        max_len: prompt + output budget of every call (``data.max_len``).
        num_concurrent: episodes alive at once.
        episode_timeout_s: wall time limit of one episode (None: none).
        agent_kwargs: extra keyword arguments for ``run_episode`` (those its signature accepts).
        batch_wait_s: how long a generate batch waits for running episodes without a queued request.
        model_name: the name the endpoint's ``/v1/models`` reports (any ``model`` value is accepted).
        tool_call_parser: the endpoint's tool-call parser (``rollout.tool_call_parser``, see ``tool_parsers``);
            an unknown name raises ``ParserConfigError`` here.
        reasoning_parser: the endpoint's reasoning parser (``rollout.reasoning_parser``, see ``tool_parsers``);
            an unknown name raises ``ParserConfigError`` here.
        endpoint_listen: where the endpoint listens (``rollout.agent_endpoint``): ``"unix"`` (a private Unix
            socket, the default) or ``"tcp"`` (``127.0.0.1``, for frameworks that take only a URL).
        limits: the endpoint's caps on images and connections (``endpoint_limits``; the run's setup sets
            ``executor.limits`` from the ``rollout.agent_*`` keys); None: the defaults.
    """

    def __init__(self, run_episode: Any, tokenizer: Tokenizer, prompt_max_len: int, *, max_len: int | None = None,
                 num_concurrent: int = 64, episode_timeout_s: float | None = 600.0,
                 agent_kwargs: dict[str, Any] | None = None, batch_wait_s: float = 0.05,
                 model_name: str = "policy", tool_call_parser: str = "auto",
                 reasoning_parser: str = "auto", endpoint_listen: str = "unix",
                 limits: EndpointLimits | None = None) -> None:
        super().__init__(tokenizer, prompt_max_len)
        if inspect.isclass(run_episode):
            raise ValueError(f"pass an instance of the workflow class {run_episode.__name__}, not the class")
        if not (inspect.iscoroutinefunction(run_episode) or is_workflow(run_episode)):
            raise ValueError("run_episode must be an `async def` function or an object with `async def "
                             f"arun_episode(self, client, data)`, got {run_episode!r:.100}")
        if num_concurrent < 1:
            raise ValueError(f"num_concurrent must be >= 1, got {num_concurrent}")
        if episode_timeout_s is not None and not episode_timeout_s > 0:
            raise ValueError(f"episode_timeout_s must be > 0 or None, got {episode_timeout_s}")
        self.run_episode = run_episode
        self.max_len, self.num_concurrent, self.episode_timeout_s = max_len, num_concurrent, episode_timeout_s
        self.agent_kwargs = {} if is_workflow(run_episode) else accepted_kwargs(run_episode, dict(agent_kwargs or {}))
        self.batch_wait_s, self.model_name = batch_wait_s, model_name
        if endpoint_listen not in ("unix", "tcp"):
            raise ValueError(f"endpoint_listen must be 'unix' or 'tcp', got {endpoint_listen!r}")
        self.endpoint_listen = endpoint_listen
        self.limits = limits if limits is not None else EndpointLimits()
        # The rollout engine's context length (RolloutEngine.max_context_len), set by whoever pairs the executor
        # with its engine before the first run: the endpoint refuses a call past it as that call's 400.
        self.context_len: int | None = None
        self.parser = OutputParser(tokenizer, tool_call_parser, reasoning_parser)  # a bad name fails at load time
        self.endpoint: OpenAIEndpoint | None = None
        self.last_run_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ lifecycle

    def start_endpoint(self) -> OpenAIEndpoint:
        """Start the endpoint once (the first ``run`` does it); it serves until :meth:`close` or exit."""
        if self.endpoint is None:
            import_openai()  # fail before serving when the client package is missing
            self.endpoint = OpenAIEndpoint(self.tokenizer, self.max_len, self.model_name,
                                           self.batch_wait_s, self.parser, vision=self.vision,
                                           context_len=self.context_len, listen=self.endpoint_listen,
                                           **dataclasses.asdict(self.limits)).start()
            atexit.register(self.close)
        return self.endpoint

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    # ------------------------------------------------------------------ the contract

    def run(self, prompts: list[Prompt], generate: GenerateFn, sampling: SamplingParams,
            n_samples_per_prompt: int) -> list[Trajectory]:
        check_samples_per_prompt(n_samples_per_prompt)
        if not prompts:
            return []
        with_images = next((p for p in prompts if p.images), None)
        if with_images is not None:
            raise ValueError(f"{with_images.source} row {with_images.index} has images, which an OpenAI-client agent "
                             "does not receive: its agent sends the images it shows in its chat messages (base64 "
                             "data URLs, docs/agents_openai.md); use prompt rows without images")
        endpoint = self.start_endpoint()
        endpoint.set_defaults(sampling)
        episodes = [_Episode(index=g * n_samples_per_prompt + s, group_index=g, prompt=prompt,
                             episode_id=f"episode-{uuid.uuid4().hex}")
                    for g, prompt in enumerate(prompts) for s in range(n_samples_per_prompt)]
        for episode in episodes:
            endpoint.recorder.open(episode.episode_id)
        try:
            self._drive(episodes, endpoint, generate)
        finally:
            for episode in episodes:
                if not episode.timed_out:
                    episode.engine_failure = endpoint.recorder.failure(episode.episode_id)
                    episode.records = endpoint.recorder.close(episode.episode_id)
        trajectories = [row for episode in episodes for row in self._trajectories(episode)]
        self._stats(episodes, trajectories)
        return trajectories

    def _drive(self, episodes: list[_Episode], endpoint: OpenAIEndpoint, generate: GenerateFn) -> None:
        """The engine thread: start episodes (``num_concurrent`` at a time), end those past their time, and batch
        queued requests into ``generate`` until every episode ended or timed out."""
        waiting, running = deque(episodes), list[_Episode]()
        while waiting or running:
            now = time.monotonic()
            for episode in running:
                if (not episode.done.is_set() and episode.started is not None and self.episode_timeout_s
                        and now - episode.started > self.episode_timeout_s):
                    episode.timed_out = True  # its later requests get 401: nothing more is generated for it
                    episode.records = endpoint.recorder.close(episode.episode_id)
            running = [e for e in running if not (e.done.is_set() or e.timed_out)]
            while waiting and len(running) < self.num_concurrent:
                episode = waiting.popleft()
                self._start(episode, endpoint)
                running.append(episode)
            run_batch(endpoint.queue.take({e.episode_id for e in running}, _POLL_S, self.batch_wait_s), generate)

    def _start(self, episode: _Episode, endpoint: OpenAIEndpoint) -> None:
        """Run ``episode`` on a fresh event loop in a daemon thread of its own (module docstring)."""
        episode.started = time.monotonic()
        threading.Thread(target=run_to_completion, args=(lambda: self._run_episode(episode, endpoint),),
                         name=f"hpc_rlhf_agent:{episode.index}", daemon=True).start()

    async def _run_episode(self, episode: _Episode, endpoint: OpenAIEndpoint) -> None:
        try:
            import_openai()
            # Through the endpoint's Unix socket (or its TCP port), with no retries (openai_endpoint).
            client = endpoint.async_client(episode.episode_id, self.episode_timeout_s)
        except BaseException as err:  # noqa: BLE001 - reported as this episode's failure
            episode.error = err
            episode.done.set()
            return
        try:
            episode.result = await self._run_one(client, episode.prompt)
        except BaseException as err:  # noqa: BLE001 - any agent failure ends only this episode
            episode.error = err
        finally:
            episode.done.set()
            with contextlib.suppress(Exception):  # closing a client must not turn a result into a failure
                await client.close()

    def _run_one(self, client: Any, prompt: Prompt) -> Any:
        """The agent's coroutine for one episode, whichever shape it has."""
        if is_workflow(self.run_episode):
            return self.run_episode.arun_episode(client, episode_data(prompt))
        return self.run_episode(client, prompt.text, prompt.label, **self.agent_kwargs)

    # ------------------------------------------------------------------ trajectories

    def _outcome(self, episode: _Episode) -> tuple[float | None, float | None, dict, str | None]:
        """(reward, score, extra_logs, failure message) from what ``run_episode`` returned."""
        if episode.timed_out:
            return 0.0, 0.0, {}, f"episode: did not finish within episode_timeout_s={self.episode_timeout_s}"
        if episode.engine_failure is not None:
            return 0.0, 0.0, {}, episode.engine_failure
        if episode.error is not None:
            err = episode.error
            return 0.0, 0.0, {}, f"run_episode: {type(err).__name__}: {str(err)[:300]}"
        if not episode.records:
            return 0.0, 0.0, {}, "run_episode: made no model call (nothing to train)"
        if any(record.finish_reason == PLACEHOLDER_FINISH for record in episode.records):
            return 0.0, 0.0, {}, ("generate: the engine sampled a vision placeholder token "
                                  "(rollout.placeholder_tokens); the call's completion was cut before it and the "
                                  "episode fails alone")
        result = episode.result
        if result is None:
            return None, None, {}, None
        extra: dict = {}
        score = None
        if isinstance(result, dict):
            if "reward" not in result:
                return 0.0, 0.0, {}, f"run_episode: returned a dict without 'reward' (keys {sorted(result)})"
            extra = {k: float(v) for k, v in (result.get("extra_logs") or {}).items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
            score = result.get("score", result.get("scores"))
            result = result["reward"]
        try:
            reward = float(result)
            score = reward if score is None else float(score)
        except (TypeError, ValueError):
            return 0.0, 0.0, {}, f"run_episode: returned {result!r:.100}, not a number (the reward)"
        if not (math.isfinite(reward) and math.isfinite(score)):
            return 0.0, 0.0, {}, f"run_episode: returned a non-finite reward {reward} / score {score}"
        return reward, score, extra, None

    def _trajectories(self, episode: _Episode) -> list[Trajectory]:
        """The episode's rows: one per branch (linear chain of calls), all with the episode's reward. A failed
        episode gives one row, its last call's branch, with every token masked (nothing of it trains)."""
        reward, score, extra, failure = self._outcome(episode)
        sequences = episode_sequences(episode.records)
        if failure is not None and sequences:
            last_call = max(r.call_index for r in episode.records)
            sequences = [next(s for s in sequences if last_call in s.calls)]
        if not sequences:  # no call: one masked eos keeps the row well formed
            eos = eos_id(self.tokenizer)
            sequences = [TokenSequence(prompt_ids=self.tokenize([episode.prompt])[0], response_ids=[eos],
                                       action_mask=[0], logprobs=[0.0])]
        num_calls = len(episode.records)
        extra_logs = {**extra, "num_turns": float(sum(len(s.calls) for s in sequences)),
                      "num_calls": float(num_calls), "num_branches": float(len(sequences)),
                      "agent_error": float(failure is not None), "agent_timeout": float(episode.timed_out)}
        rows = []
        for branch, sequence in enumerate(sequences):
            mask, logprobs, finish = sequence.action_mask, sequence.logprobs, sequence.finish_reason
            if failure is not None:
                mask, logprobs = [0] * len(mask), [0.0] * len(logprobs)
                finish = "agent_timeout" if episode.timed_out else "agent_error"
            row = Trajectory(
                prompt=decode_text(self.tokenizer, sequence.prompt_ids), label=episode.prompt.label,
                prompt_ids=list(sequence.prompt_ids), response_ids=list(sequence.response_ids),
                action_mask=list(mask), rollout_logprobs=list(logprobs), reward=reward, score=score,
                truncated=finish == "length", finish_reason=finish, extra_logs=dict(extra_logs),
                group_index=episode.group_index, failure=failure, branch_index=branch,
                data_source=source_name(episode.prompt), visual=row_visual(sequence.visual))
            row.check()
            rows.append(row)
        return rows

    def _stats(self, episodes: list[_Episode], trajectories: list[Trajectory]) -> None:
        errors = sum(t.finish_reason == "agent_error" for t in trajectories)
        timeouts = sum(t.finish_reason == "agent_timeout" for t in trajectories)
        self.last_run_stats = {"num_episodes": len(episodes), "agent_errors": errors, "agent_timeouts": timeouts,
                               "num_calls": sum(len(e.records) for e in episodes)}
        if errors or timeouts:
            first = next(t for t in trajectories if t.failure)
            logger.warning("OpenAI-agent rollout: %d of %d episodes failed (%d errors, %d timeouts); first: %s",
                           errors + timeouts, len(episodes), errors, timeouts, first.failure)


