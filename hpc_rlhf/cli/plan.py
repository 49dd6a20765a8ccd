"""``hpc-rlhf plan``: show the role placement and per-GPU memory of a recipe without loading a model.

Exits 0 when the layout is valid and fits, 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import sys

from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.dist.memory_estimate import ModelSizeError, rank_memory, role_memory, role_num_params
from hpc_rlhf.dist.placement import PlacementError, build_placement


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf plan", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML recipe")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU (default 80)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory kept for activations and fragmentation (default 0.1)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ds.zero_stage=3")
    return p


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def plan(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world_size = args.nodes * args.gpus_per_node
    try:
        cfg = load_config(args.config, args.overrides)
        placement = build_placement(cfg, world_size)
        roles_mem = {r: role_memory(cfg, placement, r) for r in placement.roles if r != "rollout"}
        sizes = {r: role_num_params(cfg, r) for r in roles_mem}
    except (ConfigError, PlacementError, ModelSizeError) as err:
        print(f"plan: invalid layout: {err}", file=sys.stderr)
        return 1

    print(f"world: {args.nodes} nodes x {args.gpus_per_node} GPUs = {world_size} ranks, "
          f"layout {placement.layout}, controller rank {placement.controller_rank}")
    rows = []
    for row in placement.describe():
        name = row["role"]
        size = f"{sizes[name] / 1e9:.2f}B" if name in sizes else "-"
        if name == "rollout":
            engines = f"{row['num_ranks'] // row['tp']} engines"
            rows.append([name, row["ranks"], row["num_ranks"], "-", row["tp"], "-", size, engines])
        else:
            mem = roles_mem[name]
            detail = f"w {mem.weights_gib:.1f} + g {mem.grads_gib:.1f} + opt {mem.optim_gib:.1f} GiB"
            rows.append([name, row["ranks"], row["num_ranks"], row["dp"], row["tp"], row["sp"], size, detail])
    print(_table(rows, ["role", "ranks", "n", "dp", "tp", "sp", "params", "per-GPU model states"]))

    budget = args.gpu_mem_gb * (1 - args.headroom)
    per_rank = rank_memory(cfg, placement, args.gpu_mem_gb)
    distinct: dict[tuple, list[int]] = {}
    for m in per_rank:
        distinct.setdefault((m.roles, round(m.training_gib, 2), round(m.rollout_gib, 2)), []).append(m.rank)
    mem_rows = []
    for (roles, training, rollout), ranks in distinct.items():
        peak = next(m.peak_gib for m in per_rank if m.rank == ranks[0])
        mem_rows.append([f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]), "+".join(roles),
                         f"{training:.1f}", f"{rollout:.1f}", f"{peak:.1f}", "yes" if peak <= budget else "NO"])
    print()
    print(_table(mem_rows, ["ranks", "roles", "training GiB", "vLLM GiB", "peak GiB", f"fits {budget:.0f} GiB"]))
    print("(activations excluded; vLLM share = vllm.gpu_memory_utilization x GPU memory"
          + ("; rollout and training time-share the GPU via sleep mode)" if cfg.train.colocate_all
             and cfg.vllm.enable_sleep else ")"))
    worst = max(per_rank, key=lambda m: m.peak_gib)
    if worst.peak_gib > budget:
        print(f"plan: does not fit: rank {worst.rank} ({'+'.join(worst.roles)}) needs {worst.peak_gib:.1f} GiB "
              f"> {budget:.1f} GiB usable; raise ds.zero_stage, enable ds.adam_offload, add nodes or "
              "lower vllm.gpu_memory_utilization", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(plan(argv))


if __name__ == "__main__":
    main()
