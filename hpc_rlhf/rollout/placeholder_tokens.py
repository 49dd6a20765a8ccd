"""A vision-language model's placeholder tokens, which no rollout engine may sample.

Qwen-VL marks where an image's embeddings go with ``<|image_pad|>`` tokens (and ``<|video_pad|>``, framed by
``<|vision_start|>`` / ``<|vision_end|>``). Only the processor places them, one run per image; the training forward
matches runs to the images it was given (``hpc_rlhf.models.mrope``), so one *generated* placeholder makes the whole
step batch raise (``image token at position ... but only 1 image grid(s)``), and a later turn's prompt that carries
it is refused by the engine. Hence two lines of defence:

1. every engine forbids them: the transformers engine masks them out of the sampling distribution; the vLLM
   engines give them a logit bias of ``-100`` (vLLM clamps biases to +-100; the token's probability is then
   ``e^-100`` times the next best's, never drawn in practice). With vLLM's ``processed_logprobs`` the reported
   log-prob of a sampled token is then renormalised over the other tokens: it exceeds the trainer's full-vocabulary
   log-prob by ``-log(1 - p)``, ``p`` the placeholders' probability mass, which a trained model puts next to 0.
   Both (no forbidden token drawn, the ``-log(1 - p)`` offset to 1e-6) were measured on vLLM's CPU build with a
   text model whose likeliest tokens stood in for the placeholders; vLLM runs vision-language models on a GPU only,
   where the same is expected but no GPU run has checked it yet;
2. a sample that still carries one is cut just before it and marked ``finish_reason="placeholder"``
   (:func:`cut_at_placeholders`): the executors end it as a failure of that sample alone (no gradient, reward 0,
   counted in ``rollout/placeholder_fraction``), never of the step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# The finish reason of a sample cut at a sampled placeholder token.
PLACEHOLDER_FINISH = "placeholder"
# vLLM's SamplingParams clamps every logit bias to [-100, 100].
PLACEHOLDER_LOGIT_BIAS = -100.0
_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def placeholder_token_ids(config: Mapping[str, Any] | Any) -> list[int]:
    """The placeholder and boundary token ids of a vision-language model's ``config`` (a transformers config or
    its ``config.json`` as a dict); empty for a text model (no ``vision_config``)."""
    def get(name: str) -> Any:
        return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

    if get("vision_config") is None:
        return []
    return sorted({int(v) for v in (get(k) for k in _TOKEN_KEYS) if v is not None})


def read_placeholder_token_ids(model_path: str) -> list[int]:
    """:func:`placeholder_token_ids` of the HF model folder ``model_path`` (its ``config.json``); empty when the
    folder has none (an engine given a model by another name leaves the check to the engine's own loading)."""
    path = Path(model_path) / "config.json"
    if not path.is_file():
        return []
    return placeholder_token_ids(json.loads(path.read_text()))


def placeholder_logit_bias(token_ids: Iterable[int]) -> dict[int, float]:
    """vLLM's ``SamplingParams.logit_bias`` that forbids ``token_ids`` (empty: no bias)."""
    return {int(t): PLACEHOLDER_LOGIT_BIAS for t in token_ids}


def cut_at_placeholders(results: Iterable[Any], token_ids: Iterable[int]) -> int:
    """Cut every ``GenerationResult`` whose output holds one of ``token_ids`` just before the first such token (its
    log-probs and recorded routes with it) and mark it ``finish_reason="placeholder"``; returns how many were
    cut. ``results`` are changed in place."""
    banned = frozenset(token_ids)
    if not banned:
        return 0
    cut = 0
    for result in results:
        first = next((i for i, t in enumerate(result.output_ids) if t in banned), None)
        if first is None:
            continue
        result.output_ids = result.output_ids[:first]
        result.output_logprobs = result.output_logprobs[:first]
        if result.routed_experts is not None:
            result.routed_experts = result.routed_experts[:len(result.prompt_ids) + first]
        result.finish_reason = PLACEHOLDER_FINISH
        cut += 1
    return cut


__all__ = ["PLACEHOLDER_FINISH", "PLACEHOLDER_LOGIT_BIAS", "cut_at_placeholders", "placeholder_logit_bias",
           "placeholder_token_ids", "read_placeholder_token_ids"]
