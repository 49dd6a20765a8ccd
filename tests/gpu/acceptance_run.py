"""One GRPO run of the GPU acceptance, colocated on one GPU, measured from inside (run by test_acceptance_gpu.py):

    torchrun --nproc_per_node 1 tests/gpu/acceptance_run.py --report R.json [key=value ...]

The trainer is the real one (``PPOTrainer``: transformers rollout engine, DeepSpeed actor). Probes wrap three of
its calls, changing nothing they do: the rollout engine's ``generate`` (device memory while generating), the
actor's ``step`` (device memory while training) and ``RLController.train`` (tokens trained per second). After the
run the script times one full gather of the actor's state dict and asks the planner (``rank_memory``, what
``hpc-rlhf plan`` prints) for its per-GPU estimate of the same run. Everything lands in ``--report`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

# Dense bf16 peak of the GPUs we expect, in FLOP/s (vendor data sheets, without sparsity).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "GH200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def peak_flops(device_name: str) -> float | None:
    """The table's entry whose key appears in ``device_name`` (longest key first: GH200 before H200)."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16_FLOPS[key]
    return None


class Probes:
    """Memory and throughput taken around the trainer's own calls."""

    def __init__(self, trainer) -> None:
        self.generation_bytes: list[int] = []
        self.training_bytes: list[int] = []
        self.train_tokens = 0
        self.train_seconds = 0.0
        engine, actor = trainer.roles.rollout.engine, trainer.roles.actor
        generate, step, train = engine.generate, actor.step, trainer.rl_controller.train  # one rank: rank 0's

        def probed_generate(*args, **kwargs):
            torch.cuda.synchronize()
            self.generation_bytes.append(torch.cuda.memory_allocated())
            return generate(*args, **kwargs)

        def probed_step(*args, **kwargs):
            out = step(*args, **kwargs)
            torch.cuda.synchronize()
            self.training_bytes.append(torch.cuda.memory_allocated())
            return out

        def probed_train(batch):
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = train(batch)
            torch.cuda.synchronize()
            self.train_seconds += time.perf_counter() - start
            if batch is not None:
                self.train_tokens += int(batch.attention_mask.sum()) * trainer.cfg.train.max_epochs
            return out

        engine.generate, actor.step, trainer.rl_controller.train = probed_generate, probed_step, probed_train


def gather_bandwidth(actor) -> tuple[float, float]:
    """(GB/s, GB) of one full gather of the actor's state dict (ZeRO-3 all-gather + copy per bucket)."""
    actor.reload_states()
    torch.cuda.synchronize()
    start, num_bytes = time.perf_counter(), 0
    for bucket in actor.gathered_state_dict_items():
        num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    actor.offload_states()
    return num_bytes / seconds / 1e9, num_bytes / 1e9


def answer_device_memory_from_the_host() -> None:
    """Rehearsal on a machine without CUDA: the device-memory queries the probes make are answered with the host
    process's resident memory, so that the wiring into the trainer runs end to end (numbers meaningless)."""
    from types import SimpleNamespace

    import psutil

    process = psutil.Process()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None
    torch.cuda.memory_allocated = lambda *a, **k: process.memory_info().rss
    torch.cuda.max_memory_allocated = lambda *a, **k: process.memory_info().rss
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(
        name="CPU rehearsal", total_memory=psutil.virtual_memory().total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop as SLURM's time-limit signal would, during this step (checkpoint, exit)")
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="no GPU: answer the device-memory queries from the host (checks the wiring only)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from hpc_rlhf.config import load_config
    from hpc_rlhf.planning.memory_estimate import rank_memory
    from hpc_rlhf.planning.model_shape import role_num_params
    from hpc_rlhf.trainers.rl.loop import PPOTrainer
    from hpc_rlhf.world.groups import build_world_groups, init_world
    from hpc_rlhf.world.placement import build_placement

    if args.rehearse_on_cpu:
        answer_device_memory_from_the_host()
    if args.stop_after is not None:
        from tests.multiproc.spawn import signal_after

        signal_after(args.stop_after)
    cfg = load_config(None, args.overrides)
    env = init_world(cfg.train.collective_timeout_s)
    placement = build_placement(cfg, env.world_size)
    trainer = PPOTrainer(cfg, build_world_groups(placement))
    probes = Probes(trainer)
    torch.cuda.reset_peak_memory_stats()
    rows = trainer.fit()
    max_allocated = torch.cuda.max_memory_allocated()
    stopped = bool(trainer.stopped_by_signal)
    # A run stopped by the signal has checkpointed and offloaded; the gather is measured on complete runs only.
    gather_gbps, gathered_gb = (math.nan, math.nan) if stopped else gather_bandwidth(trainer.roles.actor)

    props = torch.cuda.get_device_properties(0)
    ds_engine = getattr(trainer.roles.actor, "engine", None)
    optimizer = getattr(ds_engine, "optimizer", None)
    optimizer_name = type(getattr(optimizer, "optimizer", optimizer)).__name__
    gpu_gib = props.total_memory / 2**30
    estimate = rank_memory(cfg, placement, gpu_gib)[0]
    num_params = role_num_params(cfg, "actor")
    train_tps = probes.train_tokens / max(probes.train_seconds, 1e-9)
    peak = peak_flops(props.name)
    # Model FLOPs per trained token: 6N (forward 2N + backward 4N); recomputation is not counted (MFU, not HFU).
    mfu = 6 * num_params * train_tps / peak if peak else None
    rollout_tps = [r["rollout_tokens_per_s"] for r in rows if "rollout_tokens_per_s" in r]
    report = {
        "device": props.name, "gpu_gib": gpu_gib, "overrides": args.overrides, "steps": len(rows),
        "stopped_by_signal": stopped, "optimizer": optimizer_name, "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "num_params": num_params,
        "rollout_tokens_per_s": sum(rollout_tps) / len(rollout_tps) if rollout_tps else math.nan,
        "train_tokens_per_s": train_tps, "mfu": mfu,
        "gather_gb_per_s": gather_gbps, "gathered_gb": gathered_gb,
        "max_memory_allocated_gib": max_allocated / 2**30,
        "plan_training_gib": estimate.training_gib, "plan_peak_gib": estimate.peak_gib,
        "generation_allocated_gib": [b / 2**30 for b in probes.generation_bytes],
        "training_allocated_gib": [b / 2**30 for b in probes.training_bytes],
        "losses_finite": all(math.isfinite(v) for r in rows for k, v in r.items()
                             if k.endswith("loss") and isinstance(v, float)),
    }
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
