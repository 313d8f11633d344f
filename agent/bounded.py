"""Decoding what another party sent, with a bound set before the first byte comes out.

An agent's answer, a release archive or a wheel is written by someone this process does not
control, and a few hundred kilobytes of deflate can inflate to gigabytes. So nothing here
decompresses or decodes whole and measures afterwards: output is produced a chunk at a time
(``zlib.decompressobj`` with ``max_length``; a stream read ``CHUNK`` bytes at a time), counted as
it comes, and the work stops at the first chunk past the limit with :class:`TooLarge`, which
says what and how much ("the map inflates past 64 MiB"). Memory held is the limit plus one chunk
at most, whatever the input claims.

Used by the control plane (an ibnetdiscover answer, apps.fabrics.maps) and by the agent (engine
archives, agent.install.archive; a binary taken out of a wheel, agent.install.pyenv). No Django
import; Python 3.11+.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from collections.abc import Callable
from typing import IO

__all__ = ["CHUNK", "TooLarge", "b64decode", "copy", "inflate", "size_text"]

CHUNK = 2**20
_GZIP = 16 + zlib.MAX_WBITS  # a gzip header and trailer around the deflate stream


class TooLarge(ValueError):
    """Output passed its bound; ``what`` and ``limit`` say which and how far it was allowed."""

    def __init__(self, what: str, limit: int, verb: str = "inflates") -> None:
        super().__init__(f"{what} {verb} past {size_text(limit)}")
        self.what = what
        self.limit = limit


def size_text(n: int) -> str:
    """A limit as people set it: ``64 MiB``, ``2 GiB`` when whole, else ``1,234,567 bytes``."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if n >= 1024**power and n % 1024**power == 0:
            return f"{n // 1024**power:,} {unit}"
    return f"{n:,} bytes"


def inflate(data: bytes, *, limit: int, what: str) -> bytes:
    """The gzip ``data`` decompressed, at most ``limit`` bytes of it: TooLarge as soon as one more
    would come out, ValueError when the data is not gzip or ends early. Several gzip members one
    after another are read as one text (as ``gzip.decompress`` does); zero padding after the last
    is ignored."""
    if limit < 0:
        raise ValueError(f"a negative limit for {what}: {limit}")
    out = bytearray()
    pending = data
    while pending:
        inflater = zlib.decompressobj(wbits=_GZIP)
        try:
            while not inflater.eof:
                chunk = inflater.decompress(pending, min(CHUNK, limit + 1 - len(out)))
                out += chunk
                if len(out) > limit:
                    raise TooLarge(what, limit)
                if not (chunk or pending):
                    break  # no input left and nothing more came out: the data ends early
                pending = inflater.unconsumed_tail
        except zlib.error as exc:
            raise ValueError(f"{what} is not gzip data: {exc}") from None
        if not inflater.eof:
            raise ValueError(f"{what} ends inside its compressed data")
        pending = inflater.unused_data.lstrip(b"\0")
    return bytes(out)


def b64decode(text: str, *, limit: int, what: str) -> bytes:
    """Strict base64 (no stray characters) decoding to at most ``limit`` bytes: the length is
    judged from the text before anything is decoded."""
    padding = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
    if len(text) // 4 * 3 - padding > limit:
        raise TooLarge(what, limit, "decodes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{what} is not base64: {exc}") from None


def copy(source: IO[bytes], write: Callable[[bytes], object], *, limit: int, what: str) -> int:
    """Read ``source`` to its end a chunk at a time, handing each chunk to ``write``; TooLarge
    before the chunk that would pass ``limit`` bytes in all is written. Returns the bytes copied."""
    if limit < 0:
        raise ValueError(f"a negative limit for {what}: {limit}")
    count = 0
    while True:
        chunk = source.read(min(CHUNK, limit + 1 - count))
        if not chunk:
            return count
        count += len(chunk)
        if count > limit:
            raise TooLarge(what, limit)
        write(chunk)
