"""GGUF headers written byte by byte, for shapes the tests name and for headers that lie.

`header(metadata)` writes a valid GGUF v3 header with the given metadata (ints as u32, or u64 past
2**32; floats as f32; bools; strings; lists of ints or strings) and no tensors. `RangeServer`
serves files from a folder with HTTP Range (206), reading only the slice asked for, and counts
the requests and bytes; `ranges=False` makes it answer 200 with the whole file, as a server
without range support does.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from tests.localhttp import LocalHTTP


def gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _value(value: Any) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<IQ", 10, value) if value >= 2**32 or value < 0 else struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + gguf_string(value)
    if isinstance(value, list):
        if all(isinstance(v, bool) for v in value):
            return struct.pack("<IIQ", 9, 7, len(value)) + b"".join(struct.pack("<?", v) for v in value)
        if all(isinstance(v, int) for v in value):
            return struct.pack("<IIQ", 9, 5, len(value)) + b"".join(struct.pack("<i", v) for v in value)
        if all(isinstance(v, str) for v in value):
            return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(gguf_string(v) for v in value)
    raise TypeError(f"cannot write {value!r}")


def header(metadata: Mapping[str, Any], *, tensors: int = 0, version: int = 3) -> bytes:
    out = b"GGUF" + struct.pack("<IQQ", version, tensors, len(metadata))
    for key, value in metadata.items():
        out += gguf_string(key) + _value(value)
    return out


class RangeServer:
    def __init__(self, folder: Path, *, ranges: bool = True) -> None:
        self.folder = folder
        self.ranges = ranges
        self.requests: list[str | None] = []
        self.sent = 0
        self.http = LocalHTTP(lambda handler, head: self.answer(handler))

    def url(self, name: str) -> str:
        return f"{self.http.base}/{name}"

    def __enter__(self) -> RangeServer:
        self.http.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.http.stop()

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        path = self.folder / handler.path.lstrip("/")
        wanted = handler.headers.get("Range")
        self.requests.append(wanted)
        if not path.is_file():
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        size = path.stat().st_size
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted or "")
        if self.ranges and match:
            start = int(match.group(1))
            end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
            if start >= size:
                handler.send_response(416)
                handler.send_header("Content-Range", f"bytes */{size}")
                handler.send_header("Content-Length", "0")
                handler.end_headers()
                return
            handler.send_response(206)
            handler.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        else:
            start, end = 0, size - 1
            handler.send_response(200)
        handler.send_header("Content-Length", str(end - start + 1))
        handler.end_headers()
        with open(path, "rb") as source:
            source.seek(start)
            left = end - start + 1
            try:
                while left > 0 and (chunk := source.read(min(left, 1 << 16))):
                    handler.wfile.write(chunk)
                    self.sent += len(chunk)
                    left -= len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the reader took what it needed and hung up


def held_gguf(name: str = "tiny.gguf", *, repo: str = "acme/tiny-GGUF", pk: int | None = None) -> Any:
    """A held GGUF version in the mirror (a llama header on disk, its file row held), for tests of
    pages and routes that need one."""
    from apps.mirror.models import MirrorFile, MirrorVersion

    extra = {"pk": pk} if pk is not None else {}
    version = MirrorVersion.objects.create(repo=repo, commit="a" * 40, name=name, kind="gguf", **extra)
    data = header(
        {
            "general.architecture": "llama",
            "llama.block_count": 2,
            "llama.embedding_length": 64,
            "llama.attention.head_count": 4,
        }
    )
    version.folder.mkdir(parents=True, exist_ok=True)
    (version.folder / name).write_bytes(data)
    MirrorFile.objects.create(version=version, path=name, size=len(data), sha256="b" * 64, state="held")
    return version
