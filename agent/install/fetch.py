"""A download streamed to disk, checked against its sha256, with progress.

:func:`download` writes the body to ``<dest>.part`` one chunk at a time (never the whole file in
memory), hashes it on the way, and renames it to ``dest`` only when the size and the digest are
right.  Every failure removes the ``.part`` file and raises :class:`FetchError`, whose text is one
line an operator can act on.  Standard library only (``urllib.request``), so it runs wherever the
agent runs; proxies come from the usual ``http_proxy``/``https_proxy``/``no_proxy`` variables.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from agent.install.redirects import Destinations, handlers

__all__ = [
    "CHUNK_BYTES",
    "PROGRESS_EVERY_S",
    "DigestMismatch",
    "FetchError",
    "download",
    "fetch_text",
    "opener",
    "human_bytes",
    "progress_text",
]

#: ``progress`` is called at most this often while bytes flow (plus once at the start and once at
#: the end), which keeps the reported progress under two seconds old.
PROGRESS_EVERY_S = 1.0

#: The most bytes read from the socket and held in memory at once.
CHUNK_BYTES = 2**20

_HEX_DIGEST_RE = re.compile(r"[0-9a-f]{64}")


class FetchError(Exception):
    """A download that did not produce a verified file; ``str()`` is a one-line reason."""


class DigestMismatch(FetchError):
    """The whole file arrived and is not the one published: a refusal, not a network fault."""


def human_bytes(n: int) -> str:
    """A size in decimal units, as download sizes are quoted: ``512 B``, ``512 kB``, ``3.1 MB``,
    ``16 MB``, ``1.2 GB``.  One decimal below 10 of a unit, none above."""
    if n < 0:
        return "-" + human_bytes(-n)
    if n < 1000:
        return f"{n} B"
    units = ("kB", "MB", "GB", "TB", "PB", "EB")
    power = 1
    while True:
        value = n / 1000**power
        text = f"{value:.1f}" if value < 9.95 else f"{value:.0f}"
        if float(text) < 1000 or power == len(units):
            return f"{text.removesuffix('.0')} {units[power - 1]}"
        power += 1


def progress_text(name: str, done: int, total: int | None) -> str:
    """``downloading NAME (16 MB, 40 %)``, or ``downloading NAME (3.1 MB so far)`` when the total
    is unknown.  The percentage is rounded down, so 100 % means finished."""
    if total is None:
        return f"downloading {name} ({human_bytes(done)} so far)"
    percent = 100 if total <= 0 else min(100, max(0, done * 100 // total))
    return f"downloading {name} ({human_bytes(total)}, {percent} %)"


def _expected_hex(sha256: str | None, name: str) -> str:
    if sha256 is None:
        raise FetchError(f"no sha256 published for {name}: refusing an unchecked download")
    text = sha256.strip().lower()
    text = text.removeprefix("sha256:")
    if not _HEX_DIGEST_RE.fullmatch(text):
        raise FetchError(f"malformed sha256 for {name}: {sha256!r} is not 64 hex digits")
    return text


def opener(ca_file: str | None, destinations: Destinations | None = None) -> urllib.request.OpenerDirector:
    """urllib's opener with the CA bundle, following redirects only where
    :mod:`agent.install.redirects` allows (never carrying credentials to another host)."""
    return _opener(ca_file, destinations)


def _opener(ca_file: str | None, destinations: Destinations | None = None) -> urllib.request.OpenerDirector:
    context = ssl.create_default_context()
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise FetchError(f"cannot load the CA bundle {ca_file}: {exc}") from exc
    return urllib.request.build_opener(*handlers(context, destinations))


def _reason(exc: BaseException, timeout: float) -> str:
    reason: Any = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):
        return f"timed out after {timeout:g} s"
    text = str(reason).strip() or type(reason).__name__
    return " ".join(text.split())


def download(
    url: str,
    dest: Path,
    *,
    sha256: str | None,
    size: int | None = None,
    progress: Callable[[int, int | None], None] | None = None,
    timeout: float = 30.0,
    max_bytes: int = 64 * 2**30,
    headers: Mapping[str, str] | None = None,
    ca_file: str | None = None,
    destinations: Destinations | None = None,
) -> str:
    """Download ``url`` to ``dest`` and return the body's sha256 as lower-case hex.

    ``sha256`` is what the file must hash to, bare hex or ``sha256:<hex>`` (GitHub's ``digest``);
    None is refused, since an unchecked engine binary is never installed.  ``size``, when known,
    must match the body exactly; ``max_bytes`` caps a body of unknown size.  ``timeout`` applies
    to connecting and to each wait for data.  ``headers`` are sent with the request; credential
    headers are dropped when a redirect leads to another host.  ``ca_file`` adds a CA bundle to
    the system's for https; ``destinations`` names the control plane's endpoints no redirect may
    lead to (see :mod:`agent.install.redirects`).  ``progress(done, total)`` is called once the response starts, at most
    every :data:`PROGRESS_EVERY_S` seconds while bytes flow, and once at the end; ``total`` is the
    announced or expected size, or None.

    The body goes to ``dest.name + ".part"`` beside ``dest``, is fsynced and then renamed over
    ``dest``.  On any failure the ``.part`` file is removed and :class:`FetchError` is raised
    (an exception raised by ``progress`` is passed on unchanged, after the same clean-up).
    """
    name = dest.name
    expected = _expected_hex(sha256, name)
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise FetchError(f"cannot download {url}: only http and https URLs are supported")
    if size is not None and size > max_bytes:
        raise FetchError(f"too large: {name} is {size:,} bytes, more than the limit of {max_bytes:,}")
    part = dest.with_name(dest.name + ".part")
    opener = _opener(ca_file, destinations)
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with opener.open(request, timeout=timeout) as response, open(part, "wb") as out:
            digest = _stream(
                response, out, url=url, name=name, size=size, max_bytes=max_bytes, timeout=timeout, progress=progress
            )
            out.flush()
            os.fsync(out.fileno())
        if digest != expected:
            raise DigestMismatch(f"digest mismatch for {name}: expected sha256 {expected[:12]}…, got {digest[:12]}…")
        os.replace(part, dest)
    except BaseException as exc:
        part.unlink(missing_ok=True)
        if isinstance(exc, FetchError):
            raise
        if isinstance(exc, urllib.error.HTTPError):
            exc.close()
            raise FetchError(f"HTTP {exc.code} {exc.reason} from {url}") from exc
        if isinstance(exc, (OSError, http.client.HTTPException, ValueError)):
            raise FetchError(f"cannot download {url}: {_reason(exc, timeout)}") from exc
        raise
    _fsync_directory(dest.parent)
    return digest


def _stream(
    response: http.client.HTTPResponse,
    out: IO[bytes],
    *,
    url: str,
    name: str,
    size: int | None,
    max_bytes: int,
    timeout: float,
    progress: Callable[[int, int | None], None] | None,
) -> str:
    """Copy the body to ``out`` in chunks; the hex sha256 of what was written."""
    announced = response.length  # Content-Length; None when absent, invalid or chunked
    if announced is not None and size is not None and announced != size:
        raise FetchError(f"size mismatch for {name}: {url} announces {announced:,} bytes, expected {size:,}")
    limit = size if size is not None else max_bytes
    if announced is not None and announced > limit:
        raise FetchError(f"too large: {url} announces {announced:,} bytes, more than the limit of {max_bytes:,}")
    total = announced if announced is not None else size
    hasher = hashlib.sha256()
    done = 0
    if progress is not None:
        progress(0, total)
    last_report = time.monotonic()
    while True:
        try:
            chunk = response.read1(CHUNK_BYTES)
        except TimeoutError as exc:
            raise FetchError(f"timed out after {timeout:g} s waiting for data from {url} (got {done:,} bytes)") from exc
        except http.client.IncompleteRead as exc:
            expected = f"{total:,}" if total is not None else "more"
            raise FetchError(f"truncated: got {done + len(exc.partial):,} of {expected} bytes from {url}") from exc
        if not chunk:
            break
        done += len(chunk)
        if done > limit:
            what = f"the expected {size:,}" if size is not None else f"the limit of {max_bytes:,}"
            raise FetchError(f"too large: {url} sent at least {done:,} bytes, more than {what}")
        hasher.update(chunk)
        out.write(chunk)
        now = time.monotonic()
        if progress is not None and now - last_report >= PROGRESS_EVERY_S:
            progress(done, total)
            last_report = now
    if total is not None and done < total:
        raise FetchError(f"truncated: got {done:,} of {total:,} bytes from {url}")
    if progress is not None:
        progress(done, total)
    return hasher.hexdigest()


def _fsync_directory(directory: Path) -> None:
    """Make the rename durable; best effort (not every platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fetch_text(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    ca_file: str | None = None,
    limit: int = 32 * 2**20,
    destinations: Destinations | None = None,
) -> str:
    """A small text document (a `.sha256` sidecar, a simple-API page); FetchError on failure."""
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise FetchError(f"cannot read {url}: only http and https URLs are supported")
    request = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with _opener(ca_file, destinations).open(request, timeout=30.0) as response:
            body: bytes = response.read(limit + 1)
    except urllib.error.HTTPError as exc:
        exc.close()
        raise FetchError(f"HTTP {exc.code} {exc.reason} from {url}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise FetchError(f"cannot read {url}: {_reason(exc, 30.0)}") from None
    if len(body) > limit:
        raise FetchError(f"too large: {url} sent more than {limit:,} bytes")
    return body.decode("utf-8", "replace")
