"""Asynchronous multi-turn agent RL with and without in-flight weight updates: engine idle fraction and step time.

    python benchmarks/async_agents.py                          # 2 x 20 steps on 3 CPU ranks, ~3 minutes here
    python benchmarks/async_agents.py --steps 30 --latency-ms 20

Both runs are asynchronous GRPO through the real entry point
(``torchrun --nproc_per_node 3 -m hpc_rlhf.cli.train_ppo --config configs/grpo_async_agent_tiny_cpu.yaml``:
actor on ranks 0-1, the transformers engine on rank 2) with ``examples/agents/varied_length_agent.py``, whose
episodes last 1 to ``--max-turns`` turns (set by the prompt), each turn's environment taking ``--latency-ms``:

- ``batch``: ``train.partial_rollout=false``. The rollout rank runs a whole batch to its last turn before the weight
  update can reach it; the batch's longest episode sets the pace and the engine's batch thins out at the tail.
- ``in-flight``: ``train.partial_rollout=true``. The next batch's episodes run in the same engine calls as the
  batch being finished; the weight update lands between their turns (``hpc_rlhf.agents.in_flight``).

Per run, over steps 3..N (the queue is full by then): median ``timing/step`` (wall seconds of a step on rank 0),
mean ``async/engine_idle_fraction`` (1 - the engine's seconds inside ``generate`` in that step's round / the step's
wall seconds), mean engine seconds per step, generated tokens per engine second, and the reward of the last 5 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/grpo_async_agent_tiny_cpu.yaml"
MODES = {"batch": "train.partial_rollout=false", "in-flight": "train.partial_rollout=true"}


def overrides(args: argparse.Namespace, out_dir: Path, mode: str) -> list[str]:
    return [
        MODES[mode], f"train.max_steps={args.steps}", f"train.output_dir={out_dir}", f"train.seed={args.seed}",
        f"train.agent_kwargs={{max_turns: {args.max_turns}, step_latency_s: {args.latency_ms / 1000}}}",
        f"train.agent_max_turns={args.max_turns}", f"data.max_len={16 + 8 * args.max_turns}",
        f"actor.pretrain={Path(args.work_dir) / 'tiny-char-llama'}",
        f"data.prompt_data=[{Path(args.work_dir) / 'arithmetic.jsonl'}]", "logger.use_tensorboard=false",
    ]


def run(args: argparse.Namespace, mode: str) -> dict[str, float]:
    out_dir = Path(args.work_dir) / mode
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    port = str(29500 + random.randint(0, 2000))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port", port,
           "-m", "hpc_rlhf.cli.train_ppo", "--config", CONFIG, *overrides(args, out_dir, mode)]
    print(f"[{mode}] $ {' '.join(cmd[2:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = Path(args.work_dir) / f"{mode}.log"
    with log.open("w") as handle:
        if subprocess.run(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env).returncode:
            raise SystemExit(f"[{mode}] failed; see {log}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = rows[2:]
    busy = [r["async/engine_busy_s"] for r in steady]
    tokens = [r["response_length"] * r["num_samples"] for r in steady]  # every response token, feedback included
    return {
        "step_s": statistics.median(r["timing/step"] for r in steady),
        "idle": statistics.fmean(r["async/engine_idle_fraction"] for r in steady),
        "engine_s": statistics.fmean(busy),
        "tok_per_engine_s": sum(tokens) / max(sum(busy), 1e-9),
        "versions_max": max(r["async/versions_per_episode_max"] for r in rows),
        "turns": statistics.fmean(r["extra/num_turns"] if "extra/num_turns" in r else r.get("agent/num_turns", 0.0)
                                  for r in steady),
        "reward_last5": statistics.fmean(r["reward"] for r in rows[-5:]),
    }


def prepare(work_dir: Path) -> None:
    from hpc_rlhf.data.synthetic import write_task_if_missing
    from hpc_rlhf.models.tiny import build_tiny_model

    work_dir.mkdir(parents=True, exist_ok=True)
    if not (work_dir / "tiny-char-llama" / "config.json").is_file():
        build_tiny_model(work_dir / "tiny-char-llama", seed=0)
    write_task_if_missing("arithmetic", work_dir / "arithmetic.jsonl", 256, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--max-turns", type=int, default=10)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="each agent step's own time")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--work-dir", default="runs/bench_async_agents")
    args = parser.parse_args()
    prepare(Path(args.work_dir))
    results = {mode: run(args, mode) for mode in MODES}
    print(f"\n{args.steps} steps, episodes of 1-{args.max_turns} turns, {args.latency_ms:g} ms per agent step; "
          "steps 3..N:")
    print("| run | s/step (median) | engine idle fraction | engine s/step | tokens / engine s | versions per "
          "episode (max) | turns per episode | reward last 5 |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        print(f"| {mode} | {r['step_s']:.2f} | {r['idle']:.2f} | {r['engine_s']:.2f} | {r['tok_per_engine_s']:.0f} | "
              f"{r['versions_max']:.0f} | {r['turns']:.2f} | {r['reward_last5']:.3f} |")


if __name__ == "__main__":
    main()
