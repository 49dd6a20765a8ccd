"""Policy log-probs of a vision-language model over the RL batch's rows, padded or packed.

The rows are the step batch's ``(B, P+R)`` layout (``hpc_rlhf.trainers.rl.step_batch``) with their images
(``hpc_rlhf.models.vision.VISUAL_FIELDS``). The multimodal model embeds each row's images into its image tokens
and runs the text model with the rows' own 3-D M-RoPE positions; the LM head then runs only on the positions that
predict a real response token (in vocabulary chunks when the head allows, ``hpc_rlhf.models.chunked_logprobs``).
Image tokens sit in the prompt (or in feedback, off the action mask): no position that predicts one is ever
scored, so they never enter the loss.

Packed: the rows' real tokens go into one row (:func:`hpc_rlhf.models.forward.pack_actions`) with a block-causal
mask; each token keeps its sample's M-RoPE position, and the images are handed over in the order their samples sit
in the packed row, which is the order the model scatters image features into image tokens.

:func:`vision_causal_lm_forward` is the offline trainers' counterpart (SFT with images) over a
:class:`hpc_rlhf.data.packing.CollatedBatch`, padded or packed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hpc_rlhf.data.packing import CollatedBatch
from hpc_rlhf.models.chunked_logprobs import linear_logprobs
from hpc_rlhf.models.hf_module import ModelOrEngine, child_module
from hpc_rlhf.models.logprobs import logprobs_from_logits
from hpc_rlhf.models.token_layout import (
    chunked_head_weight,
    layout_of,
    logits_entropy,
    model_inputs,
    pack_actions,
    scatter_actions,
    unflatten_varlen,
)
from hpc_rlhf.models.vision import flat_images, multimodal_model


def packed_order(segment_ids: torch.Tensor) -> list[int]:
    """(N,) segment ids of one packed row (-1 padding) -> the samples in the order they appear."""
    seen: list[int] = []
    for s in segment_ids.tolist():
        if s >= 0 and (not seen or seen[-1] != s):
            seen.append(s)
    return seen


def packed_mrope(positions: torch.Tensor, attention_mask: torch.Tensor, segment_ids: torch.Tensor,
                 sample_positions: torch.Tensor) -> torch.Tensor:
    """Each packed token's M-RoPE position, taken from its sample's row.

    Args:
        positions: (B, T, 3) per-row M-RoPE positions of the padded rows.
        attention_mask: (B, T) real tokens of those rows.
        segment_ids: (N,) the packed row's sample of each token (-1: padding).
        sample_positions: (N,) each packed token's index among its sample's real tokens.
    Returns:
        (3, 1, N) long, the layout transformers' Qwen-VL text model takes.
    """
    real = attention_mask.bool()
    counts = real.sum(dim=1)
    offsets = torch.cumsum(counts, 0) - counts  # where each row's real tokens start in positions[real]
    flat = positions[real]  # (N_real, 3) in row-major order
    source = (offsets[segment_ids.clamp(min=0)] + sample_positions).clamp(max=max(int(flat.shape[0]) - 1, 0))
    out = torch.where((segment_ids >= 0)[:, None], flat[source], torch.zeros_like(flat[source]))
    return out.T.unsqueeze(1).contiguous()


def _images(visual: dict[str, torch.Tensor], rows: list[int] | None, device: Any) -> dict[str, torch.Tensor]:
    """``pixel_values`` / ``image_grid_thw`` keyword arguments for the rows (none when they have no image)."""
    pixels, grid = flat_images(visual["pixel_values"], visual["image_grid_thw"], rows)
    if grid.shape[0] == 0:
        return {}
    return {"pixel_values": pixels.to(device), "image_grid_thw": grid.to(device)}


def _action_hidden(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                   visual: dict[str, torch.Tensor], num_actions: int, packed: bool
                   ) -> tuple[Any, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The multimodal model's last hidden states at the K positions that predict a real response token.

    Returns ``(module, hidden (K, H), targets (K,), scatter)``: ``scatter`` puts (K,) values back into the (B, R)
    layout (0 on response padding). Padded rows run as they are; packed rows as one row (module docstring).
    """
    module, attn, dtype, device = layout_of(model)
    multimodal = multimodal_model(module)
    positions = visual["mrope_position_ids"]
    if packed:
        pack = pack_actions(sequences, attention_mask, num_actions)
        inputs = model_inputs(pack.inputs, attn, dtype, device)
        segment, within = pack.inputs["segment_ids"][0], pack.inputs["position_ids"][0]
        mrope = packed_mrope(positions, attention_mask, segment, within).to(device)
        # flash-attention reads sample boundaries from text positions prepended as a 4th row (transformers' Qwen-VL)
        inputs["position_ids"] = mrope if inputs["attention_mask"] is not None else torch.cat(
            [inputs["position_ids"].reshape(1, 1, -1), mrope])
        out = multimodal(**inputs, use_cache=False, **_images(visual, packed_order(segment), device))
        return module, out.last_hidden_state[0, pack.positions.to(device)], pack.targets.to(device), pack.scatter
    out = multimodal(input_ids=sequences.to(device), attention_mask=attention_mask.to(device),
                     position_ids=positions.permute(2, 0, 1).to(device), use_cache=False,
                     **_images(visual, None, device))
    mask = attention_mask[:, -num_actions:].bool().to(device)  # real response tokens
    hidden = out.last_hidden_state[:, -num_actions - 1 : -1][mask]

    def scatter(values: torch.Tensor) -> torch.Tensor:
        return scatter_actions(values, mask)

    return module, hidden, sequences[:, -num_actions:].to(device)[mask], scatter


def vision_policy_logprobs(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                           visual: dict[str, torch.Tensor], num_actions: int, temperature: float = 1.0, *,
                           packed: bool = False, with_entropy: bool = False,
                           entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally the entropy) of the response tokens of rows with images: two (B, R) fp32, 0 on
    response padding (as :func:`hpc_rlhf.models.forward.policy_logprobs`, which calls this for such rows).

    ``visual``: the rows' ``pixel_values`` (B, N_max, D), ``image_grid_thw`` (B, I_max, 3) and
    ``mrope_position_ids`` (B, P+R, 3) (:func:`hpc_rlhf.models.vision.visual_row_fields`).
    """
    module, hidden, targets, scatter = _action_hidden(model, sequences, attention_mask, visual, num_actions, packed)
    weight = chunked_head_weight(module)
    if weight is not None:
        logprobs, entropy = linear_logprobs(hidden, weight, targets, temperature, with_entropy)
    else:
        logits = module.get_output_embeddings()(hidden).float()
        logprobs = logprobs_from_logits(logits, targets, temperature)
        entropy = (logits_entropy(logits, temperature, torch.ones_like(targets, dtype=torch.bool), entropy_grad)
                   if with_entropy else None)
    if entropy is not None and not entropy_grad:
        entropy = entropy.detach()
    return scatter(logprobs), (scatter(entropy) if entropy is not None else None)


def vision_critic_values(model: ModelOrEngine, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         visual: dict[str, torch.Tensor], num_actions: int, *, packed: bool = False) -> torch.Tensor:
    """A vision-language critic's value of the state before each response token of rows with images: (B, P+R) ->
    (B, R) fp32, 0 on response padding (:func:`hpc_rlhf.models.forward.critic_values` for such rows).

    ``model``: :func:`hpc_rlhf.models.vision.vision_value_class` (the multimodal model and a ``score`` head); the
    images and M-RoPE positions of ``visual`` go through its multimodal model as in :func:`vision_policy_logprobs`.
    """
    module, hidden, _, scatter = _action_hidden(model, sequences, attention_mask, visual, num_actions, packed)
    return scatter(child_module(module, "score")(hidden).squeeze(-1).float())


def vision_causal_lm_forward(model: ModelOrEngine, batch: CollatedBatch, visual: dict[str, torch.Tensor]
                             ) -> torch.Tensor:
    """Per-target-token log-probabilities (R, T) fp32 (0 where there is no target) of a vision-language model over
    a collated micro-batch (:func:`hpc_rlhf.models.forward.causal_lm_forward` for rows with images).

    ``visual``: :func:`hpc_rlhf.data.vision_sft.visual_inputs` of the batch: ``mrope_position_ids`` (R, T, 3) and,
    when a sample has images, ``pixel_values`` (N, D) / ``image_grid_thw`` (I, 3) in the batch's row-major order.
    The LM head runs only on the target positions (in vocabulary chunks when the head allows).
    """
    module, attn, dtype, device = layout_of(model)
    inputs = model_inputs(batch, attn, dtype, device)
    mrope = visual["mrope_position_ids"].permute(2, 0, 1)  # (3, R, T), transformers' Qwen-VL layout
    if inputs["attention_mask"] is None:  # flash-attention, rows flattened: text positions as a 4th row
        flat = mrope.reshape(3, 1, -1).to(device)
        inputs["position_ids"] = torch.cat([inputs["position_ids"].reshape(1, 1, -1), flat])
    else:
        inputs["position_ids"] = mrope.to(device)
    images = {k: visual[k].to(device) for k in ("pixel_values", "image_grid_thw") if k in visual}
    out = multimodal_model(module)(**inputs, use_cache=False, **images)
    hidden = unflatten_varlen(out.last_hidden_state, batch, attn)
    mask = batch["target_mask"].to(device)
    targets = batch["target_ids"].to(device)[mask]
    weight = chunked_head_weight(module)
    if weight is not None:
        logprobs, _ = linear_logprobs(hidden[mask], weight, targets, 1.0, False)
    else:
        logprobs = logprobs_from_logits(module.get_output_embeddings()(hidden[mask]).float(), targets, 1.0)
    out_logps = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    return out_logps.masked_scatter(mask, logprobs.float())
