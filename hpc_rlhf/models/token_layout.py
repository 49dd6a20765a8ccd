"""The token layouts the forwards share: model inputs of a collated micro-batch, padded RL rows packed into one row
of real tokens, a model's layout (module, attention, dtype, device), the LM-head weight the chunked log-probs may
use, and the entropy of a distribution over the vocabulary. Used by the text forwards (``hpc_rlhf.models.forward``)
and the vision-language ones (``hpc_rlhf.models.vision_forward``), which import it rather than each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpc_rlhf.algos import entropy_from_logits
from hpc_rlhf.data.packing import CollatedBatch, TokenSample, block_causal_mask, collate
from hpc_rlhf.models.hf_module import ModelOrEngine, hf_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3")


def _flat_varlen(batch: CollatedBatch, attn_implementation: str) -> bool:
    # transformers' flash-attn path reads packed boundaries from position_ids only for a batch of ONE
    # row (``_is_packed_sequence``); packed rows are therefore flattened into one row for flash-attn.
    return bool(batch["packed"]) and attn_implementation in FLASH_IMPLEMENTATIONS


def model_inputs(batch: CollatedBatch, attn_implementation: str, dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, Any]:
    """Keyword arguments for a HF model (or its base model) for this layout."""
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"].to(device),
                              "position_ids": batch["position_ids"].to(device)}
    if not batch["packed"]:
        kwargs["attention_mask"] = (batch["segment_ids"] >= 0).long().to(device)
    elif _flat_varlen(batch, attn_implementation):
        # No mask: varlen flash-attn from the restarting position_ids of one flattened row.
        kwargs = {k: v.reshape(1, -1) for k, v in kwargs.items()}
        kwargs["attention_mask"] = None
    else:
        kwargs["attention_mask"] = block_causal_mask(batch["segment_ids"].to(device), dtype)
    return kwargs


def unflatten_varlen(tensor: torch.Tensor, batch: CollatedBatch, attn_implementation: str) -> torch.Tensor:
    """(1, R*T, ...) back to (R, T, ...) after a flattened flash-attn forward."""
    if not _flat_varlen(batch, attn_implementation):
        return tensor
    return tensor.reshape(*batch["input_ids"].shape, *tensor.shape[2:])


@dataclass
class PackedActions:
    """A micro-batch of padded rows packed into one row of its N real tokens, for one forward.

    ``inputs``: :func:`hpc_rlhf.data.packing.collate` output of one packed row (sample boundaries in
    ``segment_ids``, ``position_ids`` restarting per sample). The K positions whose output belongs to an
    action column are ``positions`` (K,) in that row: the logits there predict ``targets`` (K,), and a
    critic's value there is the value of the state before that action. ``rows`` / ``cols`` (K,) place each
    one back into the (B, R) layout of ``shape``.
    """

    inputs: CollatedBatch
    positions: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    shape: tuple[int, int]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(K,) per-action outputs -> (B, R), zeros elsewhere. Differentiable."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows.to(values.device), self.cols.to(values.device)), values)


def pack_actions(sequences: torch.Tensor, attention_mask: torch.Tensor, num_actions: int,
                 pad_token_id: int = 0) -> PackedActions:
    """(B, P+R) padded rows -> one packed row. Prompt and response tokens of a row are contiguous
    (left-padded prompt, right-padded response), so each sample is its real tokens in order."""
    prompt_cols = sequences.shape[1] - num_actions
    samples, prompt_lens = [], []
    for ids, real in zip(sequences.tolist(), attention_mask.bool().tolist(), strict=True):
        tokens = [t for t, keep in zip(ids, real, strict=True) if keep]
        prompt = sum(real[:prompt_cols])
        samples.append(TokenSample(tuple(tokens), (False,) * prompt + (True,) * (len(tokens) - prompt)))
        prompt_lens.append(prompt)
    inputs = collate(samples, pad_token_id, packing=True, max_tokens_per_row=sum(len(s) for s in samples))
    positions = inputs["target_mask"][0].nonzero().squeeze(1)
    rows = inputs["segment_ids"][0, positions]
    # Position t predicts token t+1 of its sample; response token j sits at sample position prompt + j.
    cols = inputs["position_ids"][0, positions] + 1 - torch.tensor(prompt_lens, dtype=torch.long)[rows]
    return PackedActions(inputs, positions, inputs["target_ids"][0, positions], rows, cols,
                         (sequences.shape[0], num_actions))


def layout_of(model: ModelOrEngine) -> tuple[PreTrainedModel, str, torch.dtype, torch.device]:
    """(inner module, attention implementation, parameter dtype, device) of a model or engine wrapper."""
    module = hf_model(model)
    param = next(iter(module.parameters()))
    return module, module.config._attn_implementation, param.dtype, param.device


# Config fields by which a model transforms its logits after the LM head (softcapping, scaling): the
# chunked head computes plain ``h @ W^T`` and would silently differ, so such models take the logits path.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier",
                     "lm_head_multiplier")


def chunked_head_weight(module: torch.nn.Module) -> torch.Tensor | None:
    """The LM-head weight (V, H) when the chunked log-prob path computes exactly what the model's head
    would, else None: the head must be a plain bias-free ``nn.Linear`` (not LoRA-adapted or quantized),
    its weight not partitioned by ZeRO-3 (only gathered inside the head's own forward), and the config
    must apply nothing to the logits afterwards."""
    output_embeddings = getattr(module, "get_output_embeddings", None)
    head = output_embeddings() if output_embeddings is not None else None
    if type(head) is not torch.nn.Linear or head.bias is not None or hasattr(head.weight, "ds_id"):
        return None
    config = getattr(module, "config", None)
    if any(getattr(config, name, None) not in (None, 1.0) for name in LOGIT_TRANSFORMS):
        return None
    return head.weight


def scatter_actions(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(K,) values of the True positions of ``mask`` (B, R) -> (B, R), zeros elsewhere. Differentiable."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def logits_entropy(logits: torch.Tensor, temperature: float, mask: torch.Tensor, grad: bool) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)``: (..., V) -> (...) fp32, 0 where ``mask`` (...) is false.

    ``grad=False`` computes it outside autograd: an entropy that is only logged then keeps none of its
    (..., V) intermediates alive for a backward (on the logits paths they are as large as the logits).
    """
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        return entropy_from_logits(logits / temperature, mask)
