"""Request bodies outside /v1 are bounded before anything reads them (llmgw/bodylimit.py).

Most tests talk to a real `llmgw web` (uvicorn serving llmgw.asgi:application, with its own
TMPDIR) over a raw socket, so that what is sent is exactly what the test says: headers that
declare gigabytes followed by a few bytes, or a chunked body that keeps coming. What the server
writes to disk is read from /proc/<pid>/fd: Django's spooled body becomes an unnamed temporary
file (O_TMPFILE), which a listing of the folder would never show. The first tests drive the
middleware directly, with no server, for what only an ASGI conversation shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from llmgw.bodylimit import BodyLimit, refusal
from tests.e2e.helpers import REPO, Browser, drop_pg_database, free_port, llmgw_env, pg_database_url

MiB = 1024 * 1024
LIMIT = 16 * MiB  # the default of LLMGW_MAX_REQUEST_BODY_BYTES, which the server below runs with
GATEWAY_LIMIT = 32 * MiB  # the default of LLMGW_GATEWAY_MAX_BODY_BYTES
WAIT = 10.0  # a bound on waiting for what should come at once; never reached when all is well
PASSWORD = "correct horse battery"


# The middleware on its own ------------------------------------------------------------------------


class Conversation:
    """One request's ASGI messages: what the server would deliver, and what the app sent back."""

    def __init__(self, *messages: dict[str, Any]) -> None:
        self.incoming = list(messages)
        self.received = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        if not self.incoming:
            return {"type": "http.disconnect"}
        return self.incoming.pop(0)

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def http_scope(path: str = "/healthz", **headers: str) -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(name.replace("_", "-").encode(), value.encode()) for name, value in headers.items()],
    }


class Reader:
    """An app that reads the whole body, as Django's ASGIHandler does, and notes what it was given."""

    def __init__(self) -> None:
        self.called = False
        self.messages: list[dict[str, Any]] = []
        self.receive: Any = None
        self.send: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.called, self.receive, self.send = True, receive, send
        while True:
            message = await receive()
            self.messages.append(message)
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        if message["type"] == "http.request":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})


async def test_a_request_without_a_body_reaches_the_app_with_the_servers_own_receive_and_send() -> None:
    app, talk = Reader(), Conversation({"type": "http.request", "body": b""})
    await BodyLimit(app, max_bytes=10)(http_scope(), talk.receive, talk.send)
    assert app.receive == talk.receive and app.send == talk.send  # nothing wrapped, nothing counted


async def test_a_declared_length_within_the_limit_passes_untouched() -> None:
    app, talk = Reader(), Conversation({"type": "http.request", "body": b"0123456789"})
    await BodyLimit(app, max_bytes=10)(http_scope(content_length="10"), talk.receive, talk.send)
    assert app.receive == talk.receive and app.send == talk.send
    assert talk.sent[0]["status"] == 200


async def test_a_declared_length_over_the_limit_is_refused_without_calling_the_app_or_reading_the_body() -> None:
    app, talk = Reader(), Conversation({"type": "http.request", "body": b"x" * 11})
    await BodyLimit(app, max_bytes=10)(http_scope(content_length="4200000000"), talk.receive, talk.send)
    assert not app.called
    assert talk.received == 0  # so uvicorn never sends "100 Continue" either
    start, body = talk.sent
    assert start["status"] == 413
    headers = dict(start["headers"])
    assert headers[b"connection"] == b"close"
    assert headers[b"content-type"] == b"text/plain; charset=utf-8"
    assert body["body"] == b"The request body is over the limit of 10 bytes (Content-Length: 4200000000).\n"


async def test_a_chunked_body_is_handed_on_message_by_message_and_cut_off_past_the_limit() -> None:
    chunks = [{"type": "http.request", "body": b"x" * 4, "more_body": True} for _ in range(5)]
    app, talk = Reader(), Conversation(*chunks)
    await BodyLimit(app, max_bytes=10)(
        http_scope("/api/v1/models", transfer_encoding="chunked"), talk.receive, talk.send
    )
    # The first two messages (8 bytes) are the server's own objects, passed on as they came; the
    # third would make 12: the app gets a disconnect in its place, and nothing after it is read.
    assert app.messages[0] is chunks[0] and app.messages[1] is chunks[1]
    assert app.messages[2] == {"type": "http.disconnect"}
    assert talk.received == 3
    start, body = talk.sent
    assert start["status"] == 413 and dict(start["headers"])[b"content-type"] == b"application/json"
    assert json.loads(body["body"]) == {"detail": "The request body is over the limit of 10 bytes."}


async def test_after_the_413_an_answer_from_the_app_is_dropped_not_sent_twice() -> None:
    async def stubborn(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        await send({"type": "http.response.start", "status": 400, "headers": []})
        await send({"type": "http.response.body", "body": b"too late"})

    talk = Conversation(*[{"type": "http.request", "body": b"x" * 6, "more_body": True} for _ in range(3)])
    await BodyLimit(stubborn, max_bytes=10)(http_scope(transfer_encoding="chunked"), talk.receive, talk.send)
    assert [message.get("status") for message in talk.sent] == [413, None]


async def test_an_app_that_answered_before_reading_on_keeps_its_answer() -> None:
    async def early(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while (await receive())["type"] != "http.disconnect":
            pass
        await send({"type": "http.response.body", "body": b"done"})

    talk = Conversation(*[{"type": "http.request", "body": b"x" * 6, "more_body": True} for _ in range(3)])
    await BodyLimit(early, max_bytes=10)(http_scope(transfer_encoding="chunked"), talk.receive, talk.send)
    assert [message.get("status") for message in talk.sent] == [200, None]
    assert talk.sent[1]["body"] == b"done"


async def test_websockets_and_lifespan_pass_through() -> None:
    app = Reader()
    seen: list[str] = []

    async def other(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    for kind in ("websocket", "lifespan"):
        await BodyLimit(other, max_bytes=0)({"type": kind, "headers": []}, app, app)
    assert seen == ["websocket", "lifespan"]


def test_the_refusal_says_the_limit_in_bytes() -> None:
    assert refusal("/login/", 16 * MiB) == (
        b"The request body is over the limit of 16777216 bytes.\n",
        b"text/plain; charset=utf-8",
    )


def test_the_default_is_16_mib_and_djangos_own_limits_agree(settings: Any) -> None:
    if "LLMGW_MAX_REQUEST_BODY_BYTES" in os.environ:
        pytest.skip("LLMGW_MAX_REQUEST_BODY_BYTES is set in this environment")
    assert settings.MAX_REQUEST_BODY_BYTES == LIMIT
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE == LIMIT
    assert settings.FILE_UPLOAD_MAX_MEMORY_SIZE <= LIMIT


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("16M", "LLMGW_MAX_REQUEST_BODY_BYTES='16M': expected a whole number"),
        ("1024", "LLMGW_MAX_REQUEST_BODY_BYTES=1024: expected at least 65536"),
    ],
)
def test_a_malformed_limit_stops_startup_naming_the_variable(tmp_path: Path, value: str, expected: str) -> None:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    environment.update({"LLMGW_DATA_DIR": str(tmp_path), "LLMGW_MAX_REQUEST_BODY_BYTES": value})
    result = subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "check"],
        capture_output=True,
        text=True,
        env=environment,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode != 0
    assert expected in result.stderr


# A real server ------------------------------------------------------------------------------------


SETUP = """
from apps.accounts.models import User
from apps.accounts.services import create_api_key
user = User.objects.create_superuser("ops@example.com", "{password}")
print("KEY=" + create_api_key(user, name="body limits", actor=None).secret)
"""


@dataclass
class Server:
    port: int
    pid: int
    tmpdir: Path
    log: Path
    key: str
    mark: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_since_mark(self) -> str:
        return self.log.read_bytes()[self.mark :].decode(errors="replace")

    def rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def open_temp_files(self) -> dict[str, int]:
        """The files the server has open under its TMPDIR (named or not), with their sizes."""
        found: dict[str, int] = {}
        folder = str(self.tmpdir)
        fds = Path(f"/proc/{self.pid}/fd")
        for fd in os.listdir(fds):
            try:
                target = os.readlink(fds / fd)
                if target.startswith(folder):
                    found[target] = os.stat(fds / fd).st_size
            except OSError:
                continue  # closed while we looked
        return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("body-limits")
    tmpdir = root / "tmp"
    tmpdir.mkdir()
    port = free_port()
    database = pg_database_url()
    env = llmgw_env(
        root / "data",
        port,
        TMPDIR=str(tmpdir),
        LLMGW_LOG_LEVEL="info",
        **({"LLMGW_DATABASE_URL": database} if database else {}),
    )
    manage = [sys.executable, "-m", "llmgw", "manage"]
    try:
        subprocess.run([*manage, "migrate", "-v0"], env=env, cwd=REPO, check=True, timeout=300)
        subprocess.run([*manage, "collectstatic", "--noinput", "-v0"], env=env, cwd=REPO, check=True, timeout=300)
        made = subprocess.run(
            [*manage, "shell", "-c", SETUP.format(password=PASSWORD)],
            env=env,
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        key = next(line[4:] for line in made.stdout.splitlines() if line.startswith("KEY="))
        log = root / "web.log"
        with log.open("wb") as output:
            web = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "web"], env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT
            )
        try:
            deadline = time.monotonic() + 120
            while True:
                assert web.poll() is None, "llmgw web exited:\n" + log.read_text(errors="replace")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
                        if answer.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError):
                    pass
                if time.monotonic() >= deadline:
                    pytest.fail("llmgw web did not answer /healthz")
                time.sleep(0.1)
            yield Server(port=port, pid=web.pid, tmpdir=tmpdir, log=log, key=key)
        finally:
            web.terminate()
            web.wait(timeout=30)
    finally:
        if database:
            drop_pg_database(database)


@pytest.fixture
def web(server: Server) -> Iterator[Server]:
    """The server, and after the test: its log holds no traceback or error, no temp file is left open."""
    server.mark = server.log.stat().st_size
    yield server
    deadline = time.monotonic() + WAIT
    while server.open_temp_files() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.open_temp_files() == {}
    assert os.listdir(server.tmpdir) == []
    # The access log line is written just after the answer: give it a moment, then read.
    time.sleep(0.2)
    written = server.log_since_mark()
    assert "Traceback" not in written and "ERROR" not in written, written


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    interim: list[int] = field(default_factory=list)

    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return json.loads(self.body)


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)


def request_head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_answer(sock: socket.socket) -> Answer:
    """The final answer on `sock` (1xx answers before it are noted), read by its Content-Length."""
    buffer = b""
    interim: list[int] = []

    def more() -> None:
        nonlocal buffer
        data = sock.recv(65536)
        if not data:
            raise AssertionError(f"the connection closed before a whole answer; had {buffer!r}")
        buffer += data

    while True:
        while b"\r\n\r\n" not in buffer:
            more()
        head, _, buffer = buffer.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        if 100 <= status < 200:
            interim.append(status)
            continue
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
        length = int(headers.get("content-length", "0"))
        while len(buffer) < length:
            more()
        return Answer(status, headers, buffer[:length], interim)


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def stream_chunked(sock: socket.socket, total: int, chunk_size: int = MiB, finish: bool = True) -> int:
    """Send up to `total` bytes as chunks, stopping as soon as the server answers or stops taking them."""
    frame = b"%x\r\n" % chunk_size + b"x" * chunk_size + b"\r\n"
    sent = 0
    while sent < total:
        readable, _, _ = select.select([sock], [], [], 0)
        if readable:
            return sent
        try:
            sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError):
            return sent
        sent += chunk_size
    if finish:
        sock.sendall(b"0\r\n\r\n")
    return sent


class TempFileWatch:
    """Samples the server's open temporary files in a thread: the largest size any reached."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.peak = 0
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, size in self.server.open_temp_files().items():
                self.seen.add(name)
                self.peak = max(self.peak, size)
            time.sleep(0.001)

    def __enter__(self) -> TempFileWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("path", "content_type"),
    [
        ("/healthz", "application/octet-stream"),
        ("/api/v1/organizations", "application/json"),
        ("/login/", "application/x-www-form-urlencoded"),
    ],
)
def test_a_declared_length_over_the_limit_is_answered_413_at_once_though_the_body_never_comes(
    web: Server, path: str, content_type: str
) -> None:
    declared = 4_200_000_000
    with connect(web) as sock:
        # The headers and three bytes: the other 4.2 GB never come. Answering at all proves the
        # server did not wait for them; the closed connection, that it does not go on reading.
        sock.sendall(
            request_head("POST", path, {"Content-Type": content_type, "Content-Length": str(declared)}) + b"abc"
        )
        started = time.monotonic()
        answer = read_answer(sock)
        took = time.monotonic() - started
        assert closed_by_server(sock)
    assert answer.status == 413
    assert took < 2, f"the 413 took {took:.2f} s"
    assert answer.headers["connection"] == "close"
    expected = f"The request body is over the limit of {LIMIT} bytes (Content-Length: {declared})."
    if path.startswith("/api/"):
        assert answer.headers["content-type"] == "application/json"
        assert answer.json() == {"detail": expected}
    else:
        assert answer.headers["content-type"].startswith("text/plain")
        assert answer.text().strip() == expected


@pytest.mark.e2e
def test_a_client_that_waits_for_100_continue_is_refused_without_being_asked_for_the_body(web: Server) -> None:
    with connect(web) as sock:
        sock.sendall(request_head("POST", "/healthz", {"Content-Length": str(LIMIT + 1), "Expect": "100-continue"}))
        answer = read_answer(sock)
    assert answer.status == 413
    assert answer.interim == []  # no "100 Continue": the body was never asked for


@pytest.mark.e2e
def test_a_body_within_the_limit_is_spooled_where_the_watch_sees_it(web: Server) -> None:
    # The control for the next test: an 8 MiB body, held open before its last chunk, is on disk in
    # the server's TMPDIR (past FILE_UPLOAD_MAX_MEMORY_SIZE), and the watch sees the unnamed file.
    with connect(web) as sock, TempFileWatch(web) as watch:
        sock.sendall(request_head("POST", "/healthz", {"Transfer-Encoding": "chunked"}))
        assert stream_chunked(sock, 8 * MiB, finish=False) == 8 * MiB
        # The file's size trails what Django wrote by what its buffered writer still holds.
        nearly = 8 * MiB - 64 * 1024
        deadline = time.monotonic() + WAIT
        while watch.peak < nearly and time.monotonic() < deadline:
            time.sleep(0.01)
        assert nearly <= watch.peak <= 8 * MiB, f"the watch saw {watch.peak} bytes in {sorted(watch.seen)}"
        sock.sendall(b"0\r\n\r\n")
        answer = read_answer(sock)
    assert answer.status != 413  # Django had the whole body and answered it (a POST to a GET-only view)


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["/healthz", "/api/v1/organizations"])
def test_a_chunked_body_is_cut_off_past_the_limit_and_its_temp_file_never_grows_past_it(web: Server, path: str) -> None:
    with connect(web) as sock, TempFileWatch(web) as watch:
        sock.sendall(request_head("POST", path, {"Transfer-Encoding": "chunked"}))
        sent = stream_chunked(sock, 200 * MiB)
        answer = read_answer(sock)
        assert closed_by_server(sock)
    assert answer.status == 413
    assert str(LIMIT) in answer.text()
    # The client was stopped soon after the limit (what else it sent sat in socket buffers), and
    # what reached a file was never more than the limit; the file is gone (see `web`).
    assert LIMIT < sent < LIMIT + 32 * MiB, sent
    assert 0 < watch.peak <= LIMIT, watch.peak


@pytest.mark.e2e
def test_a_200_mb_upload_attempt_leaves_the_servers_memory_where_it_was(web: Server) -> None:
    def attempt() -> int:
        with connect(web) as sock:
            sock.sendall(request_head("POST", "/healthz", {"Transfer-Encoding": "chunked"}))
            sent = stream_chunked(sock, 200 * MiB)
            assert read_answer(sock).status == 413
        return sent

    attempt()  # once first, so that whatever a first request allocates is in `before`
    before = web.rss()
    sent = attempt()
    grown = web.rss() - before
    assert sent > LIMIT
    # Holding even the allowed part of the body in memory would add 16 MiB.
    assert grown < 8 * MiB, f"the server's memory grew by {grown / MiB:.1f} MiB"


@pytest.mark.e2e
def test_small_posts_still_work_a_sign_in_form_and_an_api_call(web: Server) -> None:
    browser = Browser(web.url)
    status, _ = browser.post_form("/login/", {"username": "ops@example.com", "password": PASSWORD})
    assert status == 200
    assert any(cookie.name == "sessionid" for cookie in browser.jar), "signing in set no session"

    body = json.dumps({"name": "Body Limits Inc"}).encode()
    with connect(web) as sock:
        sock.sendall(
            request_head(
                "POST",
                "/api/v1/organizations",
                {
                    "Authorization": f"Bearer {web.key}",
                    "Content-Type": "application/json",
                    "Content-Length": str(len(body)),
                },
            )
            + body
        )
        answer = read_answer(sock)
    assert answer.status == 201, answer.body
    assert answer.json()["name"] == "Body Limits Inc"

    # Chunked and within the limit: counted on the way, and whole when it arrives. The form's
    # fields come after 3 MiB of padding, so signing in proves that Django had every byte.
    # (DRF reads no chunked body at all: with no Content-Length it takes the body to be empty.)
    other = Browser(web.url)
    _, page = other.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
    assert token, "no CSRF token on the sign-in page"
    cookie = "; ".join(f"{c.name}={c.value}" for c in other.jar)
    form = urllib.parse.urlencode(
        {
            "pad": "x" * (3 * MiB),
            "csrfmiddlewaretoken": token.group(1),
            "username": "ops@example.com",
            "password": PASSWORD,
        }
    ).encode()
    with connect(web) as sock:
        sock.sendall(
            request_head(
                "POST",
                "/login/",
                {
                    "Cookie": cookie,
                    "Content-Type": "application/x-www-form-urlencoded",
                    "Transfer-Encoding": "chunked",
                },
            )
        )
        for start in range(0, len(form), 100_000):
            piece = form[start : start + 100_000]
            sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        answer = read_answer(sock)
    assert answer.status == 302, answer.body
    assert "sessionid=" in answer.headers.get("set-cookie", "")


def chat_body(size: int) -> bytes:
    """A chat completion request of about `size` bytes, for a model that does not exist."""
    return json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x" * size}]}).encode()


@pytest.mark.e2e
def test_v1_keeps_the_gateways_own_limit_not_this_one(web: Server) -> None:
    # 20 MiB declared, no key: the gateway's 401 (this middleware would have said 413 at the header).
    with connect(web) as sock:
        sock.sendall(
            request_head(
                "POST", "/v1/chat/completions", {"Content-Type": "application/json", "Content-Length": str(20 * MiB)}
            )
        )
        answer = read_answer(sock)
    assert answer.status == 401, answer.body
    assert "error" in answer.json()

    # 20 MiB sent whole, with a key: the gateway reads all of it and answers about the model.
    body = chat_body(20 * MiB)
    with connect(web) as sock:
        sock.sendall(
            request_head(
                "POST",
                "/v1/chat/completions",
                {
                    "Authorization": f"Bearer {web.key}",
                    "Content-Type": "application/json",
                    "Content-Length": str(len(body)),
                },
            )
            + body
        )
        answer = read_answer(sock)
    assert answer.status == 404, answer.body
    assert answer.json()["error"]["code"] == "model_not_found"

    # Past the gateway's 32 MiB, streamed: the gateway's own 413, in its own (OpenAI) shape.
    with connect(web) as sock:
        sock.sendall(
            request_head(
                "POST",
                "/v1/chat/completions",
                {
                    "Authorization": f"Bearer {web.key}",
                    "Content-Type": "application/json",
                    "Transfer-Encoding": "chunked",
                },
            )
        )
        stream_chunked(sock, 64 * MiB)
        answer = read_answer(sock)
    assert answer.status == 413, answer.body
    assert str(GATEWAY_LIMIT) in answer.json()["error"]["message"]


async def test_the_middleware_wraps_django_alone_in_llmgw_asgi() -> None:
    from llmgw import asgi

    assert isinstance(asgi.django_app, BodyLimit)
    assert asgi.django_app.app is asgi.django_asgi
    assert asgi.django_app.max_bytes == asgi.settings.MAX_REQUEST_BODY_BYTES
    await asyncio.sleep(0)
