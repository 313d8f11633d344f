"""A multipart/form-data body read as it arrives, in bounded memory: the shape of POST /v1/files.

The SDKs upload a file as `multipart/form-data` with a field `purpose` and a part `file` (its
name in the Content-Disposition's filename). `Parser.feed(chunk)` takes the body chunk by chunk
and returns what it found in it: a part's start (its field name and file name), pieces of its
data, and its end. It holds at most one part's headers (MAX_HEADER_BYTES) and the length of the
boundary in memory, whatever the size of the body: a part's data is handed on as it comes, to be
written to disk by the caller. Nothing here does I/O; a malformed body raises `BadMultipart`
saying what is wrong with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MAX_HEADER_BYTES", "BadMultipart", "Data", "End", "Parser", "Start", "boundary_of"]

#: The most bytes of one part's headers (a Content-Disposition with a long file name fits many times).
MAX_HEADER_BYTES = 16 * 1024
#: RFC 2046: a boundary is 1 to 70 characters.
_BOUNDARY = re.compile(r"^[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]$")


class BadMultipart(ValueError):
    """The body is not the multipart/form-data it says it is."""


@dataclass(frozen=True, slots=True)
class Start:
    """A part begins: its form field's name, and its file name when it is a file."""

    name: str
    filename: str | None


@dataclass(frozen=True, slots=True)
class Data:
    chunk: bytes


@dataclass(frozen=True, slots=True)
class End:
    """The part that began last is whole."""


Event = Start | Data | End


def boundary_of(content_type: str) -> bytes:
    """The boundary a Content-Type of multipart/form-data names; BadMultipart for anything else."""
    kind, _sep, rest = content_type.partition(";")
    if kind.strip().lower() != "multipart/form-data":
        raise BadMultipart(f"the body must be multipart/form-data, not “{kind.strip()[:100]}”")
    params = _params(rest)
    boundary = params.get("boundary")
    if not boundary or not _BOUNDARY.match(boundary):
        raise BadMultipart("the Content-Type names no valid multipart boundary")
    return boundary.encode("ascii")


def _params(text: str) -> dict[str, str]:
    """The `; key=value` parameters of a header (values quoted or not; backslash escapes kept simple)."""
    found: dict[str, str] = {}
    for match in re.finditer(r';?\s*([A-Za-z0-9_.*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;]*)', text):
        key, value = match.group(1).lower(), match.group(2).strip()
        if value.startswith('"') and value.endswith('"') and len(value) >= 2:
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        found.setdefault(key, value)
    return found


def _disposition(headers: bytes) -> Start:
    name: str | None = None
    filename: str | None = None
    for raw in headers.split(b"\r\n"):
        if not raw:
            continue
        key, sep, value = raw.partition(b":")
        if not sep:
            raise BadMultipart("a part's header line has no colon")
        if key.strip().lower() != b"content-disposition":
            continue
        kind, _sep, rest = value.decode("utf-8", "replace").partition(";")
        if kind.strip().lower() != "form-data":
            raise BadMultipart("a part is not form-data")
        params = _params(rest)
        name = params.get("name")
        filename = params.get("filename")
        encoded = params.get("filename*")
        if encoded and "''" in encoded:  # RFC 5987: utf-8''name%20with%20spaces
            from urllib.parse import unquote

            filename = unquote(encoded.split("''", 1)[1])
    if name is None:
        raise BadMultipart("a part has no Content-Disposition naming its field")
    return Start(name, filename)


class Parser:
    """Feed a multipart/form-data body with the given boundary, chunk by chunk; `finish()` once it ended."""

    def __init__(self, boundary: bytes) -> None:
        self.delimiter = b"\r\n--" + boundary
        # The first boundary may open the body with no line break before it: one is assumed.
        self._buffer = b"\r\n"
        self._state = "preamble"
        self.done = False

    def feed(self, chunk: bytes) -> list[Event]:
        self._buffer += chunk
        events: list[Event] = []
        while True:
            step = getattr(self, f"_{self._state}")()
            if step is None:
                return events
            events.extend(step)

    def finish(self) -> None:
        """Raise BadMultipart unless the body ended with its closing boundary."""
        if not self.done:
            raise BadMultipart("the body ended before its closing boundary")

    # States: each returns the events it found, or None when it needs more bytes.

    def _preamble(self) -> list[Event] | None:
        at = self._buffer.find(self.delimiter)
        if at < 0:
            self._buffer = self._buffer[-(len(self.delimiter) - 1) :]
            return None
        self._buffer = self._buffer[at + len(self.delimiter) :]
        self._state = "after"
        return []

    def _after(self) -> list[Event] | None:
        text = self._buffer.lstrip(b" \t")  # transport padding after a boundary
        if len(text) < 2:
            return None
        if text.startswith(b"--"):
            self._state, self.done, self._buffer = "epilogue", True, b""
            return []
        if not text.startswith(b"\r\n"):
            raise BadMultipart("a boundary is followed by neither a line break nor --")
        self._buffer = text[2:]
        self._state = "headers"
        return []

    def _headers(self) -> list[Event] | None:
        if self._buffer.startswith(b"\r\n"):  # a part with no headers
            raise BadMultipart("a part has no Content-Disposition naming its field")
        at = self._buffer.find(b"\r\n\r\n")
        if at < 0:
            if len(self._buffer) > MAX_HEADER_BYTES:
                raise BadMultipart(f"a part's headers are over {MAX_HEADER_BYTES} bytes")
            return None
        if at > MAX_HEADER_BYTES:
            raise BadMultipart(f"a part's headers are over {MAX_HEADER_BYTES} bytes")
        start = _disposition(self._buffer[:at])
        self._buffer = self._buffer[at + 4 :]
        self._state = "body"
        return [start]

    def _body(self) -> list[Event] | None:
        at = self._buffer.find(self.delimiter)
        if at < 0:
            keep = len(self.delimiter) - 1  # the end of the buffer may be the start of a boundary
            if len(self._buffer) <= keep:
                return None
            data, self._buffer = self._buffer[:-keep], self._buffer[-keep:]
            return [Data(data)] if data else None
        data, self._buffer = self._buffer[:at], self._buffer[at + len(self.delimiter) :]
        self._state = "after"
        return [*([Data(data)] if data else []), End()]

    def _epilogue(self) -> list[Event] | None:
        self._buffer = b""
        return None
