"""Seeded, verifiable toy tasks written as prompt files, for CPU recipes, tests and the quickstart."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from hpc_rlhf.data.synthetic_code import code_prompt_rows
from hpc_rlhf.data.synthetic_images import colour_task_rows  # imports PIL only when it draws (the visual task)


def arithmetic_rows(num_samples: int, seed: int, max_operand: int = 9) -> list[dict[str, str]]:
    """``{"input": "3+4=", "label": "7"}`` rows: single-digit addition, answers 0-18."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"input": f"{a}+{b}=", "label": str(a + b)})
    return rows


def write_jsonl_if_missing(path: str | Path, make_rows: Callable[[], list[dict]]) -> Path:
    """Write ``make_rows()`` to ``path`` as JSON lines unless the file exists (atomic rename under a file lock:
    safe when several ranks call at the same time; one of them writes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return path
        rows = make_rows()
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)
    return path


def write_task_if_missing(task: str, path: str | Path, num_samples: int, seed: int) -> Path:
    """Create the jsonl once (see :func:`write_jsonl_if_missing`)."""

    def make_rows() -> list[dict]:
        if task == "colour":
            return colour_task_rows(path, num_samples, seed)
        if task == "code":
            return code_prompt_rows(num_samples, seed, "rl")
        if task in ("code_heldout", "code_rl_eval"):  # eval.data: functions no stage trains on / GRPO's, each once
            return code_prompt_rows(num_samples, seed, "heldout" if task == "code_heldout" else "rl", each_once=True)
        if task != "arithmetic":
            raise ValueError(f"unknown data.synthetic_task {task!r}; known: arithmetic, colour, code")
        return arithmetic_rows(num_samples, seed)

    return write_jsonl_if_missing(path, make_rows)
