"""Seeded, verifiable toy tasks written as prompt files, for CPU recipes, tests and the quickstart."""

from __future__ import annotations

import json
import random
from pathlib import Path

from filelock import FileLock


def arithmetic_rows(num_samples: int, seed: int, max_operand: int = 9) -> list[dict[str, str]]:
    """``{"input": "3+4=", "label": "7"}`` rows: single-digit addition, answers 0-18."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_samples):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        rows.append({"input": f"{a}+{b}=", "label": str(a + b)})
    return rows


def write_task_if_missing(task: str, path: str | Path, num_samples: int, seed: int) -> Path:
    """Create the jsonl once (atomic rename; safe when several ranks call at the same time)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return path
        if task != "arithmetic":
            raise ValueError(f"unknown data.synthetic_task {task!r}; known: arithmetic")
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(num_samples, seed)))
        tmp.replace(path)
    return path
