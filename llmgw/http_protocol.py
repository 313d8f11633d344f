"""uvicorn's HTTP protocol (httptools), sending a response's head and first body bytes together.

An ASGI application answers in two messages, the status with headers and then the body, and
uvicorn writes each to the socket at once: two system calls and, with TCP_NODELAY, two packets
for every answer, and a client that wakes twice to read it. Here the head is held back until
the first body bytes are written, which happens in the same turn of the event loop for a whole
answer; when no body follows in that turn (a stream waiting for its first chunk), the head is
sent on its own at the end of the turn, so nothing waits longer than it did.

    llmgw web  ->  uvicorn.run(..., http="llmgw.http_protocol:HttpProtocol")

uvicorn starts a graceful stop by calling each open connection's `shutdown()`; the functions in
`ON_SHUTDOWN` are called then too (the gateway starts the grace of its requests in flight).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["ON_SHUTDOWN", "HeldHeadTransport", "HttpProtocol"]

#: Called (with no argument, on the event loop) when the server starts stopping and an HTTP
#: connection is open; once per open connection, so each must be idempotent.
ON_SHUTDOWN: list[Callable[[], None]] = []


class HeldHeadTransport:
    """A transport that holds a response head (a write starting with "HTTP/1.1 ", not 1xx)
    until the next write or the end of the loop's turn. Everything else goes to the real one."""

    __slots__ = ("_flush_handle", "_held", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._flush_handle: asyncio.Handle | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._held is not None:
            data = self._held + bytes(data)
            self._held = None
            if self._flush_handle is not None:
                self._flush_handle.cancel()
                self._flush_handle = None
        elif data[:9] == b"HTTP/1.1 " and data[9:10] != b"1":
            self._held = bytes(data)
            self._flush_handle = self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        self.flush()
        self._transport.writelines(chunks)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def flush(self) -> None:
        self._flush_handle = None
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(HeldHeadTransport(transport, self.loop))  # type: ignore[arg-type]

    def shutdown(self) -> None:
        for hook in ON_SHUTDOWN:
            try:
                hook()
            except Exception:  # the stop goes on whatever a hook does
                logging.getLogger("llmgw.web").exception("a shutdown hook failed")
        super().shutdown()
