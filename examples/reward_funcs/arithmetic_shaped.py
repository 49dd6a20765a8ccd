"""Arithmetic reward with a format term, so a policy starting from random weights gets a signal.

reward = 1.0 if the response is exactly the answer (e.g. "7" for "3+4=") + 0.5 x the fraction of
response characters that are digits. ``scores`` is the correctness alone (what accuracy means).
"""

import torch


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    if responses is None:
        responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    rewards, scores = [], []
    for response, label in zip(responses, labels):
        text = response.strip()
        correct = float(text == str(label))
        digits = sum(ch.isdigit() for ch in response) / max(len(response), 1)
        rewards.append(correct + 0.5 * digits)
        scores.append(correct)
    return {"rewards": torch.tensor(rewards), "scores": torch.tensor(scores),
            "extra_logs": {"accuracy": torch.tensor(scores)}}
