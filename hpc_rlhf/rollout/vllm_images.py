"""Prompts with images for vLLM: ``TokensPrompt`` keywords with ``multi_modal_data``.

vLLM runs the model's own HF processor on ``multi_modal_data["image"]`` (PIL images) and matches the resulting image
features to the image placeholder tokens already expanded in ``prompt_token_ids``; ``mm_processor_kwargs`` carries
the same pixel bounds our encoder used (``data.min_pixels`` / ``max_pixels``), so its grids, and therefore its
image token counts, equal ours.

GPU only, and a hypothesis: nothing here has run. vLLM 0.32's CPU build cannot load Qwen-VL without torchvision
(its model files import transformers' torchvision image processors at module level, and only CUDA torchvision
wheels exist, which break ``import transformers`` next to the CPU torch), so the CPU path refuses images
(:func:`require_vllm_images_supported`). The keywords are checked against vLLM's ``TokensPrompt`` fields by a unit
test where vLLM is installed.
"""

from __future__ import annotations

from typing import Any

from hpc_rlhf.rollout.base import GenerationRequest


def tokens_prompt_kwargs(request: GenerationRequest) -> dict[str, Any]:
    """Keywords of ``vllm.TokensPrompt`` for one request: its token ids, and its images when it has any."""
    kwargs: dict[str, Any] = {"prompt_token_ids": list(request.prompt_ids)}
    visual = request.visual
    if visual is None:
        return kwargs
    if len(visual.images) != visual.num_images:
        raise ValueError("a request with images for vLLM needs the decoded images (PromptVisual.images): vLLM runs "
                         "its own processor on them")
    kwargs["multi_modal_data"] = {"image": list(visual.images)}
    if visual.pixel_bounds is not None:
        kwargs["mm_processor_kwargs"] = {"min_pixels": visual.pixel_bounds[0], "max_pixels": visual.pixel_bounds[1]}
    return kwargs


def require_vllm_images_supported(requests: list[GenerationRequest], on_gpu: bool) -> None:
    """Refuse image requests on vLLM's CPU build (see the module docstring)."""
    if not on_gpu and any(r.visual is not None for r in requests):
        raise NotImplementedError("vLLM rollout with images needs a GPU: vLLM's CPU build cannot load Qwen-VL "
                                  "without torchvision; use rollout.backend=transformers on CPU (docs/vlm.md)")
