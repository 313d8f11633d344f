"""The gateway's upstream HTTP client (apps.gateway.upstream) against real sockets.

Each test starts an asyncio server on 127.0.0.1 that answers with exactly the bytes the test
scripts, so framing, keep-alive, closes and faults happen on the wire as they would with an
engine, not in a mock of the client.
"""

from __future__ import annotations

import asyncio
import datetime
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from apps.gateway.upstream import HIGH_WATER, ConnectError, Disconnected, Pool, ReadTimeout, UpstreamError
from tests.gateway.mock_engine import closed_port

WAIT = 5.0

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


class Server:
    """Counts connections and keeps every request head it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[tuple[bytes, bytes]] = []  # (head, body)
        self.closed_by_client = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=ssl_context)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/chat/completions"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            await self.handler(reader, writer, self)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_client.set()
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes | None:
        """One request's body, its head kept in self.requests; None when the client closed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            self.closed_by_client.set()
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length)
        self.requests.append((head, body))
        return body

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in self.writers:  # a handler still waiting must not hold the test up
                writer.transport.abort()
            await self.server.wait_closed()


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[Server]]]:
    servers: list[Server] = []

    async def start(handler: Handler) -> Server:
        server = await Server(handler).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def pool() -> AsyncIterator[Pool]:
    upstream = Pool(connect_timeout=2, read_timeout=WAIT)
    yield upstream
    await upstream.close()


def answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        b"".join(h + b"\r\n" for h in extra),
        body,
    )


async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
    while (body := await server.read_request(reader)) is not None:
        writer.write(answer(b'{"echo": %d}' % len(body)))
        await writer.drain()


async def test_a_request_is_sent_with_its_host_length_and_headers_and_the_answer_read(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    server = await serve(keep_alive)
    async with await pool.post(
        server.url, b'{"model": "m"}', [("Content-Type", "application/json"), ("Authorization", "Bearer s")]
    ) as response:
        assert response.status == 200
        assert response.headers["content-type"] == "application/json"
        assert await response.read() == b'{"echo": 14}'
    head, body = server.requests[0]
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}" in lines
    assert "Content-Length: 14" in lines
    assert "Authorization: Bearer s" in lines
    assert "Accept-Encoding: identity" in lines  # a compressed answer would reach the client unreadable
    assert body == b'{"model": "m"}'


async def test_answers_read_to_the_end_reuse_one_connection(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    server = await serve(keep_alive)
    for _ in range(5):
        async with await pool.post(server.url, b"{}") as response:
            await response.read()
    assert server.connections == 1
    assert pool.idle_count() == 1


async def test_an_answer_left_unread_closes_its_connection_so_the_upstream_stops(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        while True:  # a stream that would go on for ever while someone reads it
            writer.write(b"5\r\nhello\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    server = await serve(endless)
    async with await pool.post(server.url, b"{}") as response:
        async for _chunk in response.iter_chunks():
            break
    assert pool.idle_count() == 0
    async with asyncio.timeout(WAIT):
        await server.closed_by_client.wait()  # its next write failed: the client is gone
    server.handler = keep_alive
    async with await pool.post(server.url, b"{}") as response:
        assert response.status == 200
    assert server.connections == 2


async def test_a_chunked_answer_arrives_chunk_by_chunk_and_reads_whole(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    proceed = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while await server.read_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                b"d\r\ndata: first\n\n\r\n"
            )
            await writer.drain()
            await proceed.wait()
            writer.write(b"e\r\ndata: second\n\n\r\n0\r\n\r\n")
            await writer.drain()
            proceed.clear()

    server = await serve(chunked)
    async with await pool.post(server.url, b"{}") as response:
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"data: first\n\n"  # before the rest was even written
        proceed.set()
        assert [c async for c in chunks] == [b"data: second\n\n"]
    proceed.set()
    async with await pool.post(server.url, b"{}") as response:
        assert await response.read() == b"data: first\n\ndata: second\n\n"
    assert server.connections == 1


async def test_an_answer_without_a_length_ends_with_its_connection_and_is_not_reused(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await writer.drain()

    server = await serve(until_close)
    for _ in range(2):
        async with await pool.post(server.url, b"{}") as response:
            assert await response.read() == b"all of it"
    assert server.connections == 2
    assert pool.idle_count() == 0


async def test_a_connection_the_upstream_closed_while_idle_is_not_used_again(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(answer(b"{}"))  # says nothing of closing, then closes: an idle timeout
        await writer.drain()

    server = await serve(one_then_close)
    async with await pool.post(server.url, b"{}") as response:
        await response.read()
    async with asyncio.timeout(WAIT):
        while pool.idle_count():
            await asyncio.sleep(0.005)
    async with await pool.post(server.url, b"{}") as response:
        assert await response.read() == b"{}"
    assert server.connections == 2


async def test_a_kept_connection_closed_as_the_request_was_sent_is_tried_once_more_on_a_new_one(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def drop_second(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        if server.connections == 1:
            await server.read_request(reader)
            writer.write(answer(b"{}"))
            await writer.drain()
            await server.read_request(reader)  # the second request on this connection: closed unanswered
            return
        await keep_alive(reader, writer, server)

    server = await serve(drop_second)
    async with await pool.post(server.url, b"{}") as response:
        await response.read()
    async with await pool.post(server.url, b"{}") as response:
        assert response.status == 200
        assert await response.read() == b'{"echo": 2}'
    assert server.connections == 2
    assert len(server.requests) == 3


async def test_the_retry_after_a_stale_connection_opens_a_new_one_rather_than_another_stale_one(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    """Two connections sat idle past the server's patience; both are dropped as a request arrives."""

    async def first_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        if server.connections <= 2:
            await server.read_request(reader)
            writer.write(answer(b"{}"))
            await writer.drain()
            await server.read_request(reader)  # the next request on a kept connection: closed unanswered
            return
        await keep_alive(reader, writer, server)

    server = await serve(first_only)
    first, second = await pool.post(server.url, b"{}"), await pool.post(server.url, b"{}")  # two at once
    for response in (first, second):
        async with response:
            await response.read()
    assert pool.idle_count() == 2
    async with await pool.post(server.url, b"{}") as response:
        assert response.status == 200 and await response.read() == b'{"echo": 2}'
    assert server.connections == 3


async def test_a_connection_is_not_used_past_the_idle_time_the_server_announced(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def announces(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        while (body := await server.read_request(reader)) is not None:  # as llama.cpp does, with 1.5 s
            writer.write(answer(b'{"echo": %d}' % len(body), b"Keep-Alive: timeout=1.5, max=100"))
            await writer.drain()

    server = await serve(announces)
    for _ in range(2):  # back to back: well within the server's time, one connection
        async with await pool.post(server.url, b"{}") as response:
            await response.read()
    assert server.connections == 1
    await asyncio.sleep(0.7)  # past 1.5 s less the margin; the server has not closed it (yet)
    assert pool.idle_count() == 1
    async with await pool.post(server.url, b"{}") as response:
        assert await response.read() == b'{"echo": 2}'
    assert server.connections == 2


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("timeout=5, max=100", 5.0),
        ("max=3, Timeout = 2", 2.0),
        ("max=100", None),
        ("timeout=soon", None),
        ("timeout=nan", None),
        ("", None),
    ],
)
def test_the_keep_alive_timeout_is_read_from_the_header(header: str, expected: float | None) -> None:
    from apps.gateway.upstream import _keep_alive_timeout

    assert _keep_alive_timeout(header) == expected


async def test_a_new_connection_closed_before_any_answer_is_disconnected(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)

    server = await serve(hang_up)
    with pytest.raises(Disconnected, match="before answering"):
        await pool.post(server.url, b"{}")
    assert server.connections == 1  # never retried: the engine may have started on it


async def test_a_body_cut_short_is_disconnected(serve: Callable[[Handler], Awaitable[Server]], pool: Pool) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await writer.drain()

    server = await serve(cut)
    async with await pool.post(server.url, b"{}") as response:
        with pytest.raises(Disconnected, match="while it was sent"):
            await response.read()
    assert pool.idle_count() == 0


async def test_a_port_nobody_listens_on_is_a_connect_error_naming_it(pool: Pool) -> None:
    port = closed_port()
    with pytest.raises(ConnectError, match=f"127.0.0.1:{port}"):
        await pool.post(f"http://127.0.0.1:{port}/v1/chat/completions", b"{}")


async def test_an_upstream_that_stays_silent_is_a_read_timeout(serve: Callable[[Handler], Awaitable[Server]]) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        await asyncio.sleep(WAIT * 2)

    server = await serve(silent)
    upstream = Pool(read_timeout=0.2)
    try:
        with pytest.raises(ReadTimeout, match="sent nothing for 0.2 s"):
            await upstream.post(server.url, b"{}")
        assert upstream.idle_count() == 0
    finally:
        await upstream.close()


async def test_an_answer_that_is_not_http_is_an_error(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(WAIT)

    server = await serve(garbage)
    with pytest.raises(UpstreamError, match="not valid HTTP"):
        await pool.post(server.url, b"{}")


async def test_an_interim_answer_is_skipped_for_the_real_one(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    async def interim(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + answer(b'{"ok": true}'))
        await writer.drain()
        await asyncio.sleep(WAIT)

    server = await serve(interim)
    async with await pool.post(server.url, b"{}") as response:
        assert response.status == 200
        assert await response.read() == b'{"ok": true}'


async def test_a_header_value_with_a_line_break_is_refused_before_anything_is_sent(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    server = await serve(keep_alive)
    with pytest.raises(UpstreamError, match="line break"):
        await pool.post(server.url, b"{}", [("Authorization", "Bearer a\r\nX-Injected: 1")])
    assert server.connections == 0


async def test_a_slow_reader_holds_the_upstream_back_instead_of_buffering_all_of_it(
    serve: Callable[[Handler], Awaitable[Server]], pool: Pool
) -> None:
    piece = b"x" * 65536
    pieces = 128  # 8 MiB

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, server: Server) -> None:
        await server.read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (len(piece) * pieces))
        for _ in range(pieces):
            writer.write(piece)
            await writer.drain()

    server = await serve(flood)
    total = 0
    largest = 0
    async with await pool.post(server.url, b"{}") as response:
        async for chunk in response.iter_chunks():
            total += len(chunk)
            largest = max(largest, len(chunk))
            await asyncio.sleep(0.002)  # slower than loopback delivers
    assert total == len(piece) * pieces
    # What waits unread is bounded by the high-water mark plus what one socket read brings in.
    assert largest <= HIGH_WATER + 1024 * 1024


# TLS ---------------------------------------------------------------------------------------------


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


async def test_https_is_spoken_to_a_provider_whose_certificate_is_trusted_and_refused_otherwise(tmp_path: Path) -> None:
    cert_file, key_file = _self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert_file, key_file)
    server = await Server(keep_alive).start(server_context)
    url = f"https://localhost:{server.port}/v1/chat/completions"
    trusting = Pool(ssl_context=ssl.create_default_context(cafile=str(cert_file)))
    default = Pool()
    try:
        async with await trusting.post(url, b"{}") as response:
            assert await response.read() == b'{"echo": 2}'
        assert server.requests[0][0].split(b"\r\n")[1] == f"Host: localhost:{server.port}".encode()
        with pytest.raises(ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await default.post(url, b"{}")
    finally:
        await trusting.close()
        await default.close()
        await server.stop()
