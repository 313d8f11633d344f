"""One file over HTTP to disk: streamed, resumable, verified on the way (the mirror's fetch from
the Hub, and a node's from the mirror).

The file is written to `<path>.part`, hashed as it arrives (sha256 always, and the git blob id
for a small file the Hub gives no LFS digest for), and renamed into place only when its size and
digest are right. A `.part` left by an interrupted fetch is resumed with `Range: bytes=N-` (its
bytes are hashed once first); a server that answers 200 to the Range starts it over. The Hub's
resolve URL redirects large files to a storage host: the token is not sent there. Progress
(bytes and rate) is saved at most once a second.
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
from pathlib import Path

from agent.install.fetch import opener as agent_opener

__all__ = ["CHUNK_BYTES", "FetchFailed", "download"]

log = logging.getLogger(__name__)
CHUNK_BYTES = 2**20
PROGRESS_EVERY_S = 1.0
TIMEOUT_S = 60.0


class FetchFailed(Exception):
    """The file is not held; str() says why. `resumable`: its .part is kept for the next try."""

    def __init__(self, message: str, *, resumable: bool = False) -> None:
        super().__init__(message)
        self.resumable = resumable


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
) -> str:
    """Fetch `url` to `dest`; returns the file's sha256. Raises FetchFailed."""
    if not sha256 and not blob_id:
        raise FetchFailed(f"no digest is given for {dest.name}: refusing an unchecked download")
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    sha, blob = _hashers(size, git=not sha256)
    offset = part.stat().st_size if part.exists() else 0
    if size is not None and offset > size:
        part.unlink()
        offset = 0
    if offset:
        with open(part, "rb") as handle:  # resuming: the bytes already here are hashed once
            for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
                sha.update(chunk)
                if blob is not None:
                    blob.update(chunk)
    headers = {"User-Agent": "llmgw-mirror", "Accept-Encoding": "identity", **(headers or {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(url, headers=headers)
    done = offset
    try:
        with agent_opener(None).open(request, timeout=TIMEOUT_S) as answer:
            if offset and answer.status == 200:
                log.info("%s ignored the Range request: fetching %s from the start", url, dest.name)
                sha, blob = _hashers(size, git=not sha256)
                done = 0
                mode = "wb"
            elif offset and answer.status == 206:
                start = (answer.headers.get("Content-Range") or "").removeprefix("bytes ").split("-", 1)[0]
                if start != str(offset):
                    raise FetchFailed(f"asked for bytes from {offset:,}, got {answer.headers.get('Content-Range')}")
                mode = "ab"
            else:
                mode = "wb"
            hasher = _Hasher(sha, blob)
            try:
                with open(part, mode) as out:
                    started, last = time.monotonic(), 0.0
                    first = done
                    while True:
                        try:
                            chunk = answer.read(CHUNK_BYTES)
                        except http.client.IncompleteRead as exc:
                            out.write(exc.partial)
                            done += len(exc.partial)
                            raise FetchFailed(
                                f"interrupted at {done:,} of {size:,} bytes"
                                if size
                                else f"interrupted at {done:,} bytes",
                                resumable=True,
                            ) from None
                        if not chunk:
                            break
                        if size is not None and done + len(chunk) > size:
                            raise FetchFailed(f"the server sent more than the {size:,} bytes {authority} lists")
                        out.write(chunk)
                        hasher.put(chunk)  # hashed in another thread while the next chunk arrives
                        done += len(chunk)
                        now = time.monotonic()
                        if progress is not None and now - last >= PROGRESS_EVERY_S:
                            elapsed = now - started
                            progress(done, (done - first) / elapsed if elapsed > 0 else None)
                            last = now
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                hasher.close()
    except FetchFailed:
        raise
    except urllib.error.HTTPError as exc:
        exc.close()
        raise FetchFailed(f"HTTP {exc.code} {exc.reason} from {url}", resumable=exc.code >= 500) from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise FetchFailed(
            f"cannot download {url}: {getattr(exc, 'reason', exc)} (at {done:,} bytes)", resumable=True
        ) from None
    if size is not None and done < size:
        raise FetchFailed(f"interrupted at {done:,} of {size:,} bytes", resumable=True)
    got = sha.hexdigest()
    if sha256 and got != sha256.lower():
        part.unlink(missing_ok=True)
        raise FetchFailed(f"digest mismatch for {dest.name}: {authority} gives sha256 {sha256[:12]}…, got {got[:12]}…")
    if not sha256 and blob is not None and blob_id and blob.hexdigest() != blob_id.lower():
        part.unlink(missing_ok=True)
        raise FetchFailed(
            f"digest mismatch for {dest.name}: {authority} gives git blob {blob_id[:12]}…, got {blob.hexdigest()[:12]}…"
        )
    os.replace(part, dest)
    if progress is not None:
        progress(done, None)
    return got
