"""Image content parts of chat requests to the OpenAI-compatible endpoint (vision-language actors).

A chat message may hold ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` parts (or
``"image_url": "data:..."``, or ``{"type": "image", "image": "data:..."}``), as OpenAI's API and vLLM's server take
them. Only base64 data URLs are accepted: a remote ``http(s)://`` URL is refused (compute nodes have no internet, as
for prompt data), and so is a path or ``file://`` URL (the endpoint reads no files on a client's behalf).

Caps, on top of the endpoint's body cap (``openai_guard``, which bounds the base64 bytes): at most ``max_images``
images per request, and each image's pixel count (width x height, read from its header before anything is decoded)
at most ``max_image_pixels``, so a small compressed file cannot decode into a huge image. The model's image
processor then resizes every image into ``data.min_pixels`` / ``max_pixels`` as for prompt images.

Each image's placeholder in the rendered chat is expanded to its tokens (:meth:`ChatImages.expand`); the request's
:class:`~hpc_rlhf.rollout.visual.PromptVisual` holds every image of the messages in order, so a call's prompt
(and the training row its chain of calls becomes, ``openai_recording``) carries all its images.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from hpc_rlhf.agents.openai_requests import EndpointRequestError
from hpc_rlhf.data.images import IMAGE_PART_TYPES, ImageRef, image_ref, open_image
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.rollout.visual import PromptVisual

DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGES = 32


def _part_url(part: dict) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image") if part.get("image") is not None else part.get("url")


def _check_pixels(ref: ImageRef, where: str, max_image_pixels: int) -> None:
    """Read the header only: the size is known before any pixel is decoded."""
    try:
        with open_image(io.BytesIO(ref.data or b"")) as image:
            width, height = image.size
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds (DecompressionBombError included): all a 400
        raise EndpointRequestError(f"'{where}' is not a readable image ({type(err).__name__}: {str(err)[:200]})",
                                   param=where) from None
    if width * height > max_image_pixels:
        raise EndpointRequestError(f"'{where}' is a {width}x{height} image ({width * height} pixels), over the "
                                   f"endpoint's limit of {max_image_pixels} pixels per image", param=where)


def message_image_refs(messages: list[dict], max_images: int = DEFAULT_MAX_IMAGES,
                       max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[ImageRef]:
    """The images of a chat request's (already shape-checked) messages, in order; a 400 naming the part at fault
    for anything but a readable base64 image within the caps (module docstring)."""
    refs: list[ImageRef] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") not in IMAGE_PART_TYPES:
                continue
            where = f"messages[{i}].content[{j}]"
            url = _part_url(part)
            if not isinstance(url, str) or not url:
                raise EndpointRequestError(f"'{where}' has no image URL (give image_url.url as a base64 data URL)",
                                           param=where)
            if "://" in url[:12] and not url[:5].lower().startswith("data:"):
                if url[:7].lower().startswith("file://"):
                    raise EndpointRequestError(f"'{where}': file URLs are refused (the endpoint reads no files); "
                                               "send the image as a base64 data URL (data:image/png;base64,...)",
                                               param=where)
                raise EndpointRequestError(f"'{where}': remote image URL {url[:80]!r} refused: compute nodes have no "
                                           "internet; send the image as a base64 data URL (data:image/png;base64,...)",
                                           param=where)
            if not url[:5].lower().startswith("data:"):
                raise EndpointRequestError(f"'{where}': only base64 data URLs (data:image/png;base64,...) are "
                                           "accepted; the endpoint reads no files", param=where)
            if len(refs) >= max_images:
                raise EndpointRequestError(f"the request holds more than {max_images} images, the endpoint's limit",
                                           param=where)
            try:
                ref = image_ref(url, "request", 0, where)
            except ValueError as err:  # DataError: not base64
                raise EndpointRequestError(f"'{where}': {str(err).split(': ', 1)[-1]}", param=where) from None
            _check_pixels(ref, where, max_image_pixels)
            refs.append(ref)
    return refs


@dataclass
class ChatImages:
    """The images of one chat request after the model's processor: ``visual`` (every image, in message order)."""

    vision: VisionPromptEncoder
    visual: PromptVisual

    @classmethod
    def encode(cls, vision: VisionPromptEncoder, refs: list[ImageRef]) -> ChatImages:
        images = [ref.load() for ref in refs]  # header-checked already: a failure here is a 400 too
        pixel_values, grid = vision.encode_images(images)
        low, high = vision.size.get("shortest_edge"), vision.size.get("longest_edge")
        visual = PromptVisual(pixel_values, grid, vision.image_token_id, vision.merge_size,
                              tuple(ref.describe() for ref in refs), tuple(images),
                              (int(low), int(high)) if low and high else None)
        return cls(vision, visual)

    def check_rendered(self, text: str) -> None:
        """The rendered chat must place every image once (a template that drops images from some role, or text
        that holds the placeholder itself, would misalign images and tokens)."""
        count = text.count(self.vision.image_token)
        if count != self.visual.num_images:
            raise EndpointRequestError(
                f"the chat template rendered {count} image placeholders ({self.vision.image_token!r}) for the "
                f"request's {self.visual.num_images} images: put images in user (or tool) messages, and no "
                "placeholder tokens in text", param="messages")

    def expand(self, text: str) -> str:
        """``text``, a suffix of the rendered chat, with each of its placeholders expanded to its image's tokens:
        the placeholders of a suffix are those of the last images."""
        count = text.count(self.vision.image_token)
        if count == 0:
            return text
        if count > self.visual.num_images:
            raise EndpointRequestError(f"the rendered chat holds more image placeholders ({self.vision.image_token!r}) "
                                       f"than the request's {self.visual.num_images} images: no placeholder tokens in "
                                       "text", param="messages")
        return self.vision.expand(text, self.visual.image_grid_thw[self.visual.num_images - count:])


def refuse_image_tokens(prompt_ids: list[int], vision: VisionPromptEncoder | None, param: str) -> None:
    """A prompt without images (a completion, a chat without image parts) may not hold image placeholder tokens:
    the engine would have no image to put there."""
    if vision is not None and vision.image_token_id in prompt_ids:
        raise EndpointRequestError(f"the prompt holds image placeholder tokens ({vision.image_token!r}) but no "
                                   "images: send images as chat image_url content parts (base64 data URLs)",
                                   param=param)


__all__ = ["DEFAULT_MAX_IMAGES", "DEFAULT_MAX_IMAGE_PIXELS", "ChatImages", "message_image_refs",
           "refuse_image_tokens"]
