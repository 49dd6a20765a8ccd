"""Decode an HTTP answer's ``Content-Encoding`` without ever holding more than a cap of decoded bytes.

httpx decodes each chunk it reads in one call, and chains every coding a server lists: ``gzip, gzip, gzip`` turns
3 kB on the wire into gigabytes inside one ``iter_bytes`` step, before a caller can count them. The reward-model
client therefore reads the raw bytes (``iter_raw``) and decodes them here: at most one coding (``gzip`` or
``deflate``; ``identity`` is none), each zlib call asked for no more than what is left under the cap, so a
compression bomb stops at ``max_bytes + 1`` decoded bytes.
"""

from __future__ import annotations

import zlib

# What the client offers (its Accept-Encoding) and accepts: one layer of either.
ACCEPTED_CODINGS = ("gzip", "deflate")
ACCEPT_ENCODING = ", ".join(ACCEPTED_CODINGS)
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": 32 + zlib.MAX_WBITS}  # deflate: zlib-wrapped (or gzip) data


class EncodingRefused(ValueError):
    """The answer's ``Content-Encoding`` stacks codings, names one not offered, or its data does not decode."""


class DecodedTooLarge(ValueError):
    """The decoded answer would exceed the cap."""


def content_codings(header: str) -> list[str]:
    """The codings a ``Content-Encoding`` value lists, in the order they were applied (``identity`` left out)."""
    return [c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity"]


class CappedDecoder:
    """Feed it the raw body chunk by chunk; it returns the decoded bytes and raises :class:`DecodedTooLarge` as
    soon as they would pass ``max_bytes`` (having decoded at most one byte more).

    Raises:
        EncodingRefused: at construction, for more than one coding or one not in :data:`ACCEPTED_CODINGS`.
    """

    def __init__(self, content_encoding: str, max_bytes: int):
        codings = content_codings(content_encoding)
        if len(codings) > 1:
            raise EncodingRefused(f"Content-Encoding {content_encoding!r} stacks {len(codings)} codings; one at most "
                                  f"is accepted ({ACCEPT_ENCODING})")
        if codings and codings[0] not in ACCEPTED_CODINGS:
            raise EncodingRefused(f"Content-Encoding {codings[0]!r} was not offered (Accept-Encoding: "
                                  f"{ACCEPT_ENCODING})")
        self.coding = codings[0] if codings else ""
        self.max_bytes = max_bytes
        self.decoded_bytes = 0
        self._zlib = zlib.decompressobj(_WBITS[self.coding]) if self.coding else None

    def _count(self, data: bytes) -> bytes:
        self.decoded_bytes += len(data)
        if self.decoded_bytes > self.max_bytes:
            raise DecodedTooLarge(f"the decoded answer passed {self.max_bytes} bytes")
        return data

    def feed(self, raw: bytes) -> bytes:
        """The decoded bytes of the next raw chunk."""
        if self._zlib is None:
            return self._count(raw)
        out = bytearray()
        pending = raw
        while pending:
            try:
                # Never more than one byte past the cap: that byte is what tells an answer too large.
                piece = self._zlib.decompress(pending, self.max_bytes - self.decoded_bytes + 1)
            except zlib.error as err:
                raise EncodingRefused(f"the {self.coding} data does not decode: {err}") from err
            out += self._count(piece)
            if self._zlib.eof:  # the end of a gzip member: another may follow (still one coding)
                pending = self._zlib.unused_data
                self._zlib = zlib.decompressobj(_WBITS[self.coding])
            else:
                pending = self._zlib.unconsumed_tail
        return bytes(out)

    def finish(self) -> bytes:
        """What the decoder still held once the body ended."""
        if self._zlib is None:
            return b""
        try:
            return self._count(self._zlib.flush(self.max_bytes - self.decoded_bytes + 1))
        except zlib.error as err:
            raise EncodingRefused(f"the {self.coding} data does not decode: {err}") from err
