"""Seeded arithmetic data for the offline CPU recipes and tests (SFT, preference pairs, KTO).

``a+b=`` prompts (operands ``0..max_operand``); the correct sum is the SFT target, the chosen answer of
a pair and a desirable KTO completion; a wrong sum is the rejected answer / an undesirable completion.
Written once per path with an atomic rename under a file lock (safe when every rank calls it).
"""

from __future__ import annotations

import random
from pathlib import Path

from hpc_rlhf.data.synthetic import write_jsonl_if_missing
from hpc_rlhf.data.synthetic_code import code_sft_rows
from hpc_rlhf.data.synthetic_images import colour_sft_rows

TASKS = ("sft_arithmetic", "preference_arithmetic", "kto_arithmetic")


def _wrong_answer(rng: random.Random, a: int, b: int, max_operand: int) -> str:
    right = a + b
    while True:
        wrong = rng.randint(0, 2 * max_operand)
        if wrong != right:
            return str(wrong)


def task_rows(task: str, num_samples: int, seed: int, max_operand: int = 9) -> list[dict[str, str | bool]]:
    if task not in TASKS:
        raise ValueError(f"unknown data.synthetic_task {task!r}; known: {', '.join(TASKS)}")
    rng = random.Random(seed)
    rows: list[dict[str, str | bool]] = []
    for i in range(num_samples):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        prompt, right = f"{a}+{b}=", str(a + b)
        if task == "sft_arithmetic":
            rows.append({"input": prompt, "output": right})
        elif task == "preference_arithmetic":
            rows.append({"prompt": prompt, "chosen": right, "rejected": _wrong_answer(rng, a, b, max_operand)})
        else:
            desirable = i % 2 == 0  # balanced labels
            answer = right if desirable else _wrong_answer(rng, a, b, max_operand)
            rows.append({"prompt": prompt, "completion": answer, "label": desirable})
    return rows


def write_supervised_task_if_missing(task: str, path: str | Path, num_samples: int, seed: int,
                                     max_operand: int = 9, held_out: bool = False) -> Path:
    """``held_out``: the evaluation file (the code task takes its held-out functions; the others another seed)."""
    if task == "sft_colour":  # images drawn with PIL beside the file (hpc_rlhf.data.synthetic_images)
        return write_jsonl_if_missing(path, lambda: colour_sft_rows(path, num_samples, seed))
    if task == "sft_code":
        return write_jsonl_if_missing(path, lambda: code_sft_rows(num_samples, seed, "heldout" if held_out else "sft"))
    return write_jsonl_if_missing(path, lambda: task_rows(task, num_samples, seed, max_operand))


def prepare_supervised_assets(cfg) -> None:
    """Build the tiny model and write the synthetic train / eval files a CPU recipe asks for (once)."""
    if cfg.model.build_tiny:
        # torch: here, not at the top, so that cli/startup (torch-free until the preemption guard is up) can
        # import this module.
        from hpc_rlhf.models.tiny import build_tiny_for

        build_tiny_for(cfg.model.pretrain, cfg.model.build_tiny, seed=cfg.train.seed)
    data = cfg.data
    if data.synthetic_task:
        write_supervised_task_if_missing(data.synthetic_task, data.train_data[0], data.synthetic_num_samples,
                                         cfg.train.seed, data.synthetic_max_operand)
        if data.eval_data:
            # A different seed: held-out rows (with single digits the (a, b) pairs themselves repeat).
            write_supervised_task_if_missing(data.synthetic_task, data.eval_data[0], data.synthetic_eval_samples,
                                             cfg.train.seed + 10_000, data.synthetic_max_operand, held_out=True)
