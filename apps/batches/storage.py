"""The bytes of batch files on disk, under LLMGW_BATCH_STORAGE_DIR.

    <storage>/<two characters of the id>/<file id>          a file, whole
    <storage>/tmp/<random>                                  one being written

A file is written to tmp/ and renamed into place only once it is whole and within its bounds, so
a process killed mid-upload leaves a temporary file (removed by the sweep) and never a part of a
file under a real id. `Sink` counts what it is given and refuses, as soon as it is passed, a file
over its size or its line bound; the caller says the numbers.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings

__all__ = ["OverLimit", "Sink", "file_path", "read_chunks", "read_lines", "remove", "root", "sweep_temporary"]

CHUNK = 256 * 1024
#: Temporary files older than this were left by a process that died mid-write.
TEMPORARY_MAX_AGE_S = 6 * 3600


def root() -> Path:
    return Path(settings.BATCH_STORAGE_DIR)


def file_path(file_id: str) -> Path:
    return root() / file_id[-2:] / file_id


class OverLimit(Exception):
    """A bound was passed: `what` ("bytes" or "lines"), the bound, and how much came (at least)."""

    def __init__(self, what: str, limit: int, seen: int) -> None:
        super().__init__(f"over {limit} {what}")
        self.what = what
        self.limit = limit
        self.seen = seen


class Sink:
    """A file being written: `write` what comes, `commit(file_id)` once it is whole, or `discard()`.
    `max_lines` (None: no bound) counts lines as JSONL counts them: a last line without a line
    break counts, blank lines do not."""

    def __init__(self, *, max_bytes: int, max_lines: int | None = None) -> None:
        tmp = root() / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        self.path = tmp / secrets.token_hex(12)
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.max_bytes = max_bytes
        self.max_lines = max_lines
        self.size = 0
        self.lines = 0
        self._blank = True  # the line being written holds only whitespace so far

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise OverLimit("bytes", self.max_bytes, self.size)
        self._count(chunk)
        if self.max_lines is not None and self.lines > self.max_lines:
            raise OverLimit("lines", self.max_lines, self.lines)
        assert self._fd is not None
        view = memoryview(chunk)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def _count(self, chunk: bytes) -> None:
        for piece in chunk.split(b"\n")[:-1] if b"\n" in chunk else []:
            if not (self._blank and not piece.strip()):
                self.lines += 1
            self._blank = True
        last = chunk.rsplit(b"\n", 1)[-1]
        if last.strip():
            self._blank = False

    @property
    def line_count(self) -> int:
        """Lines with something on them, the last one counted whether or not it ends in a line break."""
        return self.lines + (0 if self._blank else 1)

    def commit(self, file_id: str) -> Path:
        assert self._fd is not None
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = None
        target = file_path(file_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.path, target)
        return target

    def discard(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_chunks(file_id: str, chunk: int = CHUNK) -> Iterator[bytes]:
    with file_path(file_id).open("rb") as handle:
        while piece := handle.read(chunk):
            yield piece


def read_lines(file_id: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, the line without its line break) for each line, blank ones included."""
    with file_path(file_id).open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            yield number, line.rstrip(b"\r\n")


def remove(file_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        file_path(file_id).unlink()


def sweep_temporary(max_age_s: float = TEMPORARY_MAX_AGE_S) -> int:
    """Remove temporary files left by processes that died mid-write; how many went."""
    tmp = root() / "tmp"
    if not tmp.is_dir():
        return 0
    removed = 0
    cutoff = time.time() - max_age_s
    for path in tmp.iterdir():
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
                removed += 1
    return removed
