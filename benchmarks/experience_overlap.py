"""Role moves one after another vs started together, on a disaggregated CPU layout, in one run: the make-experience
forwards and the critic's and actor's updates.

    python benchmarks/experience_overlap.py                       # 5 gloo ranks, 9 steps
    python benchmarks/experience_overlap.py --steps 13 --hidden 384 --layers 6

The layout puts every role on a rank of its own: actor (rank 0, also the controller), reference (1), critic (2),
reward model (3), rollout (4); PPO with GAE (critic), a KL penalty in the reward (reference, and the actor's old
log-probs), a reward model scoring the samples. The model is a tiny Llama of ``--hidden`` x ``--layers`` (random
init, the character tokenizer of ``hpc_rlhf.models.tiny``) and the reward model is the same network with a score
head. One torchrun run of the real trainer; steps alternate between the two ways of running the make-experience
forwards (``PPOTrainer.overlap_forwards``), step 1 (warm-up) aside:

- sequential: each forward waits for the one before (what the trainer did before the forwards became futures);
- overlapped: the controller starts the reference's, the critic's and then its own old-log-prob forward, then
  waits (``hpc_rlhf.trainers.rl.concurrent_moves``).

Reported from ``metrics.jsonl``, medians per mode: ``timing/make_experience`` (rank 0's wall time of the phase),
each role's forward seconds (``timing/experience/<role>``, measured on the role's rank), their sum (what a
sequential phase cannot beat), their maximum (the phase's critical path: what an overlapped phase cannot beat),
and the whole step (``timing/step``). The reward model scores in its own phase before (``timing/reward``): the
training batch is cut from the scored samples, so its forward is not among those started together. On a shared
2-core machine the roles' processes compete for the cores, so the overlap gains at most what a free core allows.
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
NUM_RANKS = 5
PHASES = {"make_experience": ("experience", ("ref", "critic", "actor")),  # started together, in start order
          "train": ("train", ("critic", "actor"))}


def prepare(work: Path, hidden: int, layers: int) -> tuple[Path, Path, Path]:
    """The policy, the reward model (same network, a score head) and the prompts, built once under ``work``."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from hpc_rlhf.data.synthetic import write_task_if_missing
    from hpc_rlhf.models.tiny import build_tiny_model

    model = build_tiny_model(work / f"policy_h{hidden}_l{layers}", seed=0, hidden_size=hidden,
                             intermediate_size=4 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=4)
    rm_dir = work / f"rm_h{hidden}_l{layers}"
    if not (rm_dir / "config.json").is_file():
        rm = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1)
        rm.config.pad_token_id = rm.config.eos_token_id
        rm.save_pretrained(rm_dir)
        AutoTokenizer.from_pretrained(model).save_pretrained(rm_dir)
    data = write_task_if_missing("arithmetic", work / "arithmetic.jsonl", 256, seed=0)
    return Path(model), rm_dir, Path(data)


def overrides(model: Path, rm: Path, data: Path, out: Path, steps: int) -> list[str]:
    return [
        "train.colocate_all=false", "actor.num_ranks=1", "ref.num_ranks=1", "critic.num_ranks=1",
        "reward.num_ranks=1", "rollout.num_engines=1", f"actor.pretrain={model}", "actor.build_tiny=false",
        f"reward.pretrain={rm}", "reward.reward_func_path=null", "algo.advantage_estimator=gae",
        "algo.kl.init_coef=0.01", "rollout.backend=transformers", "rollout.n_samples_per_prompt=8",
        "rollout.rollout_batch_size=8", "rollout.micro_rollout_batch_size=64", "rollout.generate_max_len=16",
        "train.train_batch_size=64", "train.micro_train_batch_size=32", "ds.zero_stage=2", f"train.max_steps={steps}",
        f"data.prompt_data=[{data}]", "data.input_key=input", "data.label_key=label", "data.prompt_max_len=16",
        f"train.output_dir={out}", "logger.use_tensorboard=false",
    ]


def worker(argv: list[str]) -> None:
    """One rank of the run (under torchrun): the trainer the CLI builds, its steps alternating the two modes."""
    import torch.distributed as dist

    from hpc_rlhf.config import load_config
    from hpc_rlhf.trainers.rl.loop import PPOTrainer
    from hpc_rlhf.trainers.run_skeleton import Row
    from hpc_rlhf.utils.metrics import PhaseTimer
    from hpc_rlhf.world.groups import build_world_groups, init_world
    from hpc_rlhf.world.placement import build_placement

    class AlternatingTrainer(PPOTrainer):
        def run_step(self, step: int, timer: PhaseTimer) -> Row | None:
            self.overlap_forwards = step % 2 == 1  # step 1 warms up; then overlapped on odd steps
            row = super().run_step(step, timer)
            if row is not None:
                row["bench/overlapped"] = float(self.overlap_forwards)
            return row

    init_world(backend="gloo")
    cfg = load_config(None, argv)
    trainer = AlternatingTrainer(cfg, build_world_groups(build_placement(cfg, dist.get_world_size())))
    trainer.fit()
    trainer.close()
    dist.destroy_process_group()


def summarise(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Medians per mode over the steps after the first."""
    out: dict[str, dict[str, float]] = {}
    for mode, flag in (("sequential", 0.0), ("overlapped", 1.0)):
        mine = [r for r in rows[1:] if r["bench/overlapped"] == flag]
        summary = {"steps": float(len(mine))}
        for phase, (prefix, roles) in PHASES.items():
            keys = [f"timing/{prefix}/{role}" for role in roles]
            summary[f"{phase}_s"] = statistics.median(r[f"timing/{phase}"] for r in mine)
            summary.update({f"{phase}/{role}_s": statistics.median(r[key] for r in mine)
                            for role, key in zip(roles, keys, strict=True)})
            summary[f"{phase}/sum_of_roles_s"] = statistics.median(sum(r[k] for k in keys) for r in mine)
            summary[f"{phase}/critical_path_s"] = statistics.median(max(r[k] for k in keys) for r in mine)
        summary["reward_s"] = statistics.median(r["timing/reward"] for r in mine)
        summary["step_s"] = statistics.median(r["timing/step"] for r in mine)
        out[mode] = {k: round(v, 4) for k, v in summary.items()}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=9, help="steps in all; step 1 is a warm-up, the rest alternate")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--work-dir", default="runs/bench_experience_overlap")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        worker(rest)
        return
    work = Path(args.work_dir).resolve()
    model, rm, data = prepare(work, args.hidden, args.layers)
    out = work / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(NUM_RANKS), __file__, "--worker",
           *overrides(model, rm, data, out, args.steps)]
    print("[run]", " ".join(cmd[1:]), flush=True)
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {"hidden": args.hidden, "layers": args.layers, "wall_s": round(time.time() - started, 1),
              **summarise(rows)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
