"""Export a run's actor (or critic) in HF format from its last checkpoint, e.g. after an interruption.

    hpc-rlhf export --ckpt runs/x/ckpt --output runs/x/exported

``--ckpt`` is a checkpoint root (the newest checkpoint that verifies against its manifest is used, as resuming
would) or one ``step_<N>`` directory. The run's ``config.resolved.yaml`` (next to the checkpoint root by default,
``--config`` otherwise) says how the model was built: the weights are rebuilt from ``actor.pretrain`` (critic:
``critic.pretrain``), the checkpoint's trained tensors loaded over them (ZeRO-3 shards consolidated with
DeepSpeed's ``zero_to_fp32``), and a LoRA run's adapter merged in (the adapter alone is written to
``<output>/adapter`` too). Runs on one CPU process, no torch.distributed. The output is written to a temporary
sibling and renamed into place.
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hpc_rlhf.ckpt import CheckpointManager, is_complete
from hpc_rlhf.ckpt.atomic import parse_step_name
from hpc_rlhf.config import load_config
from hpc_rlhf.config.loader import RESOLVED_CONFIG_NAME
from hpc_rlhf.models.loading import load_causal_lm, load_value_model
from hpc_rlhf.models.lora import apply_lora, load_trainable_state, merged_named_tensors, save_adapter
from hpc_rlhf.models.vision import copy_processor_files
from hpc_rlhf.world.placement import TRAINED_ROLES

log = logging.getLogger(__name__)
# The tag the RL trainer's checkpoints are saved under (hpc_rlhf.trainers.rl.checkpoint.DS_TAG); a copy, so that
# exporting a checkpoint does not depend on the trainer package.
DS_TAG = "ds"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpc-rlhf export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint root (ckpt.path) or one step_<N> directory in it")
    p.add_argument("--output", required=True, help="where the HF model folder is written")
    p.add_argument("--config", default=None,
                   help="the run's config.resolved.yaml (default: found next to the checkpoint root)")
    p.add_argument("--role", default="actor", choices=TRAINED_ROLES, help="which trained model to export")
    return p


def resolve_step_dir(ckpt: Path) -> Path:
    """``ckpt`` itself when it is a ``step_<N>`` directory, else the newest verified checkpoint under it."""
    if parse_step_name(ckpt.name) is not None:
        if not is_complete(ckpt):
            raise SystemExit(f"export: --ckpt {ckpt} is not a complete checkpoint (no COMPLETE manifest)")
        return ckpt
    step_dir = CheckpointManager(ckpt, max_num=None, rank=0, world_size=1, barrier=lambda: None).latest_verified()
    if step_dir is None:
        raise SystemExit(f"export: no complete checkpoint under --ckpt {ckpt}")
    return step_dir


def find_config(step_dir: Path, given: str | None) -> Path:
    if given:
        return Path(given)
    # Default layout: <output_dir>/ckpt/step_<N>, with <output_dir>/config.resolved.yaml.
    for folder in (step_dir.parent.parent, step_dir.parent):
        if (folder / RESOLVED_CONFIG_NAME).is_file():
            return folder / RESOLVED_CONFIG_NAME
    raise SystemExit(f"export: no {RESOLVED_CONFIG_NAME} near {step_dir}; pass the run's config with --config")


def trained_state(role_dir: Path, zero_stage: int, lora: bool) -> dict:
    """The role's trained tensors in a checkpoint: the module state (ZeRO 0-2 hold whole tensors), or for ZeRO-3
    the shards consolidated by DeepSpeed. LoRA checkpoints hold only the adapters."""
    if zero_stage == 3:  # deepspeed only here: a ZeRO 0-2 checkpoint exports without it
        from deepspeed.utils.zero_to_fp32 import (
            get_fp32_state_dict_from_zero_checkpoint,
        )

        return get_fp32_state_dict_from_zero_checkpoint(str(role_dir), tag=DS_TAG, exclude_frozen_parameters=lora)
    files = sorted((role_dir / DS_TAG).glob("mp_rank_*_model_states.pt"))
    if len(files) != 1:
        raise SystemExit(f"export: expected one mp_rank_*_model_states.pt in {role_dir / DS_TAG}, found "
                         f"{[f.name for f in files]} (tensor-parallel checkpoints are not exported by this command)")
    # Our own checkpoint, written by DeepSpeed for this run: it pickles more than tensors.
    return torch.load(files[0], map_location="cpu", weights_only=False)["module"]


def export(ckpt: str, output: str, config: str | None = None, role: str = "actor") -> Path:
    step_dir = resolve_step_dir(Path(ckpt))
    cfg = load_config(find_config(step_dir, config))
    if cfg.ds.lora.load_in_4bit:
        raise SystemExit("export: a QLoRA run (ds.lora.load_in_4bit) trained on a 4-bit base; export its adapter "
                         "with `hpc-rlhf lora-merge --load_in_4bit`")
    role_dir = step_dir / role
    if not role_dir.is_dir():
        raise SystemExit(f"export: checkpoint {step_dir} has no {role} (--role {role})")
    lora = cfg.ds.lora.rank > 0
    pretrain = getattr(cfg, role).pretrain or cfg.actor.pretrain

    def build():
        return load_causal_lm(pretrain, torch.float32, "eager") if role == "actor" else \
            load_value_model(pretrain, torch.float32, "eager", value_head_prefix=cfg.critic.value_head_prefix,
                             key="critic.value_head_prefix")

    model = build()
    state = trained_state(role_dir, cfg.ds.zero_stage, lora)
    out, tmp = Path(output), Path(output).with_name(f".tmp_{Path(output).name}")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora:
        model = apply_lora(model, cfg.ds.lora)
        load_trainable_state(state, model)
        save_adapter(model, str(tmp / "adapter"))
        # The merged weights under plain HF names, loaded into a model without LoRA layers.
        state, model = dict(merged_named_tensors(model)), build()
    missing, _ = model.load_state_dict(state, strict=False)
    # Tied weights and buffers are not saved under every name; any other gap means a different model.
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - \
        {name for name, _ in model.named_parameters()}
    missing = sorted(set(missing) - tied - {name for name, _ in model.named_buffers()})
    if missing:
        raise SystemExit(f"export: checkpoint {role_dir} lacks {len(missing)} weights of {pretrain}, e.g. "
                         f"{missing[:3]}: it was written for another model")
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(cfg.actor.pretrain).save_pretrained(tmp)
    copy_processor_files(model.config, tmp)  # a vision-language model's image processor beside its weights
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    log.info("exported %s of %s to %s", role, step_dir, out)
    return out


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    out = export(args.ckpt, args.output, args.config, args.role)
    print(f"exported {args.role} to {out}")


if __name__ == "__main__":
    main()
