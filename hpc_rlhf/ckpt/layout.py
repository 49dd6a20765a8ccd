"""What a checkpoint's trained states are shaped by, and whether another layout can load them.

Every checkpoint records, in ``layout.json``, how each trained role was laid out when it was saved: data-parallel,
tensor-parallel and sequence-parallel sizes, the ZeRO stage DeepSpeed really ran (stages 1-2 fall back to 0 on one
replica), the LoRA adapter's shape, and the model's architecture (from its ``config.json``). A resuming job compares
that with its own layout (:func:`compare_layouts`):

* everything equal: DeepSpeed's own checkpoint loads as saved (bit-exact resume);
* only the parallel layout differs (another number of ranks, ZeRO stage, AutoTP size): the states are loaded through
  DeepSpeed's universal checkpoint (``hpc_rlhf.ckpt.universal``), which stores every parameter and its Adam moments
  whole and re-partitions them for the new layout;
* the model or the LoRA adapter differs: the checkpoint cannot be loaded; the error names the key and both values.

Pure Python over config objects and JSON: ``plan --resume`` runs it on a login node without torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hpc_rlhf.ckpt.atomic import COMPLETE_NAME, CheckpointManager
from hpc_rlhf.config.schema import resolved_param_dtype
from hpc_rlhf.planning.memory_estimate import effective_zero_stage
from hpc_rlhf.planning.model_shape import local_hf_config
from hpc_rlhf.world.placement import TRAINED_ROLES

LAYOUT_FILE = "layout.json"
# The architecture keys of a model's config.json that fix the shapes of its parameters (and so of its optimizer
# states): a checkpoint of one model cannot be loaded into another.
MODEL_SHAPE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "num_local_experts",
                    "num_experts", "moe_intermediate_size")


class CheckpointLayoutError(ValueError):
    """The checkpoint cannot be loaded by this run's layout; the message names what differs."""


@dataclass(frozen=True)
class RoleLayout:
    """How one trained role's states were sharded, and what fixes their shapes."""

    dp: int
    tp: int
    sp: int
    zero_stage: int
    """The ZeRO stage DeepSpeed ran (``planning.memory_estimate.effective_zero_stage``), not the configured one."""
    lora: dict[str, Any] = field(default_factory=dict)
    """``{"rank", "target_modules"}`` of the LoRA adapter; empty without LoRA."""
    model: dict[str, Any] = field(default_factory=dict)
    """:data:`MODEL_SHAPE_KEYS` of the model's config.json (empty when it could not be read)."""
    weight_decay: float = 0.0
    """The role's weight decay: with it the optimizer has two parameter groups (1-D weights undecayed)."""

    @property
    def sharding(self) -> tuple[int, int, int, int]:
        return self.dp, self.tp, self.sp, self.zero_stage


@dataclass(frozen=True)
class CheckpointLayout:
    world_size: int
    roles: dict[str, RoleLayout]

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "roles": {k: asdict(v) for k, v in self.roles.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointLayout:
        return cls(int(data["world_size"]), {k: RoleLayout(**v) for k, v in data["roles"].items()})


def model_fingerprint(hf_config: dict[str, Any] | None) -> dict[str, Any]:
    """The shape-fixing keys of a model's ``config.json`` (its ``text_config`` for multimodal wrappers)."""
    if not hf_config:
        return {}
    config = hf_config.get("text_config", hf_config)
    return {k: config[k] for k in MODEL_SHAPE_KEYS if k in config}


def write_layout(directory: str | Path, layout: CheckpointLayout) -> Path:
    path = Path(directory) / LAYOUT_FILE
    path.write_text(json.dumps(layout.to_json(), indent=1, sort_keys=True))
    return path


def read_layout(directory: str | Path) -> CheckpointLayout | None:
    """The layout a checkpoint was saved with; None for a checkpoint written before layouts were recorded."""
    path = Path(directory) / LAYOUT_FILE
    if not path.is_file():
        return None
    return CheckpointLayout.from_json(json.loads(path.read_text()))


@dataclass(frozen=True)
class LayoutChange:
    """What a resume has to do: ``resharded`` roles load through the universal checkpoint; ``same_world`` says
    whether per-rank state (RNG streams, in-flight rollouts) can be restored rank by rank."""

    resharded: tuple[str, ...]
    same_world: bool
    notes: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return not self.resharded and self.same_world


def compare_layouts(saved: CheckpointLayout, wanted: CheckpointLayout, checkpoint: str | Path = "") -> LayoutChange:
    """How a run laid out as ``wanted`` can load a checkpoint saved as ``saved``.

    Raises:
        CheckpointLayoutError: a trained role is missing on one side, or its model or LoRA adapter differs; the
            message names the role, the key and both values (and ``checkpoint``).
    """
    where = f"checkpoint {checkpoint}: " if checkpoint else "checkpoint: "
    if set(saved.roles) != set(wanted.roles):
        raise CheckpointLayoutError(
            f"{where}it holds the trained roles {sorted(saved.roles)}, this run trains {sorted(wanted.roles)} (a "
            "critic comes with algo.advantage_estimator=gae): resume with the algorithm that wrote it")
    resharded, notes = [], []
    for role in sorted(wanted.roles):
        old, new = saved.roles[role], wanted.roles[role]
        for key in sorted(set(old.model) | set(new.model)):
            if old.model and new.model and old.model.get(key) != new.model.get(key):
                raise CheckpointLayoutError(
                    f"{where}{role}.pretrain differs from the model it was saved with: {key}={old.model.get(key)!r} "
                    f"in the checkpoint, {new.model.get(key)!r} now; a checkpoint resumes only the model that wrote it")
        if old.lora != new.lora:
            raise CheckpointLayoutError(
                f"{where}ds.lora differs for {role}: {_lora_text(old.lora)} in the checkpoint, {_lora_text(new.lora)} "
                "now; the adapter's shapes fix the optimizer states, so set ds.lora as it was saved")
        if old.zero_stage == new.zero_stage == 0 and (old.tp, old.sp) == (new.tp, new.sp) and old.dp != new.dp:
            # Without ZeRO every data-parallel rank holds the whole optimizer state, saved once: the checkpoint
            # does not depend on the number of replicas.
            notes.append(f"{role}: dp {old.dp} -> {new.dp} without ZeRO: its states are whole, loaded as saved")
        elif old.sharding != new.sharding:
            if 0 in (old.zero_stage, new.zero_stage):
                # DeepSpeed's universal format is written from, and read into, ZeRO optimizer partitions; a role on
                # one data-parallel replica runs without them (stages 1-2 fall back to 0 there).
                raise CheckpointLayoutError(
                    f"{where}{role} would move from dp {old.dp} / tp {old.tp} / ZeRO {old.zero_stage} to dp {new.dp} "
                    f"/ tp {new.tp} / ZeRO {new.zero_stage}: resharding needs ZeRO stage 1-3 on both sides, and a "
                    "role on one data-parallel replica (or ds.zero_stage=0) runs without ZeRO partitions; keep at "
                    "least 2 data-parallel replicas (or set ds.adam_offload=true) on both layouts")
            if old.zero_stage != new.zero_stage:
                # DeepSpeed 0.19.8 writes a universal checkpoint's model-state files in the source stage's naming
                # (ZeRO-3: one per data-parallel rank), which an engine of another stage does not find.
                raise CheckpointLayoutError(
                    f"{where}{role} was saved under ZeRO stage {old.zero_stage} and would load under stage "
                    f"{new.zero_stage}: resharding keeps the ZeRO stage (the ranks, data-parallel and AutoTP sizes may "
                    f"change); set ds.zero_stage={old.zero_stage}")
            if 3 in (old.zero_stage, new.zero_stage) and (old.weight_decay or new.weight_decay):
                # DeepSpeed 0.19.8's ZeRO-3 universal load gives every parameter group the first group's Adam
                # moments layout; with weight decay there are two groups (see training.deepspeed_engine).
                raise CheckpointLayoutError(
                    f"{where}{role} is resharded under ZeRO-3 (dp {old.dp} -> {new.dp}, tp {old.tp} -> {new.tp}) with "
                    f"{role}.weight_decay={new.weight_decay or old.weight_decay}: DeepSpeed's universal checkpoint "
                    "restores the Adam moments of ZeRO-3's second parameter group wrongly; resume on the saved layout "
                    f"(dp {old.dp}, tp {old.tp}), or with ds.zero_stage 1-2, or train with {role}.weight_decay=0")
            resharded.append(role)
            notes.append(f"{role}: dp {old.dp} -> {new.dp}, tp {old.tp} -> {new.tp}, sp {old.sp} -> {new.sp}, ZeRO "
                         f"stage {old.zero_stage} -> {new.zero_stage}: loaded through DeepSpeed's universal checkpoint")
    same_world = saved.world_size == wanted.world_size and not resharded and not notes
    if saved.world_size != wanted.world_size:
        notes.append(f"world size {saved.world_size} -> {wanted.world_size}: per-rank RNG streams start afresh and "
                     "partial rollouts in flight on the rollout ranks are dropped (their prompts are not retrained)")
    return LayoutChange(tuple(resharded), same_world, tuple(notes))


def _lora_text(lora: dict[str, Any]) -> str:
    return "no LoRA" if not lora else f"rank {lora['rank']} on {lora['target_modules']}"


# ---------------------------------------------------------------------------- the layout a config asks for


def role_layout(ds_cfg: Any, model_section: Any, dp: int, tp: int, sp: int, weight_decay: float = 0.0,
                on_gpu: bool = True) -> RoleLayout:
    """The layout of one trained role: ``ds_cfg`` (the ``ds`` section), ``model_section`` (a model role's section:
    its ``pretrain`` folder's config.json gives the architecture), ``dp`` x ``tp`` x ``sp`` ranks, the role's
    ``weight_decay``; ``on_gpu``: where it trains (``ds.param_dtype=auto`` is bf16 there, fp32 on CPU)."""
    lora = ds_cfg.lora
    bf16 = resolved_param_dtype(ds_cfg.param_dtype, on_gpu) == "bf16"
    return RoleLayout(
        dp=dp, tp=tp, sp=sp, zero_stage=effective_zero_stage(ds_cfg.zero_stage, dp * sp, True, ds_cfg.adam_offload,
                                                             bf16=bf16),
        lora={"rank": lora.rank, "target_modules": list(lora.target_modules)} if lora.rank else {},
        model=model_fingerprint(local_hf_config(model_section)), weight_decay=weight_decay)


def rl_layout(cfg: Any, placement: Any, on_gpu: bool = True) -> CheckpointLayout:
    """The checkpoint layout of an RL run (``RunConfig``) on ``placement`` (``world.placement.Placement``), trained
    on GPUs or not (``on_gpu``)."""
    roles = {}
    for role in TRAINED_ROLES:
        if role not in placement.roles:
            continue
        grid = placement.roles[role]
        # The critic without a model of its own starts from the actor's.
        section = cfg.critic if role == "critic" and cfg.critic.pretrain else cfg.actor
        roles[role] = role_layout(cfg.ds, section, grid.dp_size, grid.tp_size, grid.sp_size,
                                  getattr(cfg, role).weight_decay, on_gpu)
    return CheckpointLayout(placement.world_size, roles)


def supervised_layout(cfg: Any, world_size: int, on_gpu: bool = True) -> CheckpointLayout:
    """The checkpoint layout of an offline trainer (SFT / RM / DPO / KTO): one trained ``model`` on every rank."""
    tp = cfg.ds.tensor_parallel_size
    return CheckpointLayout(world_size, {"model": role_layout(cfg.ds, cfg.model, world_size // tp, tp, 1,
                                                              cfg.model.weight_decay, on_gpu)})


# ---------------------------------------------------------------------------- plan --resume


def checkpoint_to_resume(path: str | Path) -> Path:
    """The checkpoint a job given ``path`` would resume: ``path`` itself when it is a checkpoint (``step_<N>``),
    else what LATEST names under ``path`` or ``path/ckpt`` (a checkpoint root, or a run's output directory).

    Raises:
        FileNotFoundError: no checkpoint there.
    """
    path = Path(path)
    if (path / COMPLETE_NAME).is_file():
        return path
    for root in (path, path / "ckpt"):
        if root.is_dir():
            latest = CheckpointManager(root).latest()
            if latest is not None:
                return latest
    raise FileNotFoundError(f"--resume {path}: no checkpoint there (a step_<N> folder, a checkpoint root with "
                            "LATEST, or a run's output directory with ckpt/)")


def describe_resume(path: str | Path, wanted: CheckpointLayout) -> str:
    """One line for ``plan --resume``: how a run laid out as ``wanted`` would load the checkpoint at ``path``.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointLayoutError: it cannot be loaded by ``wanted`` (the message names the key).
    """
    step_dir = checkpoint_to_resume(path)
    saved = read_layout(step_dir)
    if saved is None:
        return (f"resume {step_dir}: it records no layout (saved before layouts were recorded); it loads only on "
                "the layout that saved it")
    change = compare_layouts(saved, wanted, step_dir)
    if change.exact:
        return f"resume {step_dir}: the same layout, loaded as saved (exact resume)"
    return f"resume {step_dir}: " + "; ".join(change.notes)
