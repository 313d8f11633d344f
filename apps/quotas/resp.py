"""A small Redis client for the limiter's two calls on the gateway's hot path.

redis-py's asyncio client spends about 0.15 ms of CPU on each command (connection pool,
retry wrapper, timeout context, reply parser classes); the limiter asks Redis once per
request before the request may go on, so that time is added to every answer. This client
keeps one connection per process and pipelines on it: each command is written at once,
and replies, which Redis sends in order, are matched to the waiting calls first in, first
out. It speaks RESP2 and knows integers, strings, errors and arrays, which is all that
EVALSHA, EVAL, INCRBY and EXPIRE answer.

- redis://[[user]:password@]host[:port][/db], rediss:// (TLS) and unix:///path?db=N.
- Every command has a deadline (`timeout`). A call that passes it gets TimeoutError, as
  does every call waiting on the same connection, and the connection is dropped: its
  later replies would answer no one, and a Redis that slow is treated as down.
- A lost connection fails every call waiting on it; the next call opens a new one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import ssl
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["RedisClient", "RedisError", "subscribe"]


class RedisError(Exception):
    """An error reply from Redis (the text it sent), or a connection that failed."""


def encode(*args: Any) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        value = arg if type(arg) is bytes else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(value), value))
    return b"".join(out)


class _Parser:
    """Incremental RESP2 reader: feed bytes, take whole replies."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.pos = 0

    def feed(self, data: bytes) -> None:
        if self.pos:
            del self.buffer[: self.pos]
            self.pos = 0
        self.buffer += data

    def take(self) -> tuple[bool, Any]:
        """(True, reply) for the next whole reply, (False, None) when more bytes are needed."""
        start = self.pos
        try:
            reply = self._read()
        except _Incomplete:
            self.pos = start
            return False, None
        return True, reply

    def _line(self) -> bytes:
        end = self.buffer.find(b"\r\n", self.pos)
        if end < 0:
            raise _Incomplete
        line = bytes(self.buffer[self.pos : end])
        self.pos = end + 2
        return line

    def _read(self) -> Any:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b":":
            return int(rest)
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return RedisError(rest.decode(errors="replace"))
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None
            if len(self.buffer) < self.pos + length + 2:
                raise _Incomplete
            value = bytes(self.buffer[self.pos : self.pos + length])
            self.pos += length + 2
            return value
        if kind == b"*":
            count = int(rest)
            return None if count < 0 else [self._read() for _ in range(count)]
        raise ValueError(f"not a RESP reply: {line[:40]!r}")


class _Incomplete(Exception):
    pass


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = _Parser()
        self.waiting: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.lost = False

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        while True:
            try:
                done, reply = self.parser.take()
            except ValueError as exc:
                self.fail(RedisError(str(exc)))
                return
            if not done:
                return
            if not self.waiting:
                continue  # nobody asked (cannot happen while replies come in order)
            future = self.waiting.popleft()
            if not future.done():
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisError(f"the connection to Redis was lost: {exc}" if exc else "Redis closed the connection"))

    def fail(self, error: Exception) -> None:
        self.lost = True
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()


class RedisClient:
    def __init__(self, url: str, *, timeout: float = 0.5) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"not a Redis URL: {url!r}")
        query = parse_qs(parts.query)
        self.unix_path = parts.path if parts.scheme == "unix" else None
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 6379
        self.tls = parts.scheme == "rediss"
        path = parts.path.strip("/") if parts.scheme != "unix" else ""
        self.db = int(path or query.get("db", ["0"])[0] or 0)
        self.username = unquote(parts.username) if parts.username else None
        self.password = unquote(parts.password) if parts.password else None
        self.timeout = timeout
        self._conn: _Connection | None = None
        self._opening: asyncio.Future[_Connection] | None = None

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and not conn.lost:
            return conn
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if self._opening is opening and opening.done():
                self._opening = None

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection()
        async with asyncio.timeout(self.timeout):
            if self.unix_path:
                await loop.create_unix_connection(lambda: conn, self.unix_path)
            elif self.tls:
                await loop.create_connection(
                    lambda: conn, self.host, self.port, ssl=ssl.create_default_context(), server_hostname=self.host
                )
            else:
                await loop.create_connection(lambda: conn, self.host, self.port)
            hello: list[tuple[Any, ...]] = []
            if self.password is not None:
                hello.append(("AUTH", self.username, self.password) if self.username else ("AUTH", self.password))
            if self.db:
                hello.append(("SELECT", self.db))
            for reply in await self._send(conn, hello):
                if isinstance(reply, RedisError):
                    conn.fail(reply)
                    raise reply
        self._conn = conn
        return conn

    @staticmethod
    def _send(conn: _Connection, commands: list[tuple[Any, ...]]) -> asyncio.Future[list[Any]]:
        loop = asyncio.get_running_loop()
        futures = []
        for _ in commands:
            future = loop.create_future()
            conn.waiting.append(future)
            futures.append(future)
        assert conn.transport is not None
        conn.transport.write(b"".join(encode(*command) for command in commands))
        return asyncio.gather(*futures)

    async def execute(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Send the commands in one write and wait for their replies (error replies are returned,
        not raised). A connection failure raises RedisError, a passed deadline TimeoutError."""
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connection()
        loop = asyncio.get_running_loop()
        if len(commands) == 1:
            future: asyncio.Future[Any] = loop.create_future()
            conn.waiting.append(future)
            conn.transport.write(encode(*commands[0]))  # type: ignore[union-attr]
        else:
            future = self._send(conn, list(commands))
        deadline = loop.call_later(self.timeout, self._expire, conn, future)
        try:
            replies = await future
        finally:
            deadline.cancel()
        return [replies] if len(commands) == 1 else replies

    def _expire(self, conn: _Connection, future: asyncio.Future[Any]) -> None:
        if not future.done():
            conn.fail(TimeoutError(f"Redis did not answer within {self.timeout:g} s"))

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.lost = True
            if conn.transport is not None:
                conn.transport.close()


class _Subscriber(asyncio.Protocol):
    """A connection in subscribe mode: each published message is handed to `on_message`."""

    def __init__(self, on_message: Callable[[str], None]) -> None:
        self.parser = _Parser()
        self.on_message = on_message
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.parser.feed(data)
        while True:
            try:
                done, reply = self.parser.take()
            except ValueError:
                if not self.closed.done():
                    self.closed.set_result(None)
                return
            if not done:
                return
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message" and isinstance(reply[2], bytes):
                try:
                    self.on_message(reply[2].decode(errors="replace"))
                except Exception:
                    logging.getLogger(__name__).exception("a Redis message could not be handled")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _same(protocol: _Subscriber) -> _Subscriber:
    return protocol


async def subscribe(url: str, channel: str, on_message: Callable[[str], None], *, max_backoff: float = 10.0) -> None:
    """Hear every message published on `channel` until cancelled, reconnecting (with growing,
    jittered waits) whenever the connection is lost. Messages sent while disconnected are missed:
    callers treat them as hints and keep a slower path of their own."""
    client = RedisClient(url, timeout=5.0)
    delay = 0.2
    loop = asyncio.get_running_loop()
    while True:
        transport = None
        try:
            protocol = _Subscriber(on_message)
            made = partial(_same, protocol)
            async with asyncio.timeout(client.timeout):
                if client.unix_path:
                    transport, _ = await loop.create_unix_connection(made, client.unix_path)
                elif client.tls:
                    transport, _ = await loop.create_connection(
                        made, client.host, client.port, ssl=ssl.create_default_context(), server_hostname=client.host
                    )
                else:
                    transport, _ = await loop.create_connection(made, client.host, client.port)
            if client.password is not None:
                auth = ("AUTH", client.username, client.password) if client.username else ("AUTH", client.password)
                transport.write(encode(*auth))
            transport.write(encode("SUBSCRIBE", channel))
            delay = 0.2
            await protocol.closed
        except asyncio.CancelledError:
            if transport is not None:
                transport.close()
            raise
        except Exception as exc:
            logging.getLogger(__name__).debug("subscription to %s failed: %s", channel, exc)
        if transport is not None:
            transport.close()
        await asyncio.sleep(delay * (0.5 + random.random()))  # noqa: S311 - jitter, not secrets
        delay = min(max_backoff, delay * 2)
