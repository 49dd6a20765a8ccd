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

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from hpc_rlhf.data.prompts import Prompt, source_name, tokenize_prompts
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder, encode_prompts
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.rollout.base import GenerationRequest, GenerationResult, SamplingParams, Trajectory
from hpc_rlhf.rollout.placeholder_tokens import PLACEHOLDER_FINISH
from hpc_rlhf.rollout.visual import PromptVisual

GenerateFn = Callable[[list[GenerationRequest]], list[GenerationResult]]


def timed_generate(generate: GenerateFn, record: Callable[[float], None]) -> GenerateFn:
    """``generate`` that hands ``record`` the seconds of every call (the engine's busy time), also of a failed one."""
    def timed(requests: list[GenerationRequest]) -> list[GenerationResult]:
        start = time.perf_counter()
        try:
            return generate(requests)
        finally:
            record(time.perf_counter() - start)
    return timed

# ``Trajectory.failure`` of a sample the engine cut at a vision placeholder token it sampled.
PLACEHOLDER_FAILURE = ("generate: the engine sampled a vision placeholder token (which only the image processor "
                       "may place); the sample was cut before it and fails alone")

# The source name of a trajectory whose executor did not set ``Trajectory.data_source``.
UNKNOWN_SOURCE = "unknown"

# ``Trajectory`` lives with the rollout protocol (``hpc_rlhf.rollout.base``); agent files written before it moved
# import it from here.
__all__ = ["UNKNOWN_SOURCE", "AgentExecutor", "GenerateFn", "SingleTurnExecutor", "Trajectory",
           "check_samples_per_prompt", "group_results"]


class AgentExecutor(ABC):
    """Runs a step's prompts through the policy (and environment) and returns trajectories.

    Contract of ``run``: ``len(prompts) * n_samples_per_prompt`` trajectories, grouped consecutively
    per prompt (trajectory ``i`` answers ``prompts[i // n_samples_per_prompt]`` and has
    ``group_index == i // n_samples_per_prompt``), each passing ``Trajectory.check``. Group
    advantage estimators rely on this order.
    """

    # Set on executors of a vision-language model (``hpc_rlhf.trainers.rl.setup``): encodes prompts with images.
    vision: VisionPromptEncoder | None = None

    def __init__(self, tokenizer: Tokenizer, prompt_max_len: int):
        self.tokenizer = tokenizer
        self.prompt_max_len = prompt_max_len

    def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        return tokenize_prompts(self.tokenizer, [p.text for p in prompts], self.prompt_max_len)

    def encode(self, prompts: Sequence[Prompt]) -> tuple[list[list[int]], list[PromptVisual | None]]:
        """Token ids of each prompt and its images (None for a text prompt), :func:`encode_prompts`."""
        if not any(p.images for p in prompts):
            return self.tokenize(prompts), [None] * len(prompts)
        return encode_prompts(prompts, self.tokenizer, self.prompt_max_len, self.vision)

    @abstractmethod
    def run(self, prompts: list[Prompt], generate: GenerateFn, sampling: SamplingParams,
            n_samples_per_prompt: int) -> list[Trajectory]:
        ...

    def close(self) -> None:  # noqa: B027 - a no-op hook by default, overridden only where something is served
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
    it for length (``finish_reason == "length"``). A sample the engine cut at a sampled vision placeholder
    (``finish_reason == "placeholder"``, ``rollout.placeholder_tokens``) fails alone: reward 0, no action token.
    """

    def run(self, prompts: list[Prompt], generate: GenerateFn, sampling: SamplingParams,
            n_samples_per_prompt: int) -> list[Trajectory]:
        check_samples_per_prompt(n_samples_per_prompt)
        if not prompts:
            return []
        prompt_ids, visuals = self.encode(prompts)
        requests = [GenerationRequest(prompt_ids=ids, params=sampling, n=n_samples_per_prompt, visual=visual)
                    for ids, visual in zip(prompt_ids, visuals, strict=True)]
        groups = group_results(generate(requests), len(requests), n_samples_per_prompt)

        trajectories: list[Trajectory] = []
        for group_index, (prompt, ids, group, visual) in enumerate(zip(prompts, prompt_ids, groups, visuals,
                                                                       strict=True)):
            for result in group:
                output_ids = list(result.output_ids)
                logprobs = [float(x) for x in result.output_logprobs]
                if len(logprobs) != len(output_ids):
                    raise RuntimeError(
                        f"rollout engine returned {len(output_ids)} tokens but {len(logprobs)} logprobs "
                        f"for request {group_index}")
                failed = result.finish_reason == PLACEHOLDER_FINISH
                trajectory = Trajectory(
                    prompt=prompt.text,
                    label=prompt.label,
                    prompt_ids=list(ids),
                    response_ids=output_ids,
                    action_mask=[0 if failed else 1] * len(output_ids),
                    rollout_logprobs=logprobs,
                    truncated=result.finish_reason == "length",
                    finish_reason=result.finish_reason,
                    group_index=group_index,
                    data_source=source_name(prompt),
                    routed_experts=result.routed_experts,
                    visual=visual,
                )
                if failed:
                    trajectory.reward = trajectory.score = 0.0
                    trajectory.failure = PLACEHOLDER_FAILURE
                trajectory.check()
                trajectories.append(trajectory)
        return trajectories
