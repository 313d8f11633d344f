"""The gateway's HTTP/1.1 client for engines and external providers: pooled keep-alive
connections on plain asyncio protocols, parsed by httptools (the parser uvicorn uses).

It does only what the gateway needs — POST a JSON body, read the answer whole or chunk by
chunk — and so spends a fraction of a general client's time on each request, which is the
time the gateway adds to every answer.

- One pool of idle connections per (scheme, host, port). A connection goes back to the pool
  only when its answer was read to the end and both sides keep it alive; one that was not
  read to the end is closed, which is how an engine learns that its caller went away.
- A pooled connection that the other side closed while it sat idle is noticed and dropped;
  one that closes after the request was written but before a byte of the answer came back
  is tried once more on a new connection (the server dropped it idle at the same moment).
- `connect_timeout` bounds opening a connection (TLS included); `read_timeout` bounds each
  wait for the next bytes of an answer, as a socket read timeout would.
- While more than HIGH_WATER bytes of an answer wait to be read, the socket is not read
  from, so a slow client holds back its engine instead of filling the gateway's memory.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import httptools

__all__ = ["ConnectError", "Disconnected", "Pool", "ReadTimeout", "Response", "UpstreamError"]

HIGH_WATER = 1024 * 1024
LOW_WATER = 256 * 1024


class UpstreamError(Exception):
    """The upstream could not be asked, or its answer could not be read."""


class ConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, name unknown, TLS, timed out)."""


class Disconnected(UpstreamError):
    """The upstream closed the connection before its answer was complete."""


class ReadTimeout(UpstreamError):
    """The upstream sent nothing for longer than the read timeout."""


class _Target:
    __slots__ = ("host", "host_header", "key", "path", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        default = 443 if self.tls else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = name if self.port == default else f"{name}:{self.port}"
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.key = (parts.scheme, self.host, self.port)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time."""

    def __init__(self, pool: Pool, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received_any = False
        self.error: BaseException | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("the upstream tried to upgrade the connection"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"the upstream's answer is not valid HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        if self.complete:
            return
        if self.headers_done and not self._framed():
            self.on_message_complete()  # an answer without length or chunks ends when the connection does
            return
        what = "while it was sent" if self.headers_done else "before answering"
        detail = f": {exc}" if exc else ""
        self._fail(Disconnected(f"the upstream closed the connection {what}{detail}"))

    # httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:  # whole: httptools joins split reads itself
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer: the real one follows
            self.headers = {}
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()  # only known while the parser is in this answer
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self.headers_done:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:
            return
        self.complete = True
        self._wake()

    # ----------------------------------------------------------------------------------------

    def _framed(self) -> bool:
        return "content-length" in self.headers or "chunked" in self.headers.get("transfer-encoding", "").lower()

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Until something new arrives (headers, body, the end, an error); at most read_timeout."""
        self.waiter = self.loop.create_future()
        timer = self.loop.call_later(self.pool.read_timeout, self._timed_out, self.waiter)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._fail(ReadTimeout(f"the upstream sent nothing for {self.pool.read_timeout:g} s"))

    def take(self) -> bytes:
        data = b"".join(self.chunks) if len(self.chunks) != 1 else self.chunks[0]
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Response:
    """One answer. Use as an async context manager: leaving it before the answer was read to the
    end closes the connection (the upstream stops its work); otherwise the connection is reused."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    async def read(self) -> bytes:
        conn = self._conn
        parts: list[bytes] = []
        while True:
            if conn.chunks:
                parts.append(conn.take())
            if conn.complete:
                return b"".join(parts)
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: whatever bytes came since the last chunk, never empty."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            await conn.wait()

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        conn = self._conn
        if conn.reusable() and not conn.chunks:
            conn.pool._put(conn)
        else:
            conn.close()


class Pool:
    def __init__(self, *, connect_timeout: float = 5.0, read_timeout: float = 600.0, idle_timeout: float = 60.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self._ssl = ssl_context
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._open: set[_Connection] = set()

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = _Target(url)
            if len(self._targets) > 4096:
                self._targets.clear()
            self._targets[url] = target
        return target

    async def post(self, url: str, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> Response:
        """Send the request and wait for the answer's status and headers."""
        target = self.target(url)
        lines = [f"POST {target.path} HTTP/1.1\r\nHost: {target.host_header}\r\nContent-Length: {len(body)}\r\n"
                 "Accept-Encoding: identity\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
                raise UpstreamError(f"the header {name!r} holds a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        request = "".join(lines).encode("latin-1") + body
        for attempt in (0, 1):
            conn = await self._connection(target)
            conn.transport.write(request)  # type: ignore[union-attr]
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.error
                    await conn.wait()
            except Disconnected:
                if conn.reused and not conn.received_any and attempt == 0:
                    continue  # closed idle by the server as we sent: once more, on a new connection
                raise
            except BaseException:
                conn.close()
                raise
            return Response(conn)
        raise AssertionError("unreachable")

    async def _connection(self, target: _Target) -> _Connection:
        idle = self._idle.get(target.key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > self.idle_timeout:
                conn.close()
                continue
            conn.reused = True
            conn._reset()
            return conn
        loop = asyncio.get_running_loop()
        conn = _Connection(self, target.key)
        try:
            async with asyncio.timeout(self.connect_timeout):
                if target.tls:
                    await loop.create_connection(lambda: conn, target.host, target.port, ssl=self._ssl_context(),
                                                 server_hostname=target.host)
                else:
                    await loop.create_connection(lambda: conn, target.host, target.port)
        except TimeoutError:
            conn.close()
            raise ConnectError(f"could not connect to {target.host_header} within {self.connect_timeout:g} s") \
                from None
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise ConnectError(f"could not connect to {target.host_header}: {exc}") from None
        self._open.add(conn)
        return conn

    def _put(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        conn.waiter = None
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_count(self) -> int:
        return sum(len(v) for v in self._idle.values())

    async def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()
        self._open.clear()
        await asyncio.sleep(0)  # let the transports finish closing
