"""Image content parts of chat requests to the OpenAI-compatible endpoint (vision-language actors).

A chat message may hold ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` parts (or
``"image_url": "data:..."``, or ``{"type": "image", "image": "data:..."}``), as OpenAI's API and vLLM's server take
them. Only base64 data URLs are accepted: a remote ``http(s)://`` URL is refused (compute nodes have no internet, as
for prompt data), and so is a path or ``file://`` URL (the endpoint reads no files on a client's behalf).

Caps, on top of the endpoint's body cap (``openai_guard``, which bounds the base64 bytes; defaults and config keys in
``endpoint_limits``): at most ``rollout.agent_max_images_per_request`` images per request, and each image's pixel
count (width x height, read from its header before anything is decoded) at most
``rollout.agent_max_pixels_per_image``, so a small compressed file cannot decode into a huge image; the images a request
sends for the first time in its episode at most ``rollout.agent_max_image_pixels_per_request`` pixels together, and
an episode's distinct images at most ``rollout.agent_max_image_pixels_per_episode``. Each distinct image of an
episode is decoded and processed once (:class:`EpisodeImages`), off the endpoint's event loop. The model's image
processor then resizes every image into ``data.min_pixels`` / ``max_pixels`` as for prompt images.

Each image's placeholder in the rendered chat is expanded to its tokens (:meth:`ChatImages.expand`); the request's
:class:`~hpc_rlhf.rollout.visual.PromptVisual` holds every image of the messages in order, so a call's prompt
(and the training row its chain of calls becomes, ``openai_recording``) carries all its images.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Any

import torch

from hpc_rlhf.agents.endpoint_limits import (
    DEFAULT_MAX_EPISODE_PIXELS,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    DEFAULT_MAX_REQUEST_PIXELS,
)
from hpc_rlhf.agents.images import pixel_bounds
from hpc_rlhf.agents.openai_requests import EndpointRequestError
from hpc_rlhf.data.images import IMAGE_PART_TYPES, ImageRef, image_ref, open_image
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.rollout.visual import PromptVisual


def _part_url(part: dict) -> Any:
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image") if part.get("image") is not None else part.get("url")


def _check_pixels(ref: ImageRef, where: str, max_image_pixels: int) -> int:
    """Read the header only: the size is known before any pixel is decoded. Returns width x height."""
    try:
        with open_image(io.BytesIO(ref.data or b"")) as image:
            width, height = image.size
    except Exception as err:  # noqa: BLE001 - PIL raises many kinds (DecompressionBombError included): all a 400
        raise EndpointRequestError(f"'{where}' is not a readable image ({type(err).__name__}: {str(err)[:200]})",
                                   param=where) from None
    if width * height > max_image_pixels:
        raise EndpointRequestError(f"'{where}' is a {width}x{height} image ({width * height} pixels), over the "
                                   f"endpoint's limit of {max_image_pixels} pixels per image "
                                   "(rollout.agent_max_pixels_per_image)", param=where)
    return width * height


def message_image_refs(messages: list[dict], max_images: int = DEFAULT_MAX_IMAGES,
                       max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[ImageRef]:
    """The images of a chat request's (already shape-checked) messages, in order; a 400 naming the part at fault
    for anything but a readable base64 image within the caps (module docstring)."""
    return [ref for ref, _ in message_images(messages, max_images, max_image_pixels)]


def message_images(messages: list[dict], max_images: int = DEFAULT_MAX_IMAGES,
                   max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> list[tuple[ImageRef, int]]:
    """:func:`message_image_refs` with each image's pixel count (from its header)."""
    refs: list[tuple[ImageRef, int]] = []
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
                raise EndpointRequestError(f"the request holds more than {max_images} images, the endpoint's limit "
                                           "(rollout.agent_max_images_per_request)", param=where)
            try:
                ref = image_ref(url, "request", 0, where)
            except ValueError as err:  # DataError: not base64
                raise EndpointRequestError(f"'{where}': {str(err).split(': ', 1)[-1]}", param=where) from None
            refs.append((ref, _check_pixels(ref, where, max_image_pixels)))
    return refs


@dataclass
class EncodedImage:
    """One image of an episode after decoding and the model's processor, kept once however many calls show it."""

    image: Any  # the decoded RGB PIL image (vLLM runs its own processor on it)
    pixel_values: torch.Tensor  # (N_patches, D)
    image_grid_thw: torch.Tensor  # (1, 3)
    num_pixels: int  # width x height as sent


class EpisodeImages:
    """Every distinct image (by content hash) one episode's calls sent, decoded and processed once.

    A chat re-sends its earlier screenshots with every call; each is decoded the first time only, and the calls'
    records point here by hash (:class:`EpisodeVisual`) instead of holding images of their own, so what an episode
    holds grows with its images, not with calls x images. ``max_episode_pixels`` caps the pixels of all of them.
    """

    def __init__(self, max_episode_pixels: int = DEFAULT_MAX_EPISODE_PIXELS) -> None:
        self.max_episode_pixels = max_episode_pixels
        self._lock = threading.Lock()
        self._encoded: dict[str, EncodedImage] = {}

    @property
    def num_pixels(self) -> int:
        with self._lock:
            return sum(e.num_pixels for e in self._encoded.values())

    def get(self, digest: str) -> EncodedImage:
        with self._lock:
            return self._encoded[digest]

    def add(self, vision: VisionPromptEncoder, images: list[tuple[ImageRef, int]],
            max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS) -> tuple[str, ...]:
        """Decode and process the images not seen before (one processor call); their hashes, in order. A 400
        naming the cap and its key when the new images pass ``max_request_pixels`` or the episode's total passes
        ``max_episode_pixels``. Runs off the event loop (``openai_endpoint``)."""
        digests = tuple(ref.describe() for ref, _ in images)
        with self._lock:
            new = {d: (ref, pixels) for d, (ref, pixels) in zip(digests, images, strict=True) if d not in self._encoded}
            held = sum(e.num_pixels for e in self._encoded.values())
        request_pixels = sum(pixels for _, pixels in new.values())
        if request_pixels > max_request_pixels:
            raise EndpointRequestError(
                f"the request's new images hold {request_pixels} pixels, over the endpoint's limit of "
                f"{max_request_pixels} decoded pixels per request (rollout.agent_max_image_pixels_per_request)",
                param="messages")
        if held + request_pixels > self.max_episode_pixels:
            raise EndpointRequestError(
                f"the episode's images would hold {held + request_pixels} pixels, over the endpoint's limit of "
                f"{self.max_episode_pixels} decoded pixels per episode (rollout.agent_max_image_pixels_per_episode)",
                param="messages")
        if new:
            decoded = [ref.load() for ref, _ in new.values()]  # header-checked already: a failure here is a 400 too
            pixel_values, grid = vision.encode_images(decoded)
            rows = torch.split(pixel_values, [int(n) for n in grid.prod(dim=-1)])
            with self._lock:
                for k, digest in enumerate(new):
                    self._encoded[digest] = EncodedImage(decoded[k], rows[k], grid[k: k + 1], new[digest][1])
        return digests


@dataclass(frozen=True)
class EpisodeVisual:
    """A call's images as hashes into its episode's :class:`EpisodeImages` (what a record keeps): ``refs`` in
    message order, ``materialize()`` the :class:`PromptVisual` an engine request or a training row needs."""

    store: EpisodeImages
    vision: VisionPromptEncoder
    refs: tuple[str, ...]

    def materialize(self) -> PromptVisual:
        encoded = [self.store.get(d) for d in self.refs]
        return PromptVisual(torch.cat([e.pixel_values for e in encoded]),
                            torch.cat([e.image_grid_thw for e in encoded]), self.vision.image_token_id,
                            self.vision.merge_size, self.refs, tuple(e.image for e in encoded),
                            pixel_bounds(self.vision))


def row_visual(visual: Any) -> PromptVisual | None:
    """The :class:`PromptVisual` of a training row from what a record kept (an :class:`EpisodeVisual` or None)."""
    return visual.materialize() if isinstance(visual, EpisodeVisual) else visual


@dataclass
class ChatImages:
    """The images of one chat request after the model's processor: ``visual`` (every image, in message order) and
    ``kept`` (the same, as the request's record keeps them)."""

    vision: VisionPromptEncoder
    visual: PromptVisual
    kept: EpisodeVisual

    @classmethod
    def encode(cls, vision: VisionPromptEncoder, images: list[tuple[ImageRef, int]], store: EpisodeImages,
               max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS) -> ChatImages:
        kept = EpisodeVisual(store, vision, store.add(vision, images, max_request_pixels))
        return cls(vision, kept.materialize(), kept)

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


__all__ = ["DEFAULT_MAX_EPISODE_PIXELS", "DEFAULT_MAX_IMAGES", "DEFAULT_MAX_IMAGE_PIXELS", "DEFAULT_MAX_REQUEST_PIXELS",
           "ChatImages", "EpisodeImages", "EpisodeVisual", "message_image_refs", "message_images",
           "refuse_image_tokens", "row_visual"]
