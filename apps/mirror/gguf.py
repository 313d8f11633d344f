"""A GGUF file's header, read without downloading the file: from disk, or over HTTP Range requests.

The header (ggml's docs/gguf.md, little-endian) is the magic `GGUF`, a version (2 or 3), the
tensor and metadata counts (u64), then the metadata: key (u64 length + UTF-8), value type (u32),
value. What a memory estimate needs (`general.*` and `<arch>.*`) comes before the tokenizer, whose
arrays run to megabytes (262,144 tokens for Gemma 3), so reading stops at the tokenizer's first
array, keeping only its count (`tokenizer.ggml.tokens.count`, the vocabulary's size): `complete`
says the model's keys were all read. A header cut short by the bytes allowed
still returns what it has, with `stopped` saying why.

Nothing in the header is trusted: a length, count or array that cannot be real (more than the
limits below, or past the end of the file) raises `GGUFError` naming the key and the offset, and
an array of numbers too long to be a per-layer list is skipped, never read.
"""

from __future__ import annotations

import re
import struct
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "FileSource",
    "GGUFError",
    "Header",
    "HttpSource",
    "read_header",
]

MAGIC = b"GGUF"
#: The most bytes read for one header: what the model's keys need is a few kB.
MAX_HEADER_BYTES = 2 * 2**20
#: Bytes fetched per Range request (the first one usually holds every key before the tokenizer).
CHUNK_BYTES = 256 * 2**10
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 24
MAX_STRING = 1 << 20
MAX_ARRAY = 1 << 26
#: Arrays of numbers kept (per-layer head counts, the sliding-window pattern); longer ones are skipped.
KEEP_ARRAY = 1 << 16
#: A file size in a Content-Range or Content-Length header: ASCII digits ("²" passes isdigit()
#: and fails int()), at most a 64-bit number's 20.
_SIZE = re.compile(r"[0-9]{1,20}")

# value type -> (struct format, size)
_FIXED: dict[int, tuple[str, int]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A header that is not GGUF, is cut short, or lies about its lengths; str() says where."""


class Source(Protocol):
    size: int | None

    def read(self, offset: int, length: int) -> bytes: ...


@dataclass
class FileSource:
    path: Path
    size: int | None = None
    reads: int = 0
    bytes_read: int = 0

    def __post_init__(self) -> None:
        self.size = Path(self.path).stat().st_size

    def read(self, offset: int, length: int) -> bytes:
        self.reads += 1
        with open(self.path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
        self.bytes_read += len(data)
        return data


@dataclass
class HttpSource:
    """Range requests to a URL (206 answers; a server that answers 200 is read no further than asked)."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 30.0
    opener: Callable[..., Any] | None = None
    size: int | None = None
    reads: int = 0
    bytes_read: int = 0

    def read(self, offset: int, length: int) -> bytes:
        request = urllib.request.Request(
            self.url, headers={**self.headers, "Range": f"bytes={offset}-{offset + length - 1}"}
        )
        open_ = self.opener or urllib.request.urlopen
        self.reads += 1
        try:
            with open_(request, timeout=self.timeout) as answer:
                status = getattr(answer, "status", 200)
                if status == 206:
                    total = (answer.headers.get("Content-Range") or "").rpartition("/")[2]
                    if _SIZE.fullmatch(total):
                        self.size = int(total)
                    data = answer.read(length)
                elif status == 200:
                    length_header = answer.headers.get("Content-Length")
                    if length_header and _SIZE.fullmatch(length_header):
                        self.size = int(length_header)
                    # No ranges: read up to what was asked from the start, and no further.
                    data = answer.read(offset + length)[offset:]
                else:
                    raise GGUFError(f"HTTP {status} from {self.url}")
        except urllib.error.HTTPError as exc:
            if exc.code == 416:
                return b""
            raise GGUFError(f"HTTP {exc.code} {exc.reason} from {self.url}") from None
        except OSError as exc:
            raise GGUFError(f"cannot read {self.url}: {getattr(exc, 'reason', exc)}") from None
        self.bytes_read += len(data)
        return data


@dataclass
class Header:
    version: int
    tensor_count: int
    kv_count: int
    metadata: dict[str, Any]
    complete: bool  # every key before the tokenizer (or every key) was read
    stopped: str | None  # why reading stopped early, when it did
    size: int | None  # the file's size, when the source knows it
    bytes_read: int
    reads: int

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None


class _Cursor:
    def __init__(self, source: Source, budget: int) -> None:
        self.source = source
        self.budget = budget
        self.buffer = b""
        self.start = 0  # offset of buffer[0] in the file
        self.offset = 0
        self.fetched = 0  # bytes read from the source, what the budget bounds

    def _fill(self, need: int) -> None:
        end = self.offset + need
        have_end = self.start + len(self.buffer)
        if self.offset >= self.start and end <= have_end:
            return
        if not (self.start <= self.offset <= have_end):
            self.buffer, self.start = b"", self.offset  # skipped past what was read: start afresh here
            have_end = self.offset
        missing = end - have_end
        if self.fetched + missing > self.budget:
            raise _OutOfBudget(self.offset)
        want = min(max(missing, CHUNK_BYTES), self.budget - self.fetched)
        data = self.source.read(have_end, want)
        self.fetched += len(data)
        self.buffer = self.buffer[self.offset - self.start :] + data
        self.start = self.offset
        if self.start + len(self.buffer) < end:
            size = self.source.size
            raise GGUFError(
                f"the file ends at byte {self.start + len(self.buffer):,} inside its header "
                f"(needed {end:,}{f' of {size:,}' if size else ''})"
            )

    def take(self, n: int) -> bytes:
        self._fill(n)
        i = self.offset - self.start
        self.offset += n
        return self.buffer[i : i + n]

    def skip(self, n: int) -> None:
        size = self.source.size
        if size is not None and self.offset + n > size:
            raise GGUFError(f"a value at byte {self.offset:,} runs {n:,} bytes, past the end of the file ({size:,})")
        self.offset += n

    def unpack(self, fmt: str, size: int) -> Any:
        return struct.unpack(fmt, self.take(size))[0]

    def string(self, what: str) -> str:
        at = self.offset
        length = self.unpack("<Q", 8)
        if length > MAX_STRING:
            raise GGUFError(f"{what} at byte {at:,} claims {length:,} bytes, more than {MAX_STRING:,}")
        return self.take(length).decode("utf-8", "replace")


class _OutOfBudget(Exception):
    def __init__(self, offset: int) -> None:
        self.offset = offset


def _value(cursor: _Cursor, kind: int, key: str) -> Any:
    if kind in _FIXED:
        fmt, size = _FIXED[kind]
        return cursor.unpack(fmt, size)
    if kind == _STRING:
        return cursor.string(f"the value of {key}")
    if kind == _ARRAY:
        at = cursor.offset
        item = cursor.unpack("<I", 4)
        count = cursor.unpack("<Q", 8)
        if count > MAX_ARRAY:
            raise GGUFError(f"{key} at byte {at:,} claims an array of {count:,} items, more than {MAX_ARRAY:,}")
        if item in _FIXED:
            fmt, size = _FIXED[item]
            if count > KEEP_ARRAY:
                cursor.skip(count * size)
                return None
            data = cursor.take(count * size)
            return list(struct.unpack(f"<{count}{fmt[1]}", data))
        if item == _STRING:
            if count > KEEP_ARRAY:
                raise GGUFError(f"{key} at byte {at:,} holds {count:,} strings, more than {KEEP_ARRAY:,}")
            return [cursor.string(f"an item of {key}") for _ in range(count)]
        raise GGUFError(f"{key} at byte {at:,} is an array of type {item}, which GGUF does not define")
    raise GGUFError(f"{key} at byte {cursor.offset - 4:,} has value type {kind}, which GGUF does not define")


def read_header(source: Source, *, max_bytes: int = MAX_HEADER_BYTES, stop_at_tokenizer: bool = True) -> Header:
    """The header's counts and metadata (up to the tokenizer), reading at most `max_bytes`."""
    cursor = _Cursor(source, max_bytes)
    try:
        if cursor.take(4) != MAGIC:
            raise GGUFError("not a GGUF file (no GGUF magic at byte 0)")
        version = cursor.unpack("<I", 4)
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version}: this reader knows versions 2 and 3")
        tensors = cursor.unpack("<Q", 8)
        keys = cursor.unpack("<Q", 8)
    except _OutOfBudget:
        raise GGUFError(f"a header limit of {max_bytes:,} bytes is too small to read the counts") from None
    if tensors > MAX_TENSORS:
        raise GGUFError(f"the header claims {tensors:,} tensors, more than {MAX_TENSORS:,}")
    if keys > MAX_KEYS:
        raise GGUFError(f"the header claims {keys:,} metadata keys, more than {MAX_KEYS:,}")
    metadata: dict[str, Any] = {}
    complete, stopped = True, None
    try:
        for _ in range(keys):
            key = cursor.string("a metadata key")
            kind = cursor.unpack("<I", 4)
            if stop_at_tokenizer and key.startswith("tokenizer.") and kind == _ARRAY:
                # The vocabulary's size is the array's count; its items (megabytes) are not read.
                cursor.unpack("<I", 4)
                metadata[key + ".count"] = cursor.unpack("<Q", 8)
                stopped = f"stopped at {key}: the tokenizer's items are not needed"
                break
            metadata[key] = _value(cursor, kind, key)
    except _OutOfBudget as exc:
        complete = False
        stopped = f"read {cursor.fetched:,} bytes, the limit for a header, by byte {exc.offset:,}, before the tokenizer"
    return Header(
        version=version,
        tensor_count=tensors,
        kv_count=keys,
        metadata=metadata,
        complete=complete,
        stopped=stopped,
        size=source.size,
        bytes_read=getattr(source, "bytes_read", 0),
        reads=getattr(source, "reads", 0),
    )
