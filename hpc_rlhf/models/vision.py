"""Vision-language models: what is a VLM, its parts, freezing the vision tower, and the step batch's image fields.

transformers' Qwen2.5-VL / Qwen3-VL ``*ForConditionalGeneration`` hold ``model.visual`` (the vision tower: patch
embedding, blocks, and the ``merger`` that projects merged patches into the text model's width) and
``model.language_model``; ``get_decoder()`` returns the text model only, which never sees the pixels, so the
forwards here call ``model`` (the multimodal model) instead.

The step batch keeps each row's images padded to the batch's widest row so that every row operation (take, split,
concatenate) applies to them like to any other field (:func:`visual_row_fields`); :func:`flat_images` turns the
rows of one forward back into the (N_patches, D) / (I, 3) tensors transformers expects, in the order that the
forward's input ids show the images.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hpc_rlhf.models.mrope import padded_mrope_positions
from hpc_rlhf.rollout.visual import PromptVisual

log = logging.getLogger(__name__)

# Step-batch fields of a batch with images (``hpc_rlhf.trainers.rl.step_batch``).
VISUAL_FIELDS = ("pixel_values", "image_grid_thw", "mrope_position_ids")
# The processor's files of a model folder (``AutoImageProcessor`` / ``AutoProcessor`` read them); an HF export of a
# vision-language model copies them from the folder the model was loaded from.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config (or its ``config.json`` as a dict) is a vision-language model whose images this
    project can feed (Qwen-VL style: a vision config, an image placeholder token and M-RoPE)."""
    if isinstance(config, dict):
        return config.get("vision_config") is not None and config.get("image_token_id") is not None
    return getattr(config, "vision_config", None) is not None and getattr(config, "image_token_id", None) is not None


def multimodal_model(module: Any) -> Any:
    """The model that embeds images into the text (``Qwen2_5_VLModel``): ``module.model`` of a
    ``*ForConditionalGeneration``."""
    inner = getattr(module, "model", None)
    if inner is None or getattr(inner, "visual", None) is None:
        raise ValueError(f"{type(module).__name__} has no model.visual: not a Qwen-VL style vision-language model")
    return inner


def freeze_vision_tower(module: Any) -> int:
    """Stop gradients into the vision encoder (patch embedding and blocks); the ``merger`` (projector into the text
    width) and the language model stay trainable. Returns how many parameters were frozen."""
    visual = multimodal_model(module).visual
    frozen = 0
    for name, param in visual.named_parameters():
        if not name.startswith("merger."):
            param.requires_grad_(False)
            frozen += param.numel()
    return frozen


@functools.cache
def vision_value_class(generation_class: type) -> type:
    """A value model (critic) built from a vision-language ``*ForConditionalGeneration`` class: the same multimodal
    model (``model``: vision tower, projector, language model) with a one-output linear ``score`` head in place of
    the LM head, as ``AutoModelForSequenceClassification`` builds a text critic from a causal LM.

    ``from_pretrained`` of the returned class loads a VLM checkpoint's ``model.*`` weights and starts ``score``
    fresh (the checkpoint's ``lm_head`` is dropped); a checkpoint saved from it loads ``score`` back. Cached per class,
    so every critic of a run is of one class.
    """
    if not hasattr(generation_class, "base_model_prefix"):
        raise TypeError(f"{generation_class!r} is not a transformers model class")

    base: Any = generation_class  # a transformers class: its __init__ takes the config

    def __init__(self: Any, config: Any) -> None:
        base.__init__(self, config)
        del self.lm_head  # a critic predicts no tokens: no vocabulary-sized head to keep, train or offload
        self.score = torch.nn.Linear(config.text_config.hidden_size, 1, bias=False)
        self.post_init()

    def get_output_embeddings(self: Any) -> None:
        return None

    name = generation_class.__name__.replace("ForConditionalGeneration", "") + "ForValue"
    _share_checkpoint_renamings(generation_class, name)
    # no LM head: nothing is tied to the input embeddings
    return type(name, (generation_class,), {"__init__": __init__, "get_output_embeddings": get_output_embeddings,
                                            "_tied_weights_keys": {}, "__module__": __name__})


def _share_checkpoint_renamings(generation_class: type, name: str) -> None:
    """Give the class ``name`` the checkpoint key renamings transformers keeps for ``generation_class`` (older key
    layouts of the model type, e.g. Qwen2.5-VL's ``model.layers`` -> ``model.language_model.layers``): they are
    looked up by class name, or by model type for transformers' own classes only."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
    except ImportError:  # transformers 4 (not tried here) keeps them in the class attribute
        return  # ``_checkpoint_conversion_mapping``, which the subclass inherits

    model_type = getattr(getattr(generation_class, "config_class", None), "model_type", None)
    renamings = get_checkpoint_conversion_mapping(generation_class.__name__) or (
        get_checkpoint_conversion_mapping(model_type) if model_type else None)
    if renamings:
        register_checkpoint_conversion_mapping(name, renamings, overwrite=True)


def visual_row_fields(visuals: Sequence[PromptVisual | None], sequences: torch.Tensor,
                      attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step batch's image fields for rows ``sequences`` (B, T) with images ``visuals[b]`` (None: no image).

    Returns ``pixel_values`` (B, N_max, D) fp32 (zeros past a row's patches), ``image_grid_thw`` (B, I_max, 3) long
    (zero rows past a row's images) and ``mrope_position_ids`` (B, T, 3) long (:mod:`hpc_rlhf.models.mrope`).
    """
    present = [v for v in visuals if v is not None]
    if not present:
        raise ValueError("visual_row_fields: no row has images")
    first = present[0]
    num = len(visuals)
    max_patches = max(int(v.pixel_values.shape[0]) for v in present)
    max_images = max(v.num_images for v in present)
    pixel_values = torch.zeros(num, max_patches, first.pixel_values.shape[1], dtype=torch.float32)
    grids = torch.zeros(num, max_images, 3, dtype=torch.long)
    for b, v in enumerate(visuals):
        if v is not None:
            pixel_values[b, : v.pixel_values.shape[0]] = v.pixel_values
            grids[b, : v.num_images] = v.image_grid_thw
    positions = padded_mrope_positions(sequences, attention_mask, [v.image_grid_thw if v else None for v in visuals],
                                       first.image_token_id, first.spatial_merge_size)
    return {"pixel_values": pixel_values, "image_grid_thw": grids, "mrope_position_ids": positions}


def flat_images(pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded per-row images -> transformers' flat inputs, rows in ``rows`` order (default: all, in order).

    Args:
        pixel_values: (B, N_max, D) per-row patches, zero padded.
        image_grid_thw: (B, I_max, 3) per-row grids; all-zero rows are padding.
    Returns:
        ``(pixel_values (N, D), image_grid_thw (I, 3))``: the real patches and grids of the rows, concatenated.
    """
    order = range(pixel_values.shape[0]) if rows is None else rows
    patches, grids = [], []
    for b in order:
        grid = image_grid_thw[b]
        grid = grid[grid.prod(dim=-1) > 0]
        patches.append(pixel_values[b, : int(grid.prod(dim=-1).sum())])
        grids.append(grid)
    return torch.cat(patches), torch.cat(grids)


def pad_visual_field(values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-part ``pixel_values`` (B_i, N_i, D) or ``image_grid_thw`` (B_i, I_i, 3) zero-padded to a common dim 1, so
    that parts built from different prompts concatenate."""
    width = max(int(v.shape[1]) for v in values)
    return [torch.nn.functional.pad(v, (0, 0, 0, width - v.shape[1])) for v in values]


def copy_processor_files(config: Any, output_dir: str | Path) -> list[str]:
    """Copy a vision-language model's processor files (:data:`PROCESSOR_FILES`) from the folder it was loaded from
    (``config._name_or_path``) into the export ``output_dir``, so that the export loads with its processor. Returns
    the files copied; a text model copies nothing, and a source folder without them is logged, not fatal (the
    weights are still a valid export)."""
    if not is_vision_language(config):
        return []
    source = Path(str(getattr(config, "_name_or_path", "") or ""))
    copied = []
    for name in PROCESSOR_FILES:
        if (source / name).is_file() and source.resolve() != Path(output_dir).resolve():
            shutil.copyfile(source / name, Path(output_dir) / name)
            copied.append(name)
    if "preprocessor_config.json" not in copied and not (Path(output_dir) / "preprocessor_config.json").is_file():
        log.warning("the export %s of a vision-language model has no image processor: %s holds no "
                    "preprocessor_config.json; copy it there by hand", output_dir, source)
    return copied
