"""Reward of the ``colour`` task (``data.synthetic_task: colour``): name the square's colour by its initial.

reward = score = 1.0 when the response's first character is the label (``r``, ``g``, ``b``, ``y``), else 0. No
format term: on this task a bonus for answering any initial teaches one constant answer (the policy collapses onto
an initial before it reads the image; tried with 0.2 and 0.02, held-out accuracy then stays at one colour's share).
"""

import torch


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    if responses is None:
        responses = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts, strict=True)]
    scores = [float(response.strip()[:1] == str(label)) for response, label in zip(responses, labels, strict=True)]
    return {"rewards": torch.tensor(scores), "scores": torch.tensor(scores),
            "extra_logs": {"accuracy": torch.tensor(scores)}}
