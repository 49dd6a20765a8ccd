"""Images in agent episodes: prompt images after ``reset``, screenshots in environment feedback, and the one
:class:`~hpc_rlhf.rollout.visual.PromptVisual` that an episode's token sequence carries.

A multi-turn episode is one token sequence (``prompt_ids + response_ids``); every image in it - the prompt's, then
each feedback's, in the order their tokens appear - is one entry of the episode's ``PromptVisual``, which grows as
feedback arrives. So each turn's request and the trajectory carry every image, with its grid, in sequence order:
what the rollout engine's prefill and the training forwards (M-RoPE positions over all images,
``hpc_rlhf.models.mrope``) need. Image tokens are feedback / prompt tokens (``action_mask`` 0): never trained.

Feedback images (``AgentInstance.step``'s ``environment_images``): PIL images, paths (absolute, or relative to the
working directory), ``file://`` URLs or base64 data URLs; remote URLs are refused as in prompt data. The feedback
text places them with the model's image placeholder (``<|image_pad|>``, one per image, as the chat template writes
it, e.g. ``<|vision_start|><|image_pad|><|vision_end|>``: :func:`image_placeholder`); a feedback text without any
gets one placeholder block per image at its start. Each placeholder is expanded to the image's tokens by the
model's image processor (``data.min_pixels`` / ``max_pixels`` apply), exactly as for prompt images.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import torch

from hpc_rlhf.data.images import ImageRef, image_ref
from hpc_rlhf.data.prompts import Prompt
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.rollout.visual import PromptVisual

FEEDBACK_IMAGES_KEY = "environment_images"
_VISION_START, _VISION_END = "<|vision_start|>", "<|vision_end|>"


class AgentImageError(ValueError):
    """Images an agent returned that cannot be used (no vision-language model, unreadable, placeholders that do
    not match): the episode fails with this message, the run goes on."""


def image_placeholder(vision: VisionPromptEncoder) -> str:
    """The text one image takes before expansion, as Qwen-VL chat templates write it: the vision start and end
    tokens around the image placeholder (the placeholder alone when the tokenizer has no such markers)."""
    vocab = vision.tokenizer.get_vocab()
    if _VISION_START in vocab and _VISION_END in vocab:
        return _VISION_START + vision.image_token + _VISION_END
    return vision.image_token


def feedback_image_refs(values: Any, prompt: Prompt) -> tuple[ImageRef, ...]:
    """``ImageRef`` of each feedback image (module docstring); errors name the prompt's row and the key."""
    if values is None:
        return ()
    if not isinstance(values, (list, tuple)):
        values = [values]
    refs = []
    for value in values:
        if isinstance(value, str) and "://" not in value[:12] and not value[:5].lower().startswith("data:"):
            value = os.path.abspath(value)  # a feedback path is the agent's: relative to its working directory
        try:
            refs.append(image_ref(value, prompt.source, prompt.index, FEEDBACK_IMAGES_KEY))
        except ValueError as err:
            raise AgentImageError(str(err)) from None
    return tuple(refs)


def _loaded(refs: Sequence[ImageRef]) -> list[Any]:
    try:
        return [ref.load() for ref in refs]
    except ValueError as err:  # DataError: a missing or unreadable image, named with its row
        raise AgentImageError(str(err)) from None


def extend_visual(visual: PromptVisual | None, vision: VisionPromptEncoder, pixel_values: torch.Tensor,
                  image_grid_thw: torch.Tensor, refs: Sequence[str], images: Sequence[Any]) -> PromptVisual:
    """``visual`` with more images after its own (a new ``PromptVisual``: the old one may be shared by the other
    samples of the prompt). ``pixel_values`` (N, D), ``image_grid_thw`` (I, 3) of the new images."""
    if visual is None:
        return PromptVisual(pixel_values, image_grid_thw, vision.image_token_id, vision.merge_size, tuple(refs),
                            tuple(images), pixel_bounds(vision))
    return dataclasses.replace(
        visual, pixel_values=torch.cat([visual.pixel_values, pixel_values]),
        image_grid_thw=torch.cat([visual.image_grid_thw, image_grid_thw]), refs=visual.refs + tuple(refs),
        images=visual.images + tuple(images))


def pixel_bounds(vision: VisionPromptEncoder) -> tuple[int, int] | None:
    """(min_pixels, max_pixels) the image processor resizes into (``PromptVisual.pixel_bounds``), or None."""
    low, high = vision.size.get("shortest_edge"), vision.size.get("longest_edge")
    return (int(low), int(high)) if low and high else None


def encode_observation(vision: VisionPromptEncoder | None, prompt: Prompt, text: str,
                       prompt_max_len: int) -> tuple[list[int], PromptVisual | None] | None:
    """The first prompt of an episode whose data row has images: ``text`` (the ``reset`` observation, which must
    keep the row's image placeholders) with the row's images, through the model's processor (never truncated:
    too long is refused naming the row). None for a prompt without images (the caller tokenizes the text)."""
    if not prompt.images:
        return None
    if vision is None:
        raise AgentImageError(f"{prompt.source} row {prompt.index} has images but the executor has no "
                              "vision-language image processor")
    return vision.encode(dataclasses.replace(prompt, text=text), prompt_max_len)


def feedback_tokens(vision: VisionPromptEncoder | None, tokenizer: Tokenizer, feedback: str, values: Any,
                    prompt: Prompt, visual: PromptVisual | None) -> tuple[list[int], PromptVisual | None]:
    """Token ids of one environment feedback (no special tokens added) and the episode's visual after it.

    ``values``: the step's ``environment_images`` (None / empty for text feedback, which is tokenized as before).
    ``visual``: the episode's images so far (None: none yet). Raises :class:`AgentImageError` for images the
    model cannot take.
    """
    refs = feedback_image_refs(values, prompt)
    if not refs:
        ids = list(tokenizer.encode(feedback, add_special_tokens=False)) if feedback else []
        refuse_stray_placeholders(ids, None, vision, f"environment_feedback without {FEEDBACK_IMAGES_KEY}")
        return ids, visual
    if vision is None:
        raise AgentImageError(f"step returned {len(refs)} {FEEDBACK_IMAGES_KEY} but the actor is a text-only model "
                              "(actor.pretrain): images need a vision-language model")
    count = feedback.count(vision.image_token)
    if count == 0:  # placed where a chat template puts a user message's images: before its text
        feedback = image_placeholder(vision) * len(refs) + feedback
    elif count != len(refs):
        raise AgentImageError(f"environment_feedback holds {count} image placeholders ({vision.image_token!r}) for "
                              f"{len(refs)} {FEEDBACK_IMAGES_KEY}: give one per image, or none to put them first")
    images = _loaded(refs)
    pixel_values, grid = vision.encode_images(images)
    ids = list(tokenizer.encode(vision.expand(feedback, grid), add_special_tokens=False))
    return ids, extend_visual(visual, vision, pixel_values, grid, [r.describe() for r in refs], images)


def refuse_stray_placeholders(ids: Sequence[int], visual: PromptVisual | None, vision: VisionPromptEncoder | None,
                              what: str) -> None:
    """Raise :class:`AgentImageError` when agent text tokenized to ``ids`` holds image placeholder tokens that no
    image of ``visual`` stands behind (the placeholder string in a ``reset`` observation or a text feedback): the
    step batch's M-RoPE positions and the engines' prefill would fail on them for the whole step, not this
    episode. No-op for a text-only model (``vision`` None)."""
    if vision is None:
        return
    expected = visual.num_image_tokens() if visual is not None else 0
    found = sum(1 for token in ids if token == vision.image_token_id)
    if found != expected:
        raise AgentImageError(f"{what} holds {found - expected} image placeholder token(s) ({vision.image_token!r}) "
                              "with no image behind them; only the image processor may place them: remove the "
                              f"placeholder from the text, or pass the image in {FEEDBACK_IMAGES_KEY}")


__all__ = ["FEEDBACK_IMAGES_KEY", "AgentImageError", "encode_observation", "extend_visual", "feedback_image_refs",
           "feedback_tokens", "image_placeholder", "pixel_bounds",
           "refuse_stray_placeholders"]
