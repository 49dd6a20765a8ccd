"""SFT rows with images: token samples whose image placeholders are expanded, and their images per micro-batch.

A row names its images as prompt rows do (:mod:`hpc_rlhf.data.images`): OpenAI-style content parts in its chat
messages (``data.messages_key``, or a chat prompt in ``data.input_key``) and / or an images column
(``data.images_key``; with a string prompt the images go before its text). The chat template writes one
placeholder per image; each placeholder is expanded to the image's tokens through the model's own image processor
(:class:`hpc_rlhf.data.vision_prompts.VisionPromptEncoder`, ``data.min_pixels`` / ``max_pixels``), exactly as a
prompt at generation time. Image tokens are never trained on (they sit in user turns; any image token is masked out
of the loss besides), and never cut: a sample whose image tokens do not fit ``data.max_len`` is refused naming its
row.

A :class:`VisionTokenSample` keeps the image references and grid sizes, not the pixels: the pixels of a
micro-batch are decoded and processed when it is laid out (:func:`visual_inputs`), so a large image dataset never
sits in memory as tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpc_rlhf.data.images import ImageRef, require_no_images, row_images, with_image_parts
from hpc_rlhf.data.packing import CollatedBatch, TokenSample
from hpc_rlhf.data.preference import PreferencePair, _response_pieces, make_pair, row_margin
from hpc_rlhf.data.sft import Piece, TextFormatter, make_sft_example
from hpc_rlhf.data.sources import row_error
from hpc_rlhf.data.vision_prompts import VisionPromptEncoder
from hpc_rlhf.models.mrope import mrope_positions
from hpc_rlhf.models.tokenizer_protocol import Tokenizer
from hpc_rlhf.models.vision import is_vision_language


@dataclass(frozen=True)
class VisionTokenSample(TokenSample):
    """A :class:`TokenSample` whose ``input_ids`` hold the expanded tokens of ``images`` (in order)."""

    images: tuple[ImageRef, ...] = ()
    image_grid_thw: tuple[tuple[int, int, int], ...] = ()
    """Each image's (temporal, height, width) patch grid after the processor's resize."""


def expand_pieces(pieces: list[Piece], encoder: VisionPromptEncoder, grid: torch.Tensor) -> list[Piece]:
    """Each piece's image placeholders repeated for their images' tokens, images taken in order over the pieces."""
    out: list[Piece] = []
    taken = 0
    for text, trained in pieces:
        count = text.count(encoder.image_token)
        out.append((encoder.expand(text, grid[taken:taken + count]) if count else text, trained))
        taken += count
    if taken != grid.shape[0]:
        raise ValueError(f"the rendered chat holds {taken} image placeholders ({encoder.image_token!r}) for "
                         f"{grid.shape[0]} images")
    return out


def make_vision_sft_example(formatter: TextFormatter, data: Any,
                            encoder: VisionPromptEncoder) -> Callable[[Any, str, int], TokenSample | None]:
    """Row -> :class:`VisionTokenSample` (a plain :class:`TokenSample` for a row without images), for the ``data``
    section's SFT keys. Every image is decoded once here (a missing or unreadable one fails naming its row)."""
    text_make = make_sft_example(formatter, data)
    if data.pretrain_mode:
        return text_make  # plain text: no images to place

    def make(row: Any, path: str, index: int) -> TokenSample | None:
        if not isinstance(row, dict):
            return text_make(row, path, index)
        key = data.messages_key or data.input_key
        column = row.get(data.images_key)
        refs = row_images(row.get(key), column, path, index, key, data.images_key)
        if not refs:
            return text_make(row, path, index)
        grid = encoder.encode_images([ref.load() for ref in refs])[1]
        if data.messages_key:
            messages = row[data.messages_key]
            if not isinstance(messages, list):
                raise row_error(path, index, key, "expected a list of chat messages")
            pieces = formatter.conversation(messages, path, index, key)
        else:
            if not formatter.apply_chat_template:
                raise row_error(path, index, data.images_key, "rows with images need data.apply_chat_template=true "
                                "(the model's chat template places the images)")
            prompt = with_image_parts(row.get(key), len(refs))
            if not isinstance(prompt, (str, list)):
                raise row_error(path, index, key, f"expected a string or chat messages, got {type(prompt).__name__}")
            response = row.get(data.output_key)
            if not isinstance(response, str) or not response.strip():
                raise row_error(path, index, data.output_key, "missing or empty response")
            pieces = formatter.prompt_response(prompt, response, path, index, data.output_key)
        try:
            pieces = expand_pieces(pieces, encoder, grid)
        except ValueError as err:
            raise row_error(path, index, refs[0].key, str(err)) from None
        num_image_tokens = int(grid.prod(dim=-1).sum()) // encoder.merge_size ** 2
        sample = tokenize_with_images(formatter, pieces, encoder.image_token_id, num_image_tokens)
        if sample is None:
            if sum(len(formatter.tokenizer.encode(t, add_special_tokens=False)) for t, _ in pieces) > formatter.max_len:
                raise row_error(path, index, refs[0].key, f"the sample is over data.max_len={formatter.max_len} "
                                "tokens with its images; image tokens are never cut: raise data.max_len or lower "
                                "data.max_pixels")
            return None
        return VisionTokenSample(sample.input_ids, sample.loss_mask, refs,
                                 tuple((int(t), int(h), int(w)) for t, h, w in grid.tolist()))

    return make


def tokenize_with_images(formatter: TextFormatter, pieces: list[Piece], image_token_id: int,
                         num_image_tokens: int) -> TokenSample | None:
    """``formatter.tokenize`` with every image token masked out of the loss; None when truncation to
    ``data.max_len`` would cut an image token (or leaves nothing to train on)."""
    sample = formatter.tokenize(pieces)
    if sample is None or sum(t == image_token_id for t in sample.input_ids) != num_image_tokens:
        return None
    mask = tuple(m and t != image_token_id for t, m in zip(sample.input_ids, sample.loss_mask, strict=True))
    return TokenSample(sample.input_ids, mask)


def visual_inputs(samples: Sequence[TokenSample], batch: CollatedBatch,
                  encoder: VisionPromptEncoder) -> dict[str, torch.Tensor]:
    """The image inputs of a micro-batch laid out as ``batch`` (padded or packed, :func:`collate` of ``samples``).

    Returns ``pixel_values`` (N, D) fp32 and ``image_grid_thw`` (I, 3) long of every image, in the order the
    batch's tokens show them when read row by row (the order in which the model fills image tokens), and
    ``mrope_position_ids`` (R, T, 3) long: each sample's M-RoPE positions (:mod:`hpc_rlhf.models.mrope`) at its
    columns, 0 on padding. The first two are absent when no sample has an image.
    """
    segment_ids = batch["segment_ids"]
    positions = torch.zeros(*segment_ids.shape, 3, dtype=torch.long)
    order: list[int] = []
    for r in range(segment_ids.shape[0]):
        for s in segment_ids[r].tolist():
            if s >= 0 and (not order or order[-1] != s):
                order.append(s)
    empty = torch.zeros(0, 3, dtype=torch.long)
    for s, sample in enumerate(samples):
        grid = torch.tensor(getattr(sample, "image_grid_thw", ()), dtype=torch.long).reshape(-1, 3)
        where = segment_ids == s
        positions[where] = mrope_positions(torch.tensor(sample.input_ids), grid if grid.numel() else empty,
                                           encoder.image_token_id, encoder.merge_size)
    images = [ref for s in order for ref in getattr(samples[s], "images", ())]
    out = {"mrope_position_ids": positions}
    if images:
        pixel_values, grid = encoder.encode_images([ref.load() for ref in images])
        expected = torch.tensor([g for s in order for g in getattr(samples[s], "image_grid_thw", ())])
        if not torch.equal(grid, expected):  # an image file changed since the data was read
            raise ValueError(f"images {[ref.describe() for ref in images]} gave patch grids {grid.tolist()} but "
                             f"{expected.tolist()} when the data was read: did an image file change during the run?")
        out.update(pixel_values=pixel_values, image_grid_thw=grid)
    return out


def sft_vision_encoder(model_dir: str, tokenizer: Tokenizer, data: Any) -> VisionPromptEncoder | None:
    """The image encoder of a vision-language model folder (``data.min_pixels`` / ``max_pixels``); None for a
    text-only model."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    if not is_vision_language(config):
        return None
    return VisionPromptEncoder.from_pretrained(model_dir, tokenizer, config, data.min_pixels, data.max_pixels)


def refuse_images(make: Callable[[Any, str, int], Any], data: Any,
                  model_dir: str) -> Callable[[Any, str, int], Any]:
    """``make`` for a text-only model: a row with images is refused naming its row, key and ``model.pretrain``."""
    def checked(row: Any, path: str, index: int) -> Any:
        if isinstance(row, dict) and not data.pretrain_mode:
            key = data.messages_key or data.input_key
            refs = row_images(row.get(key), row.get(data.images_key), path, index, key, data.images_key)
            if refs:
                require_no_images(refs, model_dir, "model.pretrain")
        return make(row, path, index)

    return checked


def make_vision_pair(formatter: TextFormatter, data: Any,
                     encoder: VisionPromptEncoder) -> Callable[[Any, str, int], Any]:
    """Row -> :class:`hpc_rlhf.data.preference.PreferencePair` whose chosen and rejected samples carry the prompt's
    images (DPO with images): the prompt (``data.prompt_key``, chat messages with image parts and / or the
    ``images_key`` column) is shared, each answer is trained as for SFT; a row without images is a text pair."""
    text_make = make_pair(formatter, data)

    def make(row: Any, path: str, index: int) -> Any:
        key = data.prompt_key or data.chosen_key
        if not isinstance(row, dict):
            return text_make(row, path, index)
        refs = row_images(row.get(key), row.get(data.images_key), path, index, key, data.images_key)
        if not refs:
            return text_make(row, path, index)
        if data.prompt_key is None:
            raise row_error(path, index, data.images_key, "preference rows with images need data.prompt_key (the "
                            "shared prompt that holds the images)")
        grid = encoder.encode_images([ref.load() for ref in refs])[1]
        prompted = dict(row)
        prompted[data.prompt_key] = with_image_parts(row[data.prompt_key], len(refs))
        num_image_tokens = int(grid.prod(dim=-1).sum()) // encoder.merge_size ** 2
        samples = []
        for answer_key in (data.chosen_key, data.rejected_key):
            pieces = _response_pieces(formatter, prompted, data, answer_key, path, index)
            try:
                pieces = expand_pieces(pieces, encoder, grid)
            except ValueError as err:
                raise row_error(path, index, refs[0].key, str(err)) from None
            sample = tokenize_with_images(formatter, pieces, encoder.image_token_id, num_image_tokens)
            if sample is None:
                raise row_error(path, index, answer_key, f"no answer token fits in data.max_len={formatter.max_len} "
                                "with the prompt's images (image tokens are never cut): raise data.max_len or lower "
                                "data.max_pixels")
            samples.append(VisionTokenSample(sample.input_ids, sample.loss_mask, refs,
                                             tuple((int(t), int(h), int(w)) for t, h, w in grid.tolist())))
        return PreferencePair(samples[0], samples[1], row_margin(row, data, path, index))

    return make
