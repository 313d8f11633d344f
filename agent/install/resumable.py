"""One file over HTTP to disk: streamed, resumable, verified on the way (the mirror's fetch from
the Hub, and a node's from the mirror).

The file is written to `<path>.part`, hashed as it arrives (sha256 always, and the git blob id
for a small file the Hub gives no LFS digest for), and renamed into place only when its size and
digest are right. A `.part` left by an interrupted fetch is resumed with `Range: bytes=N-` (its
bytes are hashed once first); a server that answers 200 to the Range starts it over. The Hub's
resolve URL redirects large files to a storage host: the token is not sent there, and a redirect
to this machine's own services is not followed (agent/install/redirects.py). Progress (bytes and
rate) is reported at most once a second, and at least every `TIMEOUT_S` while the fetch lives:
each read returns what has arrived rather than waiting for a whole chunk.

A file whose size is not listed is bounded by `max_bytes` and refused past it; a small file the
Hub gives only a git blob id for is checked against it whether or not its size was listed (the
blob id covers `blob <size>\0` and the bytes, so it is worked out once the size is known).
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from agent.install.fetch import opener as agent_opener
from agent.install.redirects import Destinations, RedirectRefused

__all__ = ["CHUNK_BYTES", "UNSIZED_MAX_BYTES", "FetchFailed", "download", "git_blob_id"]

log = logging.getLogger(__name__)
CHUNK_BYTES = 2**20
PROGRESS_EVERY_S = 1.0
TIMEOUT_S = 60.0
#: The most bytes taken for a file whose size is not listed, unless the caller says otherwise.
UNSIZED_MAX_BYTES = 64 * 2**20


class FetchFailed(Exception):
    """The file is not held; str() says why. `resumable`: its .part is kept for the next try."""

    def __init__(self, message: str, *, resumable: bool = False) -> None:
        super().__init__(message)
        self.resumable = resumable


def git_blob_id(path: Path) -> str:
    """The git blob id of a file: the SHA-1 of `blob <size>\0` and its bytes."""
    blob = hashlib.sha1(b"blob %d\0" % path.stat().st_size, usedforsecurity=False)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            blob.update(chunk)
    return blob.hexdigest()


def _hashers(size: int | None, git: bool) -> tuple[hashlib._Hash, hashlib._Hash | None]:
    sha = hashlib.sha256()
    blob = hashlib.sha1(b"blob %d\0" % size, usedforsecurity=False) if git and size is not None else None
    return sha, blob


class _Hasher:
    """sha256 (and the git blob id) of the chunks put, computed in a thread of its own: hashlib
    releases the GIL on large buffers, so hashing overlaps the network and the disk."""

    def __init__(self, *hashes: hashlib._Hash | None) -> None:
        self.hashes = [h for h in hashes if h is not None]
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=16)
        self.thread = threading.Thread(target=self._run, name="mirror-hash", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.queue.get()) is not None:
            for h in self.hashes:
                h.update(chunk)

    def put(self, chunk: bytes) -> None:
        self.queue.put(chunk)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()


@dataclass
class _Transfer:
    """One download's state: where its bytes go and what they hash to so far."""

    url: str
    part: Path
    size: int | None
    limit: int
    sha256: str | None
    authority: str
    done: int = 0
    sha: Any = None
    blob: Any = None

    def restart(self) -> None:
        self.sha, self.blob = _hashers(self.size, git=not self.sha256)
        self.done = 0

    def too_much(self, name: str) -> FetchFailed:
        self.part.unlink(missing_ok=True)
        if self.size is not None:
            return FetchFailed(f"the server sent more than the {self.size:,} bytes {self.authority} lists")
        return FetchFailed(
            f"{name} has no listed size and the server sent more than the {self.limit:,} bytes taken for such a file"
        )


def download(
    url: str,
    dest: Path,
    *,
    size: int | None,
    sha256: str | None,
    blob_id: str | None,
    progress: Callable[[int, float | None], None] | None = None,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    authority: str = "the Hub",
    max_bytes: int = UNSIZED_MAX_BYTES,
    destinations: Destinations | None = None,
) -> str:
    """Fetch `url` to `dest`; returns the file's sha256. Raises FetchFailed; an exception raised
    by `progress` is passed on unchanged, with the .part kept. `destinations`: the control plane's
    endpoints no redirect may lead to."""
    if not sha256 and not blob_id:
        raise FetchFailed(f"no digest is given for {dest.name}: refusing an unchecked download")
    part = dest.with_name(dest.name + ".part")
    transfer = _Transfer(url, part, size, size if size is not None else max_bytes, sha256, authority)
    transfer.restart()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        transfer.done = _resume(transfer, progress)
    except OSError as exc:
        raise FetchFailed(f"cannot write {dest}: {exc.strerror or exc}") from None
    if size is None or transfer.done < size:  # a fetch killed after its last byte only needs the checks
        request_headers = {"User-Agent": "llmgw-mirror", "Accept-Encoding": "identity", **(headers or {})}
        if token:
            request_headers["Authorization"] = f"Bearer {token}"
        if transfer.done:
            request_headers["Range"] = f"bytes={transfer.done}-"
        _receive(transfer, urllib.request.Request(url, headers=request_headers), dest.name, progress, destinations)
    _verify(transfer, dest.name, blob_id)
    os.replace(part, dest)
    if progress is not None:
        progress(transfer.done, None)
    return str(transfer.sha.hexdigest())


def _resume(transfer: _Transfer, progress: Callable[[int, float | None], None] | None) -> int:
    """Bytes of an earlier .part kept for resuming, hashed once (reporting progress as they are, so
    a long .part does not look like a dead fetch); 0 when there is none to keep."""
    part = transfer.part
    offset = part.stat().st_size if part.exists() else 0
    if not offset:
        return 0
    if offset > transfer.limit:
        part.unlink()
        return 0
    hashed, last = 0, time.monotonic()
    with open(part, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            for hasher in (transfer.sha, transfer.blob):
                if hasher is not None:
                    hasher.update(chunk)
            hashed += len(chunk)
            if progress is not None and time.monotonic() - last >= PROGRESS_EVERY_S:
                progress(hashed, None)
                last = time.monotonic()
    return offset


def _receive(
    transfer: _Transfer,
    request: urllib.request.Request,
    name: str,
    progress: Callable[[int, float | None], None] | None,
    destinations: Destinations | None,
) -> None:
    """Send the request and append (or write) the body to the .part; FetchFailed on failure."""
    try:
        with agent_opener(None, destinations).open(request, timeout=TIMEOUT_S) as answer:
            mode = _mode(transfer, answer, name)
            hasher = _Hasher(transfer.sha, transfer.blob)
            try:
                with open(transfer.part, mode) as out:
                    _copy(transfer, answer, out, hasher, name, progress)
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                hasher.close()
    except FetchFailed:
        raise
    except urllib.error.HTTPError as exc:
        exc.close()
        raise FetchFailed(f"HTTP {exc.code} {exc.reason} from {transfer.url}", resumable=exc.code >= 500) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchFailed(
            f"cannot download {transfer.url}: {reason} (at {transfer.done:,} bytes)",
            resumable=not isinstance(reason, RedirectRefused),
        ) from None
    if transfer.size is not None and transfer.done < transfer.size:
        raise FetchFailed(f"interrupted at {transfer.done:,} of {transfer.size:,} bytes", resumable=True)


def _mode(transfer: _Transfer, answer: http.client.HTTPResponse, name: str) -> str:
    """How the .part is opened for this answer: appended to for a 206 that starts where it ends."""
    offset = transfer.done
    if offset and answer.status == 206:
        start = (answer.headers.get("Content-Range") or "").removeprefix("bytes ").split("-", 1)[0]
        if start != str(offset):
            raise FetchFailed(f"asked for bytes from {offset:,}, got {answer.headers.get('Content-Range')}")
        return "ab"
    if offset:
        log.info("%s ignored the Range request: fetching %s from the start", transfer.url, name)
        transfer.restart()
    return "wb"


def _copy(
    transfer: _Transfer,
    answer: http.client.HTTPResponse,
    out: IO[bytes],
    hasher: _Hasher,
    name: str,
    progress: Callable[[int, float | None], None] | None,
) -> None:
    started, last = time.monotonic(), 0.0
    first = transfer.done
    while True:
        try:
            chunk = answer.read1(CHUNK_BYTES)  # what has arrived: progress keeps moving on a slow link
        except http.client.IncompleteRead as exc:
            out.write(exc.partial)
            transfer.done += len(exc.partial)
            total = f" of {transfer.size:,}" if transfer.size else ""
            raise FetchFailed(f"interrupted at {transfer.done:,}{total} bytes", resumable=True) from None
        if not chunk:
            return
        if transfer.done + len(chunk) > transfer.limit:
            raise transfer.too_much(name)
        out.write(chunk)
        hasher.put(chunk)  # hashed in another thread while the next chunk arrives
        transfer.done += len(chunk)
        now = time.monotonic()
        if progress is not None and now - last >= PROGRESS_EVERY_S:
            elapsed = now - started
            progress(transfer.done, (transfer.done - first) / elapsed if elapsed > 0 else None)
            last = now


def _verify(transfer: _Transfer, name: str, blob_id: str | None) -> None:
    """The .part against the listed digest: the sha256 when there is one, the git blob id otherwise."""
    got, listed = transfer.sha.hexdigest(), transfer.sha256
    if listed:
        if got != listed.lower():
            transfer.part.unlink(missing_ok=True)
            raise FetchFailed(
                f"digest mismatch for {name}: {transfer.authority} gives sha256 {listed[:12]}…, got {got[:12]}…"
            )
        return
    if blob_id:
        blob = transfer.blob.hexdigest() if transfer.blob is not None else git_blob_id(transfer.part)
        if blob != blob_id.lower():
            transfer.part.unlink(missing_ok=True)
            raise FetchFailed(
                f"digest mismatch for {name}: {transfer.authority} gives git blob {blob_id[:12]}…, got {blob[:12]}…"
            )
