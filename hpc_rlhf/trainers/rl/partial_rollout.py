"""Partial rollouts: a batch's generation is split around a weight update and keeps its tokens.

The rollout engine generates the first ``chunk_tokens`` of every sample of a new batch, the weights
are updated, and generation then continues from exactly the tokens already produced (prompt + partial
response as the new prompt, no re-tokenisation). Each response token records the policy version that
produced it, and its logprob is the one the engine sampled it with, so importance-sampling
corrections see the true behaviour policy of every token.

Runs on the rollout ranks (each on its own engine's in-flight samples).
"""

from __future__ import annotations

from dataclasses import replace

from hpc_rlhf.agents.executor import GenerateFn
from hpc_rlhf.models.routing_replay import continue_routes
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams, Trajectory


def stamp_versions(trajectories: list[Trajectory], version: int) -> None:
    """Mark every response token of freshly generated samples with ``version``."""
    for t in trajectories:
        t.policy_version = version
        t.token_versions = [version] * len(t.response_ids)


def unfinished(t: Trajectory, max_new_tokens: int) -> bool:
    return t.finish_reason == "length" and len(t.response_ids) < max_new_tokens


def continue_generation(trajectories: list[Trajectory], generate: GenerateFn, sampling: SamplingParams, version: int,
                        max_new_tokens: int) -> list[Trajectory]:
    """Finish the samples a chunk limit cut off, with the current weights; the others pass through.

    Returns new trajectories in the same order (grouping is unchanged).
    """
    todo = [i for i, t in enumerate(trajectories) if unfinished(t, max_new_tokens)]
    if not todo:
        return trajectories
    requests = [GenerationRequest(
        prompt_ids=trajectories[i].prompt_ids + trajectories[i].response_ids,
        params=replace(sampling, max_new_tokens=max_new_tokens - len(trajectories[i].response_ids)), n=1)
        for i in todo]
    results = sorted(generate(requests), key=lambda r: r.request_index)
    out = list(trajectories)
    for i, result in zip(todo, results, strict=True):
        t = trajectories[i]
        new_ids = list(result.output_ids)
        out[i] = replace(
            t, response_ids=t.response_ids + new_ids, action_mask=t.action_mask + [1] * len(new_ids),
            rollout_logprobs=t.rollout_logprobs + [float(x) for x in result.output_logprobs],
            token_versions=(t.token_versions or [t.policy_version] * len(t.response_ids)) + [version] * len(new_ids),
            finish_reason=result.finish_reason, truncated=result.finish_reason == "length",
            routed_experts=continue_routes(t.routed_experts, result.routed_experts),
        )
    return out
