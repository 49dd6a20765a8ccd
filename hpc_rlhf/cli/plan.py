"""``hpc-rlhf plan``: show the role placement and per-GPU memory of a recipe without loading a model.

Exits 0 when the layout is valid and fits, 1 with the reason otherwise. RL recipes (``train_ppo``) and
the offline trainers' recipes (sft, rm, dpo, kto: a ``model:`` section) are both planned. The memory
model (``hpc_rlhf.planning.memory_estimate``, with ``model_shape`` and ``lora_memory``) is checked against
measured peaks by ``tests/multiproc/test_memory_estimate.py``; docs/memory.md says how and with which tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import yaml

from hpc_rlhf.ckpt.layout import CheckpointLayoutError, describe_resume, rl_layout, supervised_layout
from hpc_rlhf.config import ConfigError, load_config
from hpc_rlhf.config.advice import config_warnings
from hpc_rlhf.config.recipe_catalog import untried_recipe_note
from hpc_rlhf.config.schema import resolved_param_dtype
from hpc_rlhf.config.supervised import CONFIG_CLASSES, load_supervised_config
from hpc_rlhf.planning.devices import DEVICES, get_device
from hpc_rlhf.planning.memory_estimate import (
    RoleMemory,
    effective_zero_stage,
    peak_gib,
    rank_memory,
    role_memory,
    supervised_memory,
)
from hpc_rlhf.planning.model_shape import (
    ModelSizeError,
    check_moe_tensor_parallel,
    local_hf_config,
    role_num_params,
    role_shape,
)
from hpc_rlhf.planning.step_time import StepTime, rl_step_time, supervised_step_time
from hpc_rlhf.planning.time_budget import (
    GraceTooShort,
    SlurmBudget,
    grace_check,
    read_sbatch_budget,
    time_lines,
)
from hpc_rlhf.planning.vision_memory import vision_lines, vllm_multimodal_lines
from hpc_rlhf.training.optimizer_choice import adam_implementation, optimizer_offloaded
from hpc_rlhf.world.placement import TRAINED_ROLES, PlacementError, build_placement

KINDS = ("auto", "rl", *CONFIG_CLASSES)


# ``--resume auto``: the config's own checkpoint root.
RESUME_FROM_CONFIG = "auto"

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf plan", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML recipe")
    p.add_argument("--kind", choices=KINDS, default="auto",
                   help="trainer of the recipe; auto: rl, or for a recipe with a model: section the "
                        "sft_/rm_/dpo_/kto_ prefix of its file name")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0, help="memory of one GPU (default 80)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of GPU memory kept for fragmentation and the CUDA context (default 0.1)")
    p.add_argument("--gpu", choices=sorted(DEVICES), default="h100",
                   help="device of the step-time model (docs/step_time.md; GPU numbers are assumptions with "
                        "sources, cpu is measured); default h100")
    p.add_argument("--interconnect-gbps", type=float,
                   help="GB/s (bytes) per rank of collectives, the weight sync and rank 0's controller traffic (the "
                        "step's batches it sends and receives); default: the device's NVLink inside one node, its "
                        "network across nodes")
    p.add_argument("--fs-gbps", type=float, help="GB/s (bytes) of checkpoint writes and reads for the whole job; "
                                                 "default: the device's conservative figure")
    p.add_argument("--sbatch", help="an sbatch file whose #SBATCH --time and --signal=USR1@<grace> are checked")
    p.add_argument("--time", help="SLURM time limit, e.g. 48:00:00 (default: the --sbatch file's, else slurm.time)")
    p.add_argument("--signal-grace-s", type=int,
                   help="seconds between the USR1 warning and the time limit (default: the --sbatch file's "
                        "--signal, else slurm.signal_grace_s)")
    p.add_argument("--resume", metavar="CKPT",
                   help="a checkpoint (step_<N>), checkpoint root or run directory: say whether this layout can load "
                        "it (as saved, or resharded through DeepSpeed's universal checkpoint) or why not; 'auto': the "
                        "config's own checkpoint root (ckpt.path, else <train.output_dir>/ckpt), where no checkpoint "
                        "yet means a fresh start (what a requeued sbatch job checks)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. ds.zero_stage=3")
    return p


def _table(rows: Sequence[Sequence[object]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)) for r in rows]
    return "\n".join(lines)


def recipe_kind(path: str, requested: str = "auto") -> str:
    """``rl`` or an offline trainer kind; see ``--kind``."""
    if requested != "auto":
        return requested
    try:
        sections = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "rl"  # load_config reports the file's problem
    if not isinstance(sections, dict) or "model" not in sections:
        return "rl"
    prefix = Path(path).name.split("_")[0]
    if prefix not in CONFIG_CLASSES:
        raise ConfigError(f"{path} has a model: section (an offline trainer's recipe) but its name does not say "
                          f"which trainer; pass --kind {{{','.join(CONFIG_CLASSES)}}}")
    return prefix


def check_parallelism(ds, trainer: str) -> None:
    """Combinations the training engines cannot run, refused before any sizing (layouts: ``build_placement``)."""
    if ds.tensor_parallel_size > 1 and ds.lora.rank > 0:
        raise ConfigError(f"ds.lora.rank={ds.lora.rank} with ds.tensor_parallel_size={ds.tensor_parallel_size}: "
                          "AutoTP cannot shard peft's LoRA layers (the engine refuses it); use "
                          "ds.tensor_parallel_size=1 with LoRA")
    if trainer != "rl" and ds.ring_attn_size > 1:
        raise ConfigError(f"ds.ring_attn_size={ds.ring_attn_size}: the {trainer} trainer does not split sequences; "
                          "remove it")


@contextlib.contextmanager
def _sized_tiny_model(section, rollout_backend: str = "transformers") -> Iterator[None]:
    """A CPU recipe's ``build_tiny`` model may not exist yet: size the one it would build (temporary copy)."""
    if not (section.build_tiny and section.pretrain) or (Path(section.pretrain) / "config.json").is_file():
        yield
        return
    from hpc_rlhf.models.tiny import build_tiny_for  # torch: plan runs on a login node without it

    original = section.pretrain
    with tempfile.TemporaryDirectory(prefix="hpc-rlhf-plan-") as tmp:
        section.pretrain = str(build_tiny_for(Path(tmp) / "tiny", section.build_tiny,
                                              rollout_backend=rollout_backend))
        try:
            yield
        finally:
            section.pretrain = original


def _role_row(name: str, mem: RoleMemory) -> list[str]:
    states = (f"w {mem.weights_gib:.1f} + g {mem.grads_gib:.1f} + opt {mem.optim_gib:.1f} "
              f"+ buf {mem.buffers_gib:.1f}")
    working = f"act {mem.activations_gib:.1f}" + (f" + gath {mem.gathered_gib:.1f}" if mem.gathered_gib else "")
    return [states, working, str(mem.tokens_per_rank)]


MEMORY_HEADER = ["per-GPU states GiB", "working GiB", "tokens/rank"]
FOOTNOTE = ("(training = states of every role on the rank + the largest working set: activations of one "
            "micro-batch, gathered ZeRO-3 parameters; model validated on CPU, see docs/memory.md")


def optimizer_lines(ds, zero_ranks: dict[str, int]) -> list[str]:
    """One line per Adam implementation the trained roles (name -> ZeRO ranks, dp x sp) step with on GPU, and why."""
    chosen: dict[str, list[str]] = {}
    for role, ranks in zero_ranks.items():
        stage = effective_zero_stage(ds.zero_stage, ranks, True, ds.adam_offload,
                                     bf16=resolved_param_dtype(ds.param_dtype, True) == "bf16")
        adam = adam_implementation(on_gpu=True, offloaded=optimizer_offloaded(ds.adam_offload, stage), zero_stage=stage)
        chosen.setdefault(adam.describe(), []).append(role)
    return [f"optimizer of {', '.join(roles)}: {description}" for description, roles in chosen.items()]


def _device(args):
    one_path = args.interconnect_gbps
    return get_device(args.gpu, intra_node_gbps=one_path, inter_node_gbps=one_path, fs_gbps=args.fs_gbps)


def _time_budget(step: StepTime, slurm, args) -> int:
    """Print the step-time section; 1 when the warning signal leaves less than one step plus one checkpoint."""
    try:
        from_file = read_sbatch_budget(args.sbatch) if args.sbatch else SlurmBudget(None, None, None)
        budget = SlurmBudget.resolve(args.time, args.signal_grace_s, from_file, slurm)
    except (OSError, ValueError) as err:
        print(f"plan: invalid time budget: {err}", file=sys.stderr)
        return 1
    print()
    print("\n".join(time_lines(step, budget, _device(args))))
    try:
        grace_check(step, budget)
    except GraceTooShort as err:
        print(f"plan: {err}", file=sys.stderr)
        return 1
    return 0


def _fits(peak: float, budget: float, where: str) -> int:
    if peak > budget:
        print(f"plan: does not fit: {where} needs {peak:.1f} GiB > {budget:.1f} GiB usable; raise ds.zero_stage, "
              "enable ds.adam_offload or ds.gradient_checkpointing, lower train.micro_train_batch_size / "
              "train.max_tokens_per_gpu / rollout.micro_rollout_batch_size, add nodes or lower "
              "vllm.gpu_memory_utilization", file=sys.stderr)
        return 1
    return 0


def _resume_line(path: str | None, cfg, wanted) -> str | None:
    """``--resume``: how this layout would load that checkpoint (raises when it cannot). Without a path, the
    config's checkpoint root, where finding nothing is fine: the run starts fresh (``ckpt.load=true`` does)."""
    if path is None:
        return None
    if path != RESUME_FROM_CONFIG:
        return describe_resume(path, wanted)
    root = Path(cfg.ckpt.path) if cfg.ckpt.path else Path(cfg.train.output_dir) / "ckpt"
    try:
        return describe_resume(root, wanted)
    except FileNotFoundError:
        return f"resume: no checkpoint under {root} yet; the run starts fresh"


def _vision(section, data, micro_batch: int, ds, role: str, vllm: bool = False) -> list[str]:
    """The vision tower's lines of a vision-language model (none for a text model); with ``vllm``, vLLM's caveat
    and its multimodal caches (an estimate)."""
    hf = local_hf_config(section)
    bytes_per_value = 2 if resolved_param_dtype(ds.param_dtype, True) == "bf16" else 4
    lines = vision_lines(hf or {}, data.max_pixels, micro_batch, bytes_per_value, section.freeze_vision_tower, role)
    if not (lines and vllm):
        return lines
    return [*lines, *vllm_multimodal_lines(hf or {}, data.max_pixels, bytes_per_value)]


def plan_supervised(args, kind: str, world_size: int) -> int:
    try:
        cfg = load_supervised_config(kind, args.config, args.overrides)
        check_parallelism(cfg.ds, kind)
        with _sized_tiny_model(cfg.model):
            check_moe_tensor_parallel(local_hf_config(cfg.model), cfg.ds.tensor_parallel_size, "model.pretrain")
            roles = supervised_memory(cfg, kind, world_size)
            vision = _vision(cfg.model, cfg.data, cfg.train.micro_train_batch_size, cfg.ds, "model")
            resume = _resume_line(args.resume, cfg, supervised_layout(cfg, world_size))
    except (ConfigError, ModelSizeError) as err:
        print(f"plan: invalid layout: {err}", file=sys.stderr)
        return 1
    except (CheckpointLayoutError, FileNotFoundError) as err:
        print(f"plan: cannot resume: {err}", file=sys.stderr)
        return 1
    print(f"world: {args.nodes} nodes x {args.gpus_per_node} GPUs = {world_size} ranks, {kind} trainer, "
          f"data parallel over all ranks")
    if resume:
        print(resume)
    rows = [[name, "-" if name == "model" else "frozen", *_role_row(name, mem)] for name, mem in roles.items()]
    print(_table(rows, ["role", "", *MEMORY_HEADER]))
    if vision:
        print("\n".join(vision))
    print("\n".join(optimizer_lines(cfg.ds, {"model": world_size // cfg.ds.tensor_parallel_size})))
    peak = peak_gib(list(roles.values()))
    budget = args.gpu_mem_gb * (1 - args.headroom)
    print(f"\npeak per rank: {peak:.1f} GiB ({'fits' if peak <= budget else 'does NOT fit'} {budget:.0f} GiB)")
    print(FOOTNOTE + ")")
    fits = _fits(peak, budget, f"every rank ({'+'.join(roles)})")
    with _sized_tiny_model(cfg.model):
        step = supervised_step_time(cfg, kind, _device(args), nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                                    world_size=world_size)
    return _time_budget(step, cfg.slurm, args) or fits


def plan(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world_size = args.nodes * args.gpus_per_node
    try:
        kind = recipe_kind(args.config, args.kind)
    except ConfigError as err:
        print(f"plan: invalid layout: {err}", file=sys.stderr)
        return 1
    note = untried_recipe_note(args.config)  # a GPU recipe that never ran on GPUs says so before it queues
    if note:
        print(note)
    if kind != "rl":
        return plan_supervised(args, kind, world_size)
    try:
        cfg = load_config(args.config, args.overrides)
        check_parallelism(cfg.ds, kind)
        placement = build_placement(cfg, world_size)
        with _sized_tiny_model(cfg.actor, cfg.rollout.backend):
            check_moe_tensor_parallel(local_hf_config(cfg.actor), cfg.ds.tensor_parallel_size, "actor.pretrain")
            roles_mem = {r: role_memory(cfg, placement, r) for r in placement.roles if r != "rollout"}
            sizes = {r: role_num_params(cfg, r) for r in roles_mem}
            shapes = {r: role_shape(cfg, r) for r in roles_mem}
            per_rank = rank_memory(cfg, placement, args.gpu_mem_gb)
            vision = _vision(cfg.actor, cfg.data, cfg.train.micro_train_batch_size, cfg.ds, "actor",
                             vllm=cfg.rollout.backend == "vllm")
            resume = _resume_line(args.resume, cfg, rl_layout(cfg, placement))
    except (ConfigError, PlacementError, ModelSizeError) as err:
        print(f"plan: invalid layout: {err}", file=sys.stderr)
        return 1
    except (CheckpointLayoutError, FileNotFoundError) as err:
        print(f"plan: cannot resume: {err}", file=sys.stderr)
        return 1

    for line in config_warnings(cfg):
        print(f"plan: warning: {line}")
    print(f"world: {args.nodes} nodes x {args.gpus_per_node} GPUs = {world_size} ranks, "
          f"layout {placement.layout}, controller rank {placement.controller_rank}")
    if resume:
        print(resume)
    rows = []
    for row in placement.describe():
        name = row["role"]
        size = f"{sizes[name] / 1e9:.2f}B" if name in sizes else "-"
        if name == "rollout":
            engines = f"{row['num_ranks'] // row['tp']} engines"
            rows.append([name, row["ranks"], row["num_ranks"], "-", row["tp"], "-", size, engines, "-", "-"])
        else:
            rows.append([name, row["ranks"], row["num_ranks"], row["dp"], row["tp"], row["sp"], size,
                         *_role_row(name, roles_mem[name])])
    print(_table(rows, ["role", "ranks", "n", "dp", "tp", "sp", "params", *MEMORY_HEADER]))
    for name, mem in roles_mem.items():
        tp = placement.roles[name].tp_size
        split = f"; tp {tp}: layer projections and their activations split {tp} ways" if tp > 1 else ""
        print(f"  {name}: {'; '.join(mem.notes)}{split}; shape {shapes[name].describe()}")
    if vision:
        print("\n".join(vision))
    zero_ranks: dict[str, int] = {r: placement.roles[r].dp_size * placement.roles[r].sp_size
                                  for r in TRAINED_ROLES if r in roles_mem}
    print("\n".join(optimizer_lines(cfg.ds, zero_ranks)))

    if placement.layout != "colocated":
        actor = placement.roles["actor"]
        replicas = len(actor.tp_groups)
        sync_gb = sizes["actor"] * (2 if resolved_param_dtype(cfg.ds.param_dtype, True) == "bf16" else 4) / 1e9
        per_sender = f", {sync_gb / replicas / actor.tp_size:.1f} GB per rank" if actor.tp_size > 1 else ""
        print(f"  weight sync: {sync_gb:.1f} GB to every rollout rank per step, sent by {replicas} actor replicas at "
              f"once (about {sync_gb / replicas:.1f} GB per replica{per_sender}; rank 0 sends its share only)")

    budget = args.gpu_mem_gb * (1 - args.headroom)
    distinct: dict[tuple, list[int]] = {}
    for m in per_rank:
        distinct.setdefault((m.roles, round(m.training_gib, 2), round(m.rollout_gib, 2), round(m.sync_gib, 2)),
                            []).append(m.rank)
    mem_rows = []
    for (roles, training, rollout, sync), ranks in distinct.items():
        peak = next(m.peak_gib for m in per_rank if m.rank == ranks[0])
        mem_rows.append([f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0]), "+".join(roles),
                         f"{training:.1f}", f"{rollout:.1f}", f"{sync:.1f}" if sync else "-", f"{peak:.1f}",
                         "yes" if peak <= budget else "NO"])
    print()
    print(_table(mem_rows, ["ranks", "roles", "training GiB", "vLLM GiB", "sync GiB", "peak GiB",
                            f"fits {budget:.0f} GiB"]))
    print(FOOTNOTE + "; vLLM share = vllm.gpu_memory_utilization x GPU memory"
          + ("; rollout and training time-share the GPU via sleep mode; sync = what cannot leave the GPU + actor "
             "bf16 weights + one bucket + vLLM weights while they load)" if cfg.train.colocate_all
             and cfg.vllm.enable_sleep else ")"))
    worst = max(per_rank, key=lambda m: m.peak_gib)
    fits = _fits(worst.peak_gib, budget, f"rank {worst.rank} ({'+'.join(worst.roles)})")
    with _sized_tiny_model(cfg.actor, cfg.rollout.backend):
        step = rl_step_time(cfg, placement, _device(args), nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    return _time_budget(step, cfg.slurm, args) or fits


def main(argv: list[str] | None = None) -> None:
    sys.exit(plan(argv))


if __name__ == "__main__":
    main()
