"""Agent execution: prompts in, token-level trajectories out.

Every rollout goes through an ``AgentExecutor``. The controller hands it a step's prompts and a
``generate`` callable (the rollout engine group, token in / token out) and gets back one
``Trajectory`` per sample; the training loop only ever sees trajectories. A multi-turn executor
(reset/step environments, tool calls) plugs in by subclassing ``AgentExecutor``: it calls
``generate`` once per turn, appends environment feedback tokens to ``response_ids`` with
``action_mask`` 0 (so they are conditioned on but never trained), and returns the same type.

Rewards: the caller (controller) attaches rewards after the executor returns, with
``score_trajectories`` (a reward function) or a reward model. An executor whose environment
produces the reward itself (multi-turn envs) may set ``Trajectory.reward`` / ``score``; callers
leave already-set rewards as they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_rlhf.data.prompts import Prompt, source_name, tokenize_prompts
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, SamplingParams

GenerateFn = Callable[[list[GenerationRequest]], list[GenerationResult]]

# The source name of a trajectory whose executor did not set ``Trajectory.data_source``.
UNKNOWN_SOURCE = "unknown"


@dataclass
class Trajectory:
    """One sample: a prompt and everything after it, token-level.

    ``response_ids`` holds every token after the prompt: generated tokens and (multi-turn)
    environment feedback. ``action_mask[i]`` is 1 where the model generated token i (trained) and
    0 for feedback. ``rollout_logprobs[i]`` is the engine's sampling logprob of token i (0.0 where
    the mask is 0), used for importance-sampling corrections.
    """

    prompt: str
    label: Any
    prompt_ids: list[int]
    response_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    reward: float | None = None
    score: float | None = None
    truncated: bool = False
    finish_reason: str = ""
    extra_logs: dict = field(default_factory=dict)
    group_index: int = 0  # the prompt's index within the step; samples of one prompt share it
    policy_version: int = 0  # weight syncs the rollout engine had received when this sample started
    token_versions: list[int] | None = None  # per response token, when generation spanned a weight update
    failure: str | None = None  # why user code ended the episode ("step: ValueError: ..."), None if it did not
    # An episode may give several rows (the branches of an OpenAI-client agent's calls): they are consecutive,
    # share the episode's reward and group, and are numbered 0, 1, ... here. Group statistics, filtering and
    # metrics count episodes (``hpc_rlhf.algos.episodes``); every row trains.
    branch_index: int = 0
    # The prompt's data source as evaluation names it (``hpc_rlhf.data.prompts.source_name``: the row's
    # ``data_source`` column, else its file's stem), for the per-source training metrics (``reward/<source>``).
    # Executors set it from the prompt; None (an executor that does not) is reported as ``UNKNOWN_SOURCE``.
    data_source: str | None = None
    # (P + R, L, k) integer tensor: the experts the rollout engine routed each token position to in each MoE layer,
    # when it recorded them (``hpc_rlhf.models.routing_replay``); None otherwise.
    routed_experts: Any = None

    @property
    def num_response_tokens(self) -> int:
        return len(self.response_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def sequence_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def check(self) -> None:
        """Raise ``ValueError`` if the token-level fields disagree (for executor implementers)."""
        n = len(self.response_ids)
        if len(self.action_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory of group {self.group_index}: response_ids has {n} tokens but action_mask has "
                f"{len(self.action_mask)} and rollout_logprobs {len(self.rollout_logprobs)}")
        if any(m not in (0, 1) for m in self.action_mask):
            raise ValueError(f"trajectory of group {self.group_index}: action_mask must hold only 0 and 1")
        if not self.prompt_ids:
            raise ValueError(f"trajectory of group {self.group_index}: empty prompt_ids")
        if self.routed_experts is not None and len(self.routed_experts) != len(self.prompt_ids) + n:
            raise ValueError(f"trajectory of group {self.group_index}: routed_experts covers "
                             f"{len(self.routed_experts)} positions, the sequence has {len(self.prompt_ids) + n}")


class AgentExecutor(ABC):
    """Runs a step's prompts through the policy (and environment) and returns trajectories.

    Contract of ``run``: ``len(prompts) * n_samples_per_prompt`` trajectories, grouped consecutively
    per prompt (trajectory ``i`` answers ``prompts[i // n_samples_per_prompt]`` and has
    ``group_index == i // n_samples_per_prompt``), each passing ``Trajectory.check``. Group
    advantage estimators rely on this order.
    """

    def __init__(self, tokenizer: Any, prompt_max_len: int):
        self.tokenizer = tokenizer
        self.prompt_max_len = prompt_max_len

    def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        return tokenize_prompts(self.tokenizer, [p.text for p in prompts], self.prompt_max_len)

    @abstractmethod
    def run(self, prompts: list[Prompt], generate: GenerateFn, sampling: SamplingParams,
            n_samples_per_prompt: int) -> list[Trajectory]:
        ...

    def close(self) -> None:
        """Stop what the executor serves (the OpenAI-agent endpoint) when training ends; no-op by default."""


def check_samples_per_prompt(n_samples_per_prompt: int) -> None:
    """Every executor's ``run`` refuses ``n_samples_per_prompt < 1`` the same way."""
    if n_samples_per_prompt < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n_samples_per_prompt}")


def group_results(results: Sequence[GenerationResult], num_requests: int, n: int) -> list[list[GenerationResult]]:
    """``n`` results per request, in request order; errors if the engine broke the contract."""
    if len(results) != num_requests * n:
        raise RuntimeError(f"rollout engine returned {len(results)} results for {num_requests} requests x n={n}")
    groups: list[list[GenerationResult]] = [[] for _ in range(num_requests)]
    for result in results:
        if not 0 <= result.request_index < num_requests:
            raise RuntimeError(f"rollout engine returned request_index {result.request_index} "
                               f"outside [0, {num_requests})")
        groups[result.request_index].append(result)
    for index, group in enumerate(groups):
        if len(group) != n:
            raise RuntimeError(f"rollout engine returned {len(group)} samples for request {index}, expected {n}")
    return groups


class SingleTurnExecutor(AgentExecutor):
    """One generation per sample: ``n_samples_per_prompt`` samples per prompt, in one engine call.

    Each prompt becomes one request with ``n = n_samples_per_prompt`` (the engine shares the
    prefix); every response token is an action; a sample is ``truncated`` when the engine stopped
    it for length (``finish_reason == "length"``).
    """

    def run(self, prompts: list[Prompt], generate: GenerateFn, sampling: SamplingParams,
            n_samples_per_prompt: int) -> list[Trajectory]:
        check_samples_per_prompt(n_samples_per_prompt)
        if not prompts:
            return []
        prompt_ids = self.tokenize(prompts)
        requests = [GenerationRequest(prompt_ids=ids, params=sampling, n=n_samples_per_prompt) for ids in prompt_ids]
        groups = group_results(generate(requests), len(requests), n_samples_per_prompt)

        trajectories: list[Trajectory] = []
        for group_index, (prompt, ids, group) in enumerate(zip(prompts, prompt_ids, groups)):
            for result in group:
                output_ids = list(result.output_ids)
                logprobs = [float(x) for x in result.output_logprobs]
                if len(logprobs) != len(output_ids):
                    raise RuntimeError(
                        f"rollout engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs "
                        f"for request {group_index}")
                trajectory = Trajectory(
                    prompt=prompt.text,
                    label=prompt.label,
                    prompt_ids=list(ids),
                    response_ids=output_ids,
                    action_mask=[1] * len(output_ids),
                    rollout_logprobs=logprobs,
                    truncated=result.finish_reason == "length",
                    finish_reason=result.finish_reason,
                    group_index=group_index,
                    data_source=source_name(prompt),
                    routed_experts=result.routed_experts,
                )
                trajectory.check()
                trajectories.append(trajectory)
        return trajectories
