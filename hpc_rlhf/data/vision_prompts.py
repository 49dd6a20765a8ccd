"""Prompts with images -> token ids and :class:`PromptVisual`, through the model's own image processor.

The chat template writes one image placeholder token per image (``<|image_pad|>`` for Qwen-VL). The model's image
processor (``AutoImageProcessor`` of the model folder: transformers' PIL processor when torchvision is absent)
resizes each image so its area lies within ``[min_pixels, max_pixels]`` (``data.min_pixels`` / ``max_pixels``,
else the processor's own), keeping the aspect ratio and rounding each side to whole merged patches, and cuts it into
patches. Each placeholder is then expanded to the image's ``t * h * w / merge**2`` tokens, as the model's processor
does. An image over the pixel budget is resized, never cut: a prompt whose image tokens do not fit
``data.prompt_max_len`` is refused, naming its row, instead of truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hpc_rlhf.data.prompts import Prompt, tokenize_prompts
from hpc_rlhf.data.sources import row_error
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, token_id, token_text
from hpc_rlhf.rollout.visual import PromptVisual


class VisionPromptEncoder:
    """Encodes prompts with images for one vision-language model.

    Args:
        image_processor: the model's image processor (``merge_size`` and ``patch_size`` attributes, Qwen-VL style).
        tokenizer: the model's tokenizer.
        image_token: the placeholder token the chat template writes per image.
        min_pixels / max_pixels: the image area bounds (None: the processor's own).
    """

    def __init__(self, image_processor: Any, tokenizer: Tokenizer, image_token: str, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = image_token
        self.image_token_id = token_id(tokenizer, image_token)
        self.merge_size = int(image_processor.merge_size)
        size = dict(getattr(image_processor, "size", None) or {})
        self.size = {"shortest_edge": min_pixels or size.get("shortest_edge"),
                     "longest_edge": max_pixels or size.get("longest_edge")}

    @classmethod
    def from_pretrained(cls, path: str, tokenizer: Tokenizer, config: Any, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> VisionPromptEncoder:
        """The encoder of the model folder ``path`` (its ``preprocessor_config.json``); ``config``: the model's."""
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(path)
        token = token_text(tokenizer, int(config.image_token_id))
        return cls(image_processor, tokenizer, token, min_pixels, max_pixels)

    def encode_images(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """RGB PIL images -> ``(pixel_values (N, D) fp32, image_grid_thw (I, 3) long)``."""
        out = self.image_processor(images=list(images), size=self.size, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def expand(self, text: str, image_grid_thw: torch.Tensor) -> str:
        """``text`` with the i-th placeholder repeated for image i's tokens."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != image_grid_thw.shape[0]:
            raise ValueError(f"the prompt text holds {len(pieces) - 1} image placeholders ({self.image_token!r}) for "
                             f"{image_grid_thw.shape[0]} images")
        out = [pieces[0]]
        for grid, piece in zip(image_grid_thw.tolist(), pieces[1:], strict=True):
            out.append(self.image_token * (grid[0] * grid[1] * grid[2] // self.merge_size ** 2) + piece)
        return "".join(out)

    def encode(self, prompt: Prompt, prompt_max_len: int) -> tuple[list[int], PromptVisual]:
        """One prompt with images -> its token ids (image tokens expanded) and its :class:`PromptVisual`."""
        images = [ref.load() for ref in prompt.images]
        pixel_values, grid = self.encode_images(images)
        try:
            text = self.expand(prompt.text, grid)
        except ValueError as err:
            raise row_error(prompt.source, prompt.index, prompt.images[0].key, str(err)) from None
        ids = tokenize_prompts(self.tokenizer, [text], 1 << 30)[0]
        if len(ids) > prompt_max_len:
            raise row_error(prompt.source, prompt.index, prompt.images[0].key,
                            f"the prompt is {len(ids)} tokens with its images, over data.prompt_max_len="
                            f"{prompt_max_len}; image tokens are never cut: raise data.prompt_max_len or lower "
                            "data.max_pixels")
        bounds = (int(self.size["shortest_edge"]), int(self.size["longest_edge"])) \
            if self.size["shortest_edge"] and self.size["longest_edge"] else None
        visual = PromptVisual(pixel_values, grid, self.image_token_id, self.merge_size,
                              tuple(ref.describe() for ref in prompt.images), tuple(images), bounds)
        return ids, visual


def encode_prompts(prompts: Sequence[Prompt], tokenizer: Tokenizer, prompt_max_len: int,
                   vision: VisionPromptEncoder | None) -> tuple[list[list[int]], list[PromptVisual | None]]:
    """Token ids of every prompt and the visual part of those with images (None for text prompts): text prompts are
    tokenized together as before (``tokenize_prompts``), image prompts one by one through ``vision``."""
    text_rows = [i for i, p in enumerate(prompts) if not p.images]
    ids: list[list[int]] = [[] for _ in prompts]
    visuals: list[PromptVisual | None] = [None] * len(prompts)
    for i, row_ids in zip(text_rows, tokenize_prompts(tokenizer, [prompts[i].text for i in text_rows],
                                                      prompt_max_len), strict=True):
        ids[i] = row_ids
    for i, prompt in enumerate(prompts):
        if prompt.images:
            if vision is None:
                raise row_error(prompt.source, prompt.index, prompt.images[0].key,
                                "a prompt with images reached an executor without a vision-language model's "
                                "image processor")
            ids[i], visuals[i] = vision.encode(prompt, prompt_max_len)
    return ids, visuals
