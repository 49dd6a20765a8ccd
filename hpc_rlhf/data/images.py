"""Prompt images: where a row's images are, checked when the data is read, and loaded when a prompt is encoded.

A row names its images in two ways (both may be used; they are taken in the order the messages show them):

* OpenAI-style content parts in its chat messages: ``{"type": "image_url", "image_url": {"url": U}}`` (or
  ``"image_url": U``), ``{"type": "image", "image": U}``; a bare ``{"type": "image"}`` takes the next entry of
  the row's ``images`` column (``data.images_key``);
* an ``images`` column with a string prompt: the images go before the text of the (single) user message.

``U`` is a path relative to the data file's folder, an absolute path, a ``file://`` URL, or a base64 data URL
(``data:image/png;base64,...``); an ``images`` column may also hold HF ``datasets.Image`` values (``{"bytes",
"path"}`` dicts, or decoded ``PIL.Image`` objects). Remote URLs (http, https, ...) are refused: compute nodes have
no internet, and a run must not depend on a server answering during training.

An :class:`ImageRef` keeps a path or the bytes (never the decoded pixels) plus the file and row it came from, so a
prompt stays cheap to hold and to pickle, and every error names the file, row and key at fault.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_rlhf.data.sources import DataError, row_error

IMAGE_PART_TYPES = ("image", "image_url")
# The image formats a prompt, a dataset row or an agent's request may hold. Pillow opens some 40 formats when not
# told which; some run external programs (EPS runs Ghostscript where it is installed, as on many HPC nodes), so a
# file passed off as image/png must not reach them.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def open_image(stream: Any) -> Any:
    """``PIL.Image.open`` restricted to :data:`IMAGE_FORMATS` (anything else raises ``UnidentifiedImageError``)."""
    from PIL import Image

    return Image.open(stream, formats=IMAGE_FORMATS)


def _open_source(path: str) -> Any:
    """A regular file for reading; a named pipe, device or folder is refused before ``open`` (a pipe would block)."""
    if Path(path).exists() and not Path(path).is_file():
        raise ValueError("not a regular file")
    return open(path, "rb")  # closed by the caller's with


@dataclass(frozen=True)
class ImageRef:
    """One prompt image: a local file (``path``) or inline bytes (``data``), and where the row names it."""

    path: str | None
    data: bytes | None
    source: str
    row: int
    key: str

    def describe(self) -> str:
        """What a rollout dump records for this image: its path, or the sha256 of its bytes (never the pixels)."""
        if self.path is not None:
            return self.path
        return "sha256:" + hashlib.sha256(self.data or b"").hexdigest()

    def _fail(self, what: str) -> DataError:
        return row_error(self.source, self.row, self.key, f"image {self.path or '(inline bytes)'}: {what}")

    def load(self) -> Any:
        """The image as an RGB ``PIL.Image``; a missing or unreadable image raises ``DataError`` naming its row."""
        try:
            stream = io.BytesIO(self.data) if self.data is not None else _open_source(self.path or "")
            with stream, open_image(stream) as image:
                return image.convert("RGB")
        except FileNotFoundError:
            raise self._fail("file not found") from None
        except Exception as err:  # noqa: BLE001 - Pillow raises many kinds (DecompressionBombError too): all bad data
            raise self._fail(f"unreadable ({type(err).__name__}: {err})") from None

    def check(self) -> None:
        """Read the image's header (not its pixels): a missing file or a non-image fails when the data is read."""
        try:
            stream = io.BytesIO(self.data) if self.data is not None else _open_source(self.path or "")
            with stream, open_image(stream):
                pass
        except FileNotFoundError:
            raise self._fail("file not found") from None
        except Exception as err:  # noqa: BLE001 - Pillow raises many kinds (DecompressionBombError too): all bad data
            raise self._fail(f"unreadable ({type(err).__name__}: {err})") from None


def _from_string(value: str, source: str, row: int, key: str) -> ImageRef:
    lowered = value[:16].lower()
    if lowered.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            raise row_error(source, row, key,
                            f"data URL {value[:40]!r}... is not base64 (write data:image/...;base64,)")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as err:
            raise row_error(source, row, key, f"data URL holds invalid base64 ({err})") from None
        return ImageRef(None, data, source, row, key)
    if lowered.startswith("file://"):
        return ImageRef(str(Path(value[len("file://"):])), None, source, row, key)
    if "://" in value[:12]:
        raise row_error(source, row, key, f"remote image {value[:80]!r} refused: compute nodes have no internet; "
                        "download it and give a path relative to the data file, a file:// URL or a base64 data URL")
    path = Path(value)
    if not path.is_absolute():  # relative to the data file's folder (to a save_to_disk folder itself)
        path = (Path(source) if Path(source).is_dir() else Path(source).parent) / path
    return ImageRef(str(path), None, source, row, key)


def image_ref(value: Any, source: str, row: int, key: str) -> ImageRef:
    """An :class:`ImageRef` for one image value of a row (see the module docstring for the accepted forms)."""
    if isinstance(value, str):
        return _from_string(value, source, row, key)
    if isinstance(value, dict):  # an HF datasets.Image feature, not decoded: {"bytes": ..., "path": ...}
        if value.get("bytes"):
            return ImageRef(value.get("path"), bytes(value["bytes"]), source, row, key)
        if value.get("path"):
            return _from_string(str(value["path"]), source, row, key)
        if isinstance(value.get("url"), str):
            return _from_string(value["url"], source, row, key)
        raise row_error(source, row, key, f"image object {value!r:.80} has neither bytes nor path")
    if hasattr(value, "save") and hasattr(value, "size"):  # a decoded PIL image (datasets.Image, decode=True)
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return ImageRef(getattr(value, "filename", None) or None, buffer.getvalue(), source, row, key)
    raise row_error(source, row, key, f"an image must be a path, URL or image object, got {type(value).__name__}")


def _part_value(part: dict) -> Any | None:
    """The image a content part names itself, or None for a bare ``{"type": "image"}``."""
    if part["type"] == "image_url":
        url = part.get("image_url")
        return url.get("url") if isinstance(url, dict) else url
    return part.get("image") if part.get("image") is not None else part.get("url")


def has_image_parts(messages: Any) -> bool:
    """Whether chat messages hold any image content part."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in messages)


def row_images(value: Any, column: Any, source: str, row: int, input_key: str,
               images_key: str) -> tuple[ImageRef, ...]:
    """The images of one prompt row, in the order the model sees them.

    ``value`` is the row's prompt (a string or chat messages), ``column`` its ``images_key`` column (None when
    absent). Bare ``{"type": "image"}`` parts take the column's entries in order; with a string prompt the column
    holds all of them. Every column entry must be used exactly once.
    """
    if column is not None and not isinstance(column, (list, tuple)):
        column = [column]
    entries = list(column or [])
    refs: list[ImageRef] = []
    taken = 0
    if isinstance(value, list):
        for message in value:
            content = message.get("content") if isinstance(message, dict) else None
            if not isinstance(content, list):
                continue
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                    continue
                inline = _part_value(part)
                if inline is not None:
                    refs.append(image_ref(inline, source, row, input_key))
                    continue
                if taken >= len(entries):
                    raise row_error(source, row, input_key, f"image part {len(refs)} has no image and the "
                                    f"'{images_key}' column has only {len(entries)} entries")
                refs.append(image_ref(entries[taken], source, row, images_key))
                taken += 1
        if taken < len(entries):
            raise row_error(source, row, images_key, f"{len(entries)} images but the messages have only {taken} "
                            "bare {\"type\": \"image\"} parts to place them")
        return tuple(refs)
    return tuple(image_ref(entry, source, row, images_key) for entry in entries)


def with_image_parts(value: Any, num_images: int) -> Any:
    """A string prompt with ``num_images`` column images -> one user message whose content is the image parts then
    the text (how the chat template places them); chat messages are returned as they are."""
    if isinstance(value, str) and num_images:
        return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": value}]}]
    return value


def require_no_images(refs: tuple[ImageRef, ...], model_path: str | None, model_key: str = "actor.pretrain") -> None:
    """Refuse image prompts for a text-only model, naming the row and the key that holds them."""
    if refs:
        first = refs[0]
        raise row_error(first.source, first.row, first.key,
                        f"this row has {len(refs)} image(s) but {model_key}={model_path!r} is a text-only model: "
                        "use a vision-language model (e.g. Qwen2.5-VL / Qwen3-VL) or drop the images")


__all__ = ["IMAGE_PART_TYPES", "DataError", "ImageRef", "has_image_parts", "image_ref", "require_no_images",
           "row_images", "with_image_parts"]
