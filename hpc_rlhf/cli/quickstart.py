"""``hpc-rlhf quickstart``: SFT then GRPO on a laptop-class CPU, no downloads, the cluster code path.

1. builds a small Llama and a character tokenizer locally;
2. writes a seeded addition task (``a+b=`` -> ``c``, operands 0..19) with a held-out set of operand
   pairs the model never trains on;
3. SFTs the model (``hpc_rlhf.cli.train_sft`` under torchrun, 2 gloo ranks);
4. runs GRPO with an exact-match reward (``hpc_rlhf.cli.train_ppo`` under torchrun, 2 ranks);
5. reports greedy accuracy on the held-out pairs after each stage and plots reward and accuracy: the base
   model's with the rollout engine directly, the SFT and GRPO policies' through GRPO's own evaluation
   (``eval.*``: the same engines and reward function as training; pass@1 at step 0 and every 100 steps).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hpc_rlhf.models.tiny import build_tiny_model
from hpc_rlhf.rollout.base import GenerationRequest, SamplingParams
from hpc_rlhf.rollout.transformers_engine import TransformersRolloutEngine
from hpc_rlhf.utils.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXACT_REWARD = ROOT / "examples/reward_funcs/arithmetic.py"
MAX_OPERAND = 19
NUM_HELDOUT_PAIRS = 60
HELDOUT_METRIC = "eval/heldout_prompts/pass@1"  # greedy, one sample per prompt: the accuracy


class ModelSizes(TypedDict):
    """The tiny model's sizes (``build_tiny_model`` keywords)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


MODEL_SIZES = ModelSizes(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2)


@dataclass(frozen=True)
class TaskFiles:
    """The addition task's data files (paths as strings, for ``key=value`` overrides) and held-out pairs."""

    sft: str
    sft_eval: str
    rl: str
    heldout_prompts: str
    heldout: list[tuple[int, int]]


def split_pairs(seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All operand pairs, split into training pairs and held-out pairs (fixed by ``seed``)."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs[NUM_HELDOUT_PAIRS:], pairs[:NUM_HELDOUT_PAIRS]


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_task(data_dir: Path, seed: int, num_sft: int, num_rl: int) -> TaskFiles:
    train_pairs, heldout = split_pairs(seed)
    rng = random.Random(seed + 1)
    sft = [rng.choice(train_pairs) for _ in range(num_sft)]
    rl = [rng.choice(train_pairs) for _ in range(num_rl)]
    return TaskFiles(
        sft=write_jsonl(data_dir / "sft_train.jsonl",
                        [{"input": f"{a}+{b}=", "output": str(a + b)} for a, b in sft]),
        sft_eval=write_jsonl(data_dir / "sft_eval.jsonl",
                             [{"input": f"{a}+{b}=", "output": str(a + b)} for a, b in heldout]),
        rl=write_jsonl(data_dir / "rl_prompts.jsonl", [{"input": f"{a}+{b}=", "label": str(a + b)} for a, b in rl]),
        heldout_prompts=write_jsonl(data_dir / "heldout_prompts.jsonl",
                                    [{"input": f"{a}+{b}=", "label": str(a + b)} for a, b in heldout]),
        heldout=[(a, b) for a, b in heldout],
    )


def heldout_accuracy(model_dir: str | Path, pairs: list[tuple[int, int]]) -> float:
    """Greedy exact-match accuracy on ``a+b=`` prompts, with the same rollout engine RL uses."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = TransformersRolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[tok.eos_token_id])
    requests = [GenerationRequest(tok(f"{a}+{b}=")["input_ids"], greedy) for a, b in pairs]
    outputs = engine.generate(requests)
    answers = [tok.decode(o.output_ids, skip_special_tokens=True) for o in outputs]  # one string per id list
    correct = [isinstance(text, str) and text.strip() == str(a + b)
               for text, (a, b) in zip(answers, pairs, strict=True)]
    return sum(correct) / len(correct)


def torchrun(nproc: int, module: str, args: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(29500 + random.randint(0, 1000)), "-m", module, *args]
    print(f"\n$ torchrun --nproc_per_node {nproc} -m {module} {' '.join(args)}\n", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def plot(metrics_path: Path, accuracies: dict[str, float], out: Path) -> None:
    import matplotlib  # slow to import; only the final plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in all_rows if "reward" in r]  # step 0 holds only the evaluation of the SFT policy
    evals = [r for r in all_rows if HELDOUT_METRIC in r]
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    rewards = [r["reward"] for r in rows]
    window = max(1, len(rewards) // 25)
    smooth = [sum(rewards[max(0, i - window + 1) : i + 1]) / len(rewards[max(0, i - window + 1) : i + 1])
              for i in range(len(rewards))]
    ax.plot(steps, rewards, alpha=0.35, label="reward = accuracy of sampled rollouts")
    ax.plot(steps, smooth, label=f"reward, {window}-step mean")
    ax.plot([r["step"] for r in evals], [r[HELDOUT_METRIC] for r in evals], marker="o",
            label=f"held-out greedy accuracy ({HELDOUT_METRIC})")
    ax.axhline(accuracies["base"], linestyle=":", color="gray",
               label=f"held-out accuracy base: {accuracies['base']:.2f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.05)
    ax.set_title("hpc-rlhf quickstart: SFT then GRPO on a+b=")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hpc-rlhf quickstart", description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="runs/quickstart")
    p.add_argument("--nproc", type=int, default=2, help="ranks (processes) per stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-samples", type=int, default=10240)
    p.add_argument("--rl-steps", type=int, default=500)
    args = p.parse_args(argv)
    started = time.time()
    run = (ROOT / args.output_dir).resolve()
    base = build_tiny_model(run / "base_model", seed=args.seed, **MODEL_SIZES)
    data = write_task(run / "data", args.seed, args.sft_samples, num_rl=4096)
    acc = {"base": heldout_accuracy(base, data.heldout)}
    print(f"held-out accuracy of the base model: {acc['base']:.3f}", flush=True)

    torchrun(args.nproc, "hpc_rlhf.cli.train_sft", [
        "--config", "configs/sft_tiny_cpu.yaml", f"model.pretrain={base}", "model.build_tiny=false",
        f"data.train_data=[{data.sft}]", f"data.eval_data=[{data.sft_eval}]", "data.synthetic_task=null",
        "model.learning_rate=2e-3", f"train.output_dir={run / 'sft'}", "ckpt.save_steps=null", "train.eval_steps=48"])

    torchrun(args.nproc, "hpc_rlhf.cli.train_ppo", [
        "--config", "configs/grpo_tiny_cpu.yaml", f"actor.pretrain={run / 'sft' / 'model'}", "actor.build_tiny=false",
        "actor.learning_rate=3e-4", f"reward.reward_func_path={EXACT_REWARD}", f"data.prompt_data=[{data.rl}]",
        "data.synthetic_task=null", f"train.max_steps={args.rl_steps}", "train.num_episodes=8",
        f"train.output_dir={run / 'grpo'}", "rollout.temperature=1.0", "rollout.n_samples_per_prompt=8",
        "rollout.rollout_batch_size=32", "train.train_batch_size=256", "train.micro_train_batch_size=128",
        "rollout.micro_rollout_batch_size=128", f"eval.data=[{data.heldout_prompts}]", "eval.steps=100",
        "eval.at_start=true", "eval.temperature=0", "eval.n_samples_per_prompt=1"])
    evals = [r for r in read_metrics(run / "grpo") if HELDOUT_METRIC in r]
    acc["after SFT"], acc["after GRPO"] = evals[0][HELDOUT_METRIC], evals[-1][HELDOUT_METRIC]
    write_jsonl(run / "accuracy.jsonl", [{"stage": k, "heldout_accuracy": v} for k, v in acc.items()])

    plot(run / "grpo" / "metrics.jsonl", acc, run / "quickstart.png")
    minutes = (time.time() - started) / 60
    print(f"""
held-out accuracy on {len(data.heldout)} unseen operand pairs:
  base model   {acc['base']:.3f}
  after SFT    {acc['after SFT']:.3f}
  after GRPO   {acc['after GRPO']:.3f}
finished in {minutes:.1f} min; outputs in {run}:
  quickstart.png          reward and accuracy per GRPO step
  grpo/metrics.jsonl      per-step metrics (reward, policy_loss, timing/*, rollout_tokens_per_s, ...)
  grpo/model              the final policy in HF format (AutoModelForCausalLM.from_pretrained)

next:
  your model on a GPU node:  hpc-rlhf plan --config configs/grpo_qwen2.5_7b.yaml --nodes 1 --gpus-per-node 8
                             then torchrun --nproc_per_node 8 -m hpc_rlhf.cli.train_ppo --config <your recipe>
  on a SLURM cluster:        sbatch slurm/grpo_7b.sbatch   (or hpc-rlhf submit --config ... --partition ...)
""")


if __name__ == "__main__":
    main()
