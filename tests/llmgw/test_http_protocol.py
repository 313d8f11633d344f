"""llmgw.http_protocol under uvicorn, on a real socket: a whole answer leaves in one write, a
stream's head leaves at once even though its first chunk comes later."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from llmgw.http_protocol import HeldHeadTransport, HttpProtocol

WAIT = 5.0
WRITES: list[bytes] = []


class RecordingTransport(HeldHeadTransport):
    """The protocol's transport, with every write that reaches the socket noted on the way."""

    __slots__ = ()

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        class Socket:
            def __getattr__(self, name: str) -> Any:
                return getattr(transport, name)

            def write(self, data: bytes) -> None:
                WRITES.append(bytes(data))
                transport.write(data)

        super().__init__(Socket(), loop)  # type: ignore[arg-type]


class RecordingProtocol(HttpProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super(HttpProtocol, self).connection_made(RecordingTransport(transport, self.loop))  # type: ignore[arg-type]


release_stream = asyncio.Event()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await receive()
    if scope["path"] == "/whole":
        body = b'{"answer": 42}'
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await release_stream.wait()
    await send({"type": "http.response.body", "body": b"data: late\n\n", "more_body": False})


@pytest.fixture
async def server() -> AsyncIterator[int]:
    WRITES.clear()
    release_stream.clear()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, http=RecordingProtocol)
    running = uvicorn.Server(config)
    task = asyncio.create_task(running.serve(sockets=[sock]))
    async with asyncio.timeout(WAIT):
        while not running.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.005)
    yield sock.getsockname()[1]
    release_stream.set()
    running.should_exit = True
    await task
    sock.close()


async def request(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
    await writer.drain()
    return reader, writer


async def test_a_whole_answer_leaves_in_one_write_head_and_body_together(server: int) -> None:
    reader, writer = await request(server, "/whole")
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(14)
    writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body == b'{"answer": 42}'
    assert len(WRITES) == 1
    assert WRITES[0].startswith(b"HTTP/1.1 200 OK\r\n") and WRITES[0].endswith(b'{"answer": 42}')


async def test_a_streams_head_is_sent_before_its_first_chunk_exists(server: int) -> None:
    reader, writer = await request(server, "/stream")
    async with asyncio.timeout(WAIT):
        head = await reader.readuntil(b"\r\n\r\n")  # arrives while the stream still waits for its chunk
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked" in head
    assert len(WRITES) == 1
    release_stream.set()
    async with asyncio.timeout(WAIT):
        rest = await reader.readuntil(b"0\r\n\r\n")
    writer.close()
    assert b"data: late\n\n" in rest
