"""LoRA weight sync, adapter vs merged (``ds.lora.sync``): seconds and bytes per sync on the SmolLM2-135M shape.

    python benchmarks/lora_sync.py                                  # both engines, both modes, 4 steps each
    python benchmarks/lora_sync.py --engines transformers --steps 6

Each run is the real entry point, ``torchrun --nproc_per_node 2 -m hpc_rlhf.cli.train_ppo``, colocated GRPO on 2 CPU
ranks (fp32, ZeRO-2), with the rollout engine of ``configs/grpo_tiny_cpu.yaml`` (transformers) or
``configs/grpo_vllm_tiny_cpu.yaml`` (vLLM's external launcher; needs the CPU build), a SmolLM2-135M-shaped Llama
(``benchmarks/smollm2_shape.py``, random init) and LoRA rank 16 (alpha 32) on every linear. A step is small (2
prompts x 4 samples, 8 new tokens): the sync is what is measured, read from ``metrics.jsonl``:

- ``timing/weight_sync``: rank 0's seconds in the step's sync phase (each rank loads its own engine at the same
  time): adapter, gather the LoRA factors and load them (peft's ``set_peft_model_state_dict``; vLLM: write the
  adapter folder, ``add_lora`` in place); merged, compute ``W + scale * B @ A`` for every adapted weight and load the
  whole model (vLLM: ``reload_weights``).
- ``weight_sync/bytes``: the payload rank 0 loaded into its engine.

Reported: the median over steps 2..N (step 1's sync is also the first load of the adapter into vLLM), the step-1
value, and the largest ``|is/rollout_kl_k3|`` (each sync reached the engine whole when it is at rounding level).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIGS = {"transformers": "configs/grpo_tiny_cpu.yaml", "vllm": "configs/grpo_vllm_tiny_cpu.yaml"}
VLLM_CPU = ["vllm.enable_sleep=false", "vllm.enforce_eager=true", "vllm.kv_cache_memory_gib=0.25"]


def prepare(work: Path) -> tuple[Path, Path]:
    """The SmolLM2-135M-shaped model folder (built once; the tokenizer takes a few minutes) and the prompts."""
    from benchmarks.smollm2_shape import build_smollm2_135m
    from hpc_rlhf.data.synthetic import write_task_if_missing

    model = build_smollm2_135m(work / "model_smollm2_135m")
    data = write_task_if_missing("arithmetic", work / "arithmetic.jsonl", 256, seed=0)
    return Path(model), Path(data)


def run(engine: str, mode: str, args: argparse.Namespace, model: Path, data: Path) -> dict:
    """One training run; returns the row of the table."""
    out = Path(args.work_dir) / f"{engine}_{mode}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "hpc_rlhf.cli.train_ppo",
           "--config", CONFIGS[engine], f"train.output_dir={out}", f"actor.pretrain={model}", "actor.build_tiny=false",
           f"data.prompt_data=[{data}]", f"ds.lora.rank={args.rank}", f"ds.lora.alpha={2 * args.rank}",
           f"ds.lora.sync={mode}", "rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4",
           "rollout.micro_rollout_batch_size=8", "rollout.generate_max_len=8", "train.train_batch_size=8",
           "train.micro_train_batch_size=4", f"train.max_steps={args.steps}", "logger.use_tensorboard=false",
           *(VLLM_CPU if engine == "vllm" else [])]
    print("[run]", " ".join(cmd[1:]), flush=True)
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{engine}/{mode} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    return {"engine": engine, "mode": mode, "steps": len(rows),
            "sync_s_median": statistics.median(r["timing/weight_sync"] for r in later),
            "sync_s_step1": rows[0]["timing/weight_sync"],
            "bytes": rows[-1]["weight_sync/bytes"],
            "step_s_median": statistics.median(r["timing/step"] for r in later),
            "max_k3": max(abs(r["is/rollout_kl_k3"]) for r in rows),
            "wall_s": time.time() - started}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", nargs="*", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--modes", nargs="*", choices=["adapter", "merged"], default=["adapter", "merged"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rank", type=int, default=16, help="ds.lora.rank (alpha: twice that)")
    p.add_argument("--work-dir", default="runs/bench_lora_sync")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(work)
    results = []
    for engine in args.engines:
        for mode in args.modes:
            results.append(run(engine, mode, args, model, data))
            print(json.dumps(results[-1]), flush=True)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{os.cpu_count()} CPUs, load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print("| engine | ds.lora.sync | bytes per sync | sync s (median, steps 2..N) | sync s (step 1) | step s (median) "
          "| max k3 |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['engine']} | {r['mode']} | {r['bytes'] / 1e6:.2f} MB | {r['sync_s_median']:.3f} | "
              f"{r['sync_s_step1']:.3f} | {r['step_s_median']:.2f} | {r['max_k3']:.1e} |")


if __name__ == "__main__":
    main()
