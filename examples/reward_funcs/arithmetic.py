"""Verifiable reward for arithmetic prompts: 1.0 when the last integer in the response equals the label.

Use with prompt rows like ``{"input": "What is 12 + 7?", "label": 19}`` and
``data.label_key=label reward.reward_func_path=examples/reward_funcs/arithmetic.py``.
"""

import re

import torch

_INTEGER = re.compile(r"-?\d[\d,]*")


def last_integer(text):
    """The last integer in ``text`` (thousands separators allowed), or None."""
    matches = _INTEGER.findall(text)
    if not matches:
        return None
    return int(matches[-1].replace(",", ""))


def _response(query, prompt, response):
    if response is not None:
        return response
    # Without the decoded response, strip the prompt from the decoded query (OpenRLHF habit).
    return query[len(prompt):] if query.startswith(prompt) else query


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    rewards, has_answer = [], []
    for i, (query, prompt, label) in enumerate(zip(queries, prompts, labels)):
        if label is None:
            raise ValueError(f"sample {i} has no label: set data.label_key to the column with the answer")
        answer = last_integer(_response(query, prompt, responses[i] if responses is not None else None))
        has_answer.append(float(answer is not None))
        rewards.append(1.0 if answer is not None and answer == float(str(label).strip().replace(",", "")) else 0.0)
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"has_answer": torch.tensor(has_answer)}}
