"""Attach rewards to trajectories with a reward function, OpenRLHF style."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.rewards.functions import RewardFunction, RewardOutput, validate_reward_output
from hpc_rlhf.rollout.base import Trajectory
from hpc_rlhf.utils.user_code import accepted_kwargs


def score_trajectories(trajectories: Sequence[Trajectory], reward_fn: Callable[..., Any], tokenizer: Tokenizer,
                       **kwargs: Any) -> RewardOutput:
    """Score trajectories and write ``reward``, ``score`` and ``extra_logs`` onto each.

    The reward function (a ``RewardFunction`` or any callable in the OpenRLHF format) gets:

    * ``queries``: prompt + response decoded together, special tokens kept (as OpenRLHF);
    * ``prompts``: the prompt texts (``Trajectory.prompt``);
    * ``labels``: the dataset labels;
    * ``responses`` (keyword, passed only if the function accepts it): the response alone, decoded
      with special tokens skipped, which spares users slicing ``query[len(prompt):]``.

    Trajectories whose ``reward`` an executor already set (multi-turn environments) are not re-scored;
    when all are set the function is not called. Returns the rewards of all trajectories, in order
    (``extra_logs`` keeps the numeric names every trajectory has).
    """
    todo = [i for i, t in enumerate(trajectories) if t.reward is None]
    if todo:
        chosen = [trajectories[i] for i in todo]
        queries = tokenizer.batch_decode([t.prompt_ids + t.response_ids for t in chosen], skip_special_tokens=False)
        responses = tokenizer.batch_decode([t.response_ids for t in chosen], skip_special_tokens=True)
        prompts = [t.prompt for t in chosen]
        labels = [t.label for t in chosen]
        offered = {"responses": responses, **kwargs}
        if not isinstance(reward_fn, RewardFunction):  # RewardFunction filters by itself
            offered = accepted_kwargs(reward_fn, offered)
        output = reward_fn(queries, prompts, labels, **offered)
        if not isinstance(output, RewardOutput):  # a bare OpenRLHF-style function
            output = validate_reward_output(output, len(chosen), getattr(reward_fn, "__name__", repr(reward_fn)))
        for row, trajectory in enumerate(chosen):
            trajectory.reward = float(output.rewards[row])
            trajectory.score = float(output.scores[row])
            for name, values in output.extra_logs.items():
                trajectory.extra_logs[name] = float(values[row])

    # Every trajectory has a reward now: set above, or by its executor.
    reward_values = [t.reward for t in trajectories if t.reward is not None]
    assert len(reward_values) == len(trajectories)
    rewards = torch.tensor(reward_values, dtype=torch.float32)
    scores = torch.tensor([t.score if t.score is not None else r for t, r in zip(trajectories, reward_values,
                                                                              strict=True)], dtype=torch.float32)
    # Only logs every trajectory has, so a per-name mean never mixes in missing samples.
    names = [name for name, v in trajectories[0].extra_logs.items() if _is_number(v)] if trajectories else []
    names = [name for name in names if all(_is_number(t.extra_logs.get(name)) for t in trajectories)]
    extra_logs = {
        name: torch.tensor([float(t.extra_logs[name]) for t in trajectories], dtype=torch.float32) for name in names
    }
    return RewardOutput(rewards=rewards, scores=scores, extra_logs=extra_logs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
