"""Reward of the ``colour`` task (``data.synthetic_task: colour``): name the square's colour by its initial.

reward = 1.0 when the response's first character is the label (``r``, ``g``, ``b``, ``y``), + 0.2 when it is one of
the four initials at all (a format term, so a policy starting from random weights gets a signal). ``scores`` is the
correctness alone (what accuracy means).
"""

import torch

INITIALS = "rgby"


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    if responses is None:
        responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    rewards, scores = [], []
    for response, label in zip(responses, labels):
        text = response.strip()
        first = text[:1]
        correct = float(first == str(label))
        rewards.append(correct + 0.2 * float(first != "" and first in INITIALS))
        scores.append(correct)
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(scores),
            "extra_logs": {"accuracy": torch.tensor(scores)}}
