"""Held-out accuracy over the SFT -> GRPO recipe of docs/vlm.md (and GRPO from the random model), like the
quickstart's plot.

    python benchmarks/vlm_recipe_plot.py --after-sft runs/grpo_vlm_after_sft --grpo-only runs/grpo_vlm_tiny_cpu \\
        --out runs/vlm_recipe.png

Reads each run's ``metrics.jsonl`` (``eval/heldout/pass@1``; the reward of the run after SFT, smoothed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METRIC = "eval/heldout/pass@1"


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--after-sft", required=True, help="output_dir of the GRPO run started from the SFT export")
    p.add_argument("--grpo-only", help="output_dir of the GRPO run from the random model")
    p.add_argument("--out", default="runs/vlm_recipe.png")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = _rows(Path(args.after_sft))
    trained = [r for r in rows if "reward" in r]
    window = 5
    smooth = [sum(r["reward"] for r in trained[max(0, i - window + 1): i + 1]) / len(trained[max(0, i - window + 1):
                                                                                               i + 1])
              for i in range(len(trained))]
    ax.plot([r["step"] for r in trained], smooth, alpha=0.5, label=f"reward after SFT, {window}-step mean")
    evals = [r for r in rows if METRIC in r]
    ax.plot([r["step"] for r in evals], [r[METRIC] for r in evals], marker="o",
            label="held-out greedy accuracy, SFT then GRPO (step 0 = after SFT)")
    if args.grpo_only:
        base = [r for r in _rows(Path(args.grpo_only)) if METRIC in r]
        ax.plot([r["step"] for r in base], [r[METRIC] for r in base], marker="s", linestyle="--",
                label="held-out greedy accuracy, GRPO from the random model")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.05)
    ax.set_title("tiny Qwen2.5-VL, colour task: SFT (4 steps) then GRPO, 2 CPU ranks")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
