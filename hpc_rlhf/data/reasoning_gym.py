"""Prompts and rewards from the procedurally generated tasks of ``reasoning-gym`` (``data.reasoning_gym``).

``reasoning-gym`` (Apache-2.0; optional extra ``tasks``) generates seeded, verifiable task instances offline:
``create_dataset(task, size=N, seed=S)[i]`` is ``{"question", "answer", "metadata"}`` and the dataset's
``score_answer(answer, entry)`` scores a response in [0, 1]. A prompt's label is ``{"task", "size", "seed",
"index"}``, enough to rebuild its entry, so the label stays small and JSON (rollout dumps, checkpoints) and the
reward function scores with the task's own ``score_answer``. Imported only when a run uses it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

INSTALL_HINT = "pip install 'hpc-rlhf[tasks]' (or pip install reasoning-gym)"


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"data.reasoning_gym needs the reasoning-gym package: {INSTALL_HINT}") from err
    return reasoning_gym


@lru_cache(maxsize=8)
def task_dataset(task: str, size: int, seed: int) -> Any:
    """The generated dataset (cached: the reward function asks for the same one at every step)."""
    rg = _import()
    try:
        return rg.create_dataset(task, size=size, seed=seed)
    except Exception as err:  # unknown names and bad task arguments raise several types
        raise ValueError(f"data.reasoning_gym.task={task!r}: reasoning-gym cannot create it ({err})") from err


def write_prompt_file(task: str, size: int, seed: int, folder: str | Path) -> Path:
    """Write the task's questions as ``{"question", "label", "data_source"}`` rows to a jsonl in ``folder`` (the
    prompt loaders, templates and mixtures then apply as to any prompt file); returns its path."""
    dataset = task_dataset(task, size, seed)
    path = Path(folder) / f"reasoning_gym_{task}_{size}_{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"question": dataset[i]["question"], "data_source": task,
             "label": {"task": task, "size": size, "seed": seed, "index": i}} for i in range(len(dataset))]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def reasoning_gym_reward(queries: list[str], prompts: list[str], labels: list[Any],
                         responses: list[str] | None = None, **_: Any) -> dict[str, Any]:
    """OpenRLHF-format reward: each response scored by its task's ``score_answer`` (reward = score, in [0, 1]).

    ``labels``: the ``{"task", "size", "seed", "index"}`` dicts written by :func:`write_prompt_file`.
    """
    if responses is None:
        responses = [q.removeprefix(p) for q, p in zip(queries, prompts, strict=True)]
    scores = []
    for response, label in zip(responses, labels, strict=True):
        if not isinstance(label, dict) or not {"task", "size", "seed", "index"} <= set(label):
            raise ValueError(f"reasoning-gym reward: label {label!r:.120} is not a data.reasoning_gym label "
                             "({task, size, seed, index}); use it with data.reasoning_gym prompts only")
        dataset = task_dataset(label["task"], label["size"], label["seed"])
        scores.append(float(dataset.score_answer(response.strip(), dataset[label["index"]])))
    tensor = torch.tensor(scores, dtype=torch.float32)
    return {"rewards": tensor, "scores": tensor.clone()}
