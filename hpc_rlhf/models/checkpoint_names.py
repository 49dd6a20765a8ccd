"""A transformers model's weights under their checkpoint names, for the HF folders the trainers export.

transformers 5 fuses some weights when it loads a checkpoint: a mixture-of-experts layer's per-expert
``experts.<e>.gate_proj/up_proj/down_proj.weight`` (Qwen3-MoE; ``w1/w3/w2`` for Mixtral) become 3-D
``experts.gate_up_proj`` / ``experts.down_proj`` parameters, and ``save_pretrained`` splits them back. The
exports are written from gathered state-dict buckets, not by ``save_pretrained`` (``weight_sync.state_gather``),
so :func:`to_checkpoint_names` applies transformers' own reverse conversion (``revert_weight_conversion``, what
``save_pretrained`` runs) one tensor at a time: an exported MoE folder has the per-expert names of the published
checkpoints, which transformers 4, vLLM and converters read. Models without conversions pass through unchanged.
(vLLM 0.32's weight reload takes the fused live names as they are: the weight sync sends those.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from hpc_rlhf.models.hf_module import ModelOrEngine, hf_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def has_weight_conversions(model: PreTrainedModel) -> bool:
    """Whether ``model``'s live parameter names differ from its checkpoint names (transformers' conversion
    mapping for its architecture, other than a prefix change)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    return any(not isinstance(c, PrefixChange) for c in conversions or ())


def to_checkpoint_names(model: ModelOrEngine,
                        named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(live name, tensor)`` pairs of ``model`` -> ``(checkpoint name, tensor)`` pairs, lazily. A fused expert
    tensor (E, ...) becomes E (or 2E, for a fused gate/up projection) per-expert tensors, each a copy of its own
    (safetensors refuses views that share one storage)."""
    module = hf_model(model)
    if not has_weight_conversions(module):
        yield from named_tensors
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named_tensors:
        converted = revert_weight_conversion(module, {name: tensor})
        if len(converted) == 1 and next(iter(converted.values())) is tensor:
            yield from converted.items()
        else:
            yield from ((key, value.contiguous().clone()) for key, value in converted.items())
