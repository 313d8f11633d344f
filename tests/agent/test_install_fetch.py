"""Downloading engine archives from a real local HTTP server: verified files land in place,
everything else leaves no file behind and says why in one line."""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agent.install import fetch
from agent.install.fetch import FetchError, download, human_bytes, progress_text

BODY = bytes(range(256)) * 40  # 10,240 bytes
BODY_SHA = hashlib.sha256(BODY).hexdigest()
BIG_CHUNK = b"\x5a" * 2**20
BIG_CHUNKS = 50  # a 50 MiB body, sent one reused chunk at a time
SLOW_CHUNKS, SLOW_CHUNK_BYTES, SLOW_GAP_S = 6, 1000, 0.5


def _big_sha() -> str:
    hasher = hashlib.sha256()
    for _ in range(BIG_CHUNKS):
        hasher.update(BIG_CHUNK)
    return hasher.hexdigest()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    #: (path, headers) of every request, in order
    seen: list[tuple[str, dict[str, str]]]
    release: threading.Event
    other_port: int


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _head(self, length: int | None, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/gzip")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def do_GET(self) -> None:
        self.server.seen.append((self.path, dict(self.headers.items())))
        if self.path == "/file":
            self._head(len(BODY))
            self.wfile.write(BODY)
        elif self.path == "/redirect":  # like github.com/.../releases/download/... -> a storage host
            self.send_response(302)
            self.send_header("Location", "/file")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/redirect-other-host":  # the same host, another port: another server
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.other_port}/file")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/no-length":  # HTTP/1.0: the body ends when the connection closes
            self._head(None)
            self.wfile.write(BODY)
        elif self.path == "/truncated":
            self._head(1000)
            self.wfile.write(BODY[:500])
        elif self.path == "/slow":
            self._head(SLOW_CHUNKS * SLOW_CHUNK_BYTES)
            for index in range(SLOW_CHUNKS):
                if index:
                    time.sleep(SLOW_GAP_S)
                self.wfile.write(BODY[:SLOW_CHUNK_BYTES])
        elif self.path == "/hang":
            self._head(len(BODY))
            self.wfile.write(BODY[:10])
            self.server.release.wait(10)
        elif self.path == "/big":
            self._head(BIG_CHUNKS * len(BIG_CHUNK))
            for _ in range(BIG_CHUNKS):
                self.wfile.write(BIG_CHUNK)
        elif self.path == "/gone":
            self.send_error(410)
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    """The server the tests ask, and a second one on another port that it redirects to."""
    servers = [_Server(("127.0.0.1", 0), _Handler) for _ in range(2)]
    seen: list[tuple[str, dict[str, str]]] = []
    threads = []
    for httpd in servers:
        httpd.seen, httpd.release, httpd.other_port = seen, threading.Event(), servers[1].server_address[1]
        threads.append(threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True))
        threads[-1].start()
    yield servers[0]
    for httpd, thread in zip(servers, threads, strict=True):
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.fixture
def base(server: _Server) -> str:
    server.seen.clear()
    return f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy from the test machine's environment would swallow requests to 127.0.0.1."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


def _leftovers(dest: Path) -> list[str]:
    return sorted(path.name for path in dest.parent.iterdir())


def _recorder() -> tuple[list[tuple[int, int | None]], Callable[[int, int | None], None]]:
    calls: list[tuple[int, int | None]] = []
    return calls, lambda done, total: calls.append((done, total))


# --------------------------------------------------------------------------- success


def test_download_writes_the_file_and_returns_its_digest(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "llama-b6500-bin-ubuntu-x64.tar.gz"
    assert download(f"{base}/file", dest, sha256=BODY_SHA, size=len(BODY)) == BODY_SHA
    assert dest.read_bytes() == BODY
    assert _leftovers(dest) == [dest.name]


def test_github_style_digest_and_upper_case_are_accepted(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    assert download(f"{base}/file", dest, sha256=f"sha256:{BODY_SHA.upper()}") == BODY_SHA
    assert dest.read_bytes() == BODY


def test_redirect_is_followed(base: str, server: _Server, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    download(f"{base}/redirect", dest, sha256=BODY_SHA, headers={"Accept": "application/octet-stream"})
    assert dest.read_bytes() == BODY
    assert [path for path, _ in server.seen] == ["/redirect", "/file"]
    assert server.seen[1][1]["Accept"] == "application/octet-stream"


def test_credentials_are_not_sent_on_to_another_host(base: str, server: _Server, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    headers = {"Authorization": "Bearer secret", "Accept": "application/octet-stream"}
    download(f"{base}/redirect-other-host", dest, sha256=BODY_SHA, headers=headers)
    assert dest.read_bytes() == BODY
    (first_path, first), (second_path, second) = server.seen
    assert (first_path, second_path) == ("/redirect-other-host", "/file")
    assert first["Authorization"] == "Bearer secret"
    assert "Authorization" not in second
    assert second["Accept"] == "application/octet-stream"
    assert second["Host"] == f"127.0.0.1:{server.other_port}"


def test_body_without_content_length_is_checked_against_size(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    calls, progress = _recorder()
    download(f"{base}/no-length", dest, sha256=BODY_SHA, size=len(BODY), progress=progress)
    assert dest.read_bytes() == BODY
    assert calls[0] == (0, len(BODY))
    assert calls[-1] == (len(BODY), len(BODY))


def test_success_replaces_an_older_file(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    dest.write_bytes(b"old")
    download(f"{base}/file", dest, sha256=BODY_SHA)
    assert dest.read_bytes() == BODY


# --------------------------------------------------------------------------- refusals


def test_digest_mismatch_leaves_no_file(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    wrong = "ab" * 32
    with pytest.raises(FetchError) as caught:
        download(f"{base}/file", dest, sha256=wrong)
    assert str(caught.value) == f"digest mismatch for a.tar.gz: expected sha256 {wrong[:12]}…, got {BODY_SHA[:12]}…"
    assert _leftovers(dest) == []


def test_failure_leaves_an_older_file_untouched(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    dest.write_bytes(b"old")
    with pytest.raises(FetchError, match="digest mismatch"):
        download(f"{base}/file", dest, sha256="0" * 64)
    assert dest.read_bytes() == b"old"
    assert _leftovers(dest) == ["a.tar.gz"]


def test_missing_digest_is_refused_without_a_request(base: str, server: _Server, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError) as caught:
        download(f"{base}/file", dest, sha256=None)
    assert str(caught.value) == "no sha256 published for a.tar.gz: refusing an unchecked download"
    assert server.seen == []
    assert _leftovers(dest) == []


def test_malformed_digest_is_refused(base: str, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="malformed sha256 for a.tar.gz"):
        download(f"{base}/file", tmp_path / "a.tar.gz", sha256="md5:1234")


def test_truncated_body_is_refused(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError) as caught:
        download(f"{base}/truncated", dest, sha256=BODY_SHA)
    assert str(caught.value) == f"truncated: got 500 of 1,000 bytes from {base}/truncated"
    assert _leftovers(dest) == []


def test_body_shorter_than_the_expected_size_is_truncated(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError, match=re.escape(f"truncated: got 10,240 of 20,000 bytes from {base}/no-length")):
        download(f"{base}/no-length", dest, sha256=BODY_SHA, size=20_000)
    assert _leftovers(dest) == []


def test_body_longer_than_the_expected_size_is_refused(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError, match=r"too large: .* sent at least [\d,]+ bytes, more than the expected 5,000"):
        download(f"{base}/no-length", dest, sha256=BODY_SHA, size=5000)
    assert _leftovers(dest) == []


def test_announced_size_that_differs_from_the_expected_one_is_refused(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError) as caught:
        download(f"{base}/file", dest, sha256=BODY_SHA, size=len(BODY) - 1)
    assert str(caught.value) == f"size mismatch for a.tar.gz: {base}/file announces 10,240 bytes, expected 10,239"
    assert _leftovers(dest) == []


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/file", "announces 10,240 bytes, more than the limit of 4,096"),
        ("/no-length", "bytes, more than the limit of 4,096"),
    ],
)
def test_body_over_max_bytes_is_refused(base: str, tmp_path: Path, path: str, message: str) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError, match=re.escape(message)):
        download(f"{base}{path}", dest, sha256=BODY_SHA, max_bytes=4096)
    assert _leftovers(dest) == []


def test_expected_size_over_max_bytes_is_refused_without_a_request(base: str, server: _Server, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=re.escape("a.tar.gz is 10,240 bytes, more than the limit of 4,096")):
        download(f"{base}/file", tmp_path / "a.tar.gz", sha256=BODY_SHA, size=len(BODY), max_bytes=4096)
    assert server.seen == []


@pytest.mark.parametrize(("path", "status"), [("/missing", "404 Not Found"), ("/gone", "410 Gone")])
def test_http_error_is_reported_with_its_status(base: str, tmp_path: Path, path: str, status: str) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError) as caught:
        download(f"{base}{path}", dest, sha256=BODY_SHA)
    assert str(caught.value) == f"HTTP {status} from {base}{path}"
    assert _leftovers(dest) == []


def test_refused_connection_is_reported(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/file"
    with pytest.raises(FetchError, match=re.escape(f"cannot download {url}: ")):
        download(url, tmp_path / "a.tar.gz", sha256=BODY_SHA)
    assert _leftovers(tmp_path / "a.tar.gz") == []


def test_stalled_body_times_out(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"
    with pytest.raises(FetchError, match=r"timed out after 0\.3 s waiting for data from .*/hang \(got 10 bytes\)"):
        download(f"{base}/hang", dest, sha256=BODY_SHA, timeout=0.3)
    assert _leftovers(dest) == []


def test_unsupported_scheme_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="only http and https"):
        download("file:///etc/passwd", tmp_path / "a", sha256=BODY_SHA)


def test_malformed_url_is_reported(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match=re.escape("cannot download http://127.0.0.1:abc/x: nonnumeric port")):
        download("http://127.0.0.1:abc/x", tmp_path / "a", sha256=BODY_SHA)


def test_unreadable_ca_bundle_is_reported(base: str, tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="cannot load the CA bundle"):
        download(f"{base}/file", tmp_path / "a", sha256=BODY_SHA, ca_file=str(tmp_path / "missing.pem"))


def test_exception_from_progress_passes_through_and_cleans_up(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "a.tar.gz"

    def cancel(done: int, total: int | None) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        download(f"{base}/file", dest, sha256=BODY_SHA, progress=cancel)
    assert _leftovers(dest) == []


# --------------------------------------------------------------------------- progress and memory


def test_progress_is_reported_while_a_slow_body_flows(base: str, tmp_path: Path) -> None:
    total = SLOW_CHUNKS * SLOW_CHUNK_BYTES
    calls, progress = _recorder()
    sha = hashlib.sha256(BODY[:SLOW_CHUNK_BYTES] * SLOW_CHUNKS).hexdigest()
    download(f"{base}/slow", tmp_path / "a.tar.gz", sha256=sha, progress=progress)
    assert calls[0] == (0, total)
    assert calls[-1] == (total, total)
    assert any(0 < done < total for done, _ in calls)  # reported between the first and the last byte
    dones = [done for done, _ in calls]
    assert dones == sorted(dones)


def test_progress_is_throttled(base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch, "PROGRESS_EVERY_S", 3600.0)
    calls, progress = _recorder()
    total = BIG_CHUNKS * len(BIG_CHUNK)
    download(f"{base}/big", tmp_path / "big.tar.gz", sha256=_big_sha(), progress=progress)
    assert calls == [(0, total), (total, total)]


def test_large_download_is_streamed_not_held_in_memory(base: str, tmp_path: Path) -> None:
    dest = tmp_path / "big.tar.gz"
    sha = _big_sha()
    tracemalloc.start()
    try:
        download(f"{base}/big", dest, sha256=sha)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dest.stat().st_size == BIG_CHUNKS * len(BIG_CHUNK)
    assert peak < 8 * 2**20


# --------------------------------------------------------------------------- text


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1 kB"),
        (512_000, "512 kB"),
        (999_999, "1 MB"),
        (3_100_000, "3.1 MB"),
        (9_960_000, "10 MB"),
        (16_000_000, "16 MB"),
        (16_900_000, "17 MB"),
        (594_000_000, "594 MB"),
        (1_200_000_000, "1.2 GB"),
        (64 * 2**30, "69 GB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_progress_text() -> None:
    name = "llama-b10991-bin-ubuntu-x64.tar.gz"
    assert progress_text(name, 6_400_000, 16_000_000) == f"downloading {name} (16 MB, 40 %)"
    assert progress_text(name, 6_399_999, 16_000_000) == f"downloading {name} (16 MB, 39 %)"
    assert progress_text(name, 16_000_000, 16_000_000) == f"downloading {name} (16 MB, 100 %)"
    assert progress_text(name, 3_100_000, None) == f"downloading {name} (3.1 MB so far)"
