"""The limiter's Redis client (apps.quotas.resp): against the real Redis, and against scripted
servers on real sockets for what Redis will not do on request (stay silent, hang up, answer
in fragments)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from apps.quotas.resp import RedisClient, RedisError

REDIS_TEST_URL = os.environ.get("LLMGW_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
WAIT = 5.0


def _redis_reachable() -> bool:
    import socket

    try:
        with socket.create_connection(("127.0.0.1", 6379), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture
async def redis() -> AsyncIterator[RedisClient]:
    if not _redis_reachable():
        pytest.skip("Redis is not reachable at 127.0.0.1:6379")
    client = RedisClient(REDIS_TEST_URL, timeout=WAIT)
    yield client
    await client.close()


async def test_commands_answer_integers_strings_nil_arrays_and_errors(redis: RedisClient) -> None:
    key = f"llmgw:test:resp:{uuid.uuid4().hex}"
    try:
        replies = await redis.execute(
            ("SET", key, "5"),
            ("INCRBY", key, 7),
            ("GET", key),
            ("GET", key + ":none"),
            ("EVAL", "return {1, 'two', {3}}", 0),
            ("INCRBY", key, "seven"),
        )
        assert replies[:5] == ["OK", 12, b"12", None, [1, b"two", [3]]]
        assert isinstance(replies[5], RedisError) and "not an integer" in str(replies[5])
        assert await redis.execute(("EXPIRE", key, 60)) == [1]  # the connection goes on after an error reply
    finally:
        await redis.execute(("DEL", key))


async def test_concurrent_calls_share_one_connection_and_each_gets_its_own_reply(redis: RedisClient) -> None:
    prefix = f"llmgw:test:resp:{uuid.uuid4().hex}"
    try:
        replies = await asyncio.gather(*(redis.execute(("INCRBY", f"{prefix}:{i}", i)) for i in range(200)))
        assert replies == [[i] for i in range(200)]
        [clients] = await redis.execute(("CLIENT", "LIST"))
        assert clients.count(b"cmd=client") == 1  # one connection: this one, asking
    finally:
        await redis.execute(*(("DEL", f"{prefix}:{i}") for i in range(200)))


async def test_the_database_in_the_url_is_selected(redis: RedisClient) -> None:
    key = f"llmgw:test:resp:{uuid.uuid4().hex}"
    other = RedisClient(REDIS_TEST_URL.rsplit("/", 1)[0] + "/14", timeout=WAIT)
    try:
        await redis.execute(("SET", key, "15"))
        assert await other.execute(("GET", key)) == [None]
        assert await redis.execute(("GET", key)) == [b"15"]
    finally:
        await redis.execute(("DEL", key))
        await other.close()


# Scripted servers -----------------------------------------------------------------------------------

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, list[bytes]], Awaitable[None]]


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Script], Awaitable[tuple[int, list[bytes], list[int]]]]]:
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(script: Script) -> tuple[int, list[bytes], list[int]]:
        seen: list[bytes] = []
        connections = [0]

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections[0] += 1
            writers.append(writer)
            try:
                await script(reader, writer, seen)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        servers.append(server)
        return server.sockets[0].getsockname()[1], seen, connections

    yield start
    for server in servers:
        server.close()
    for writer in writers:
        writer.transport.abort()
    for server in servers:
        await server.wait_closed()


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    count = int((await reader.readline())[1:])
    parts = []
    for _ in range(count):
        length = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(length + 2))[:-2])
    return parts


async def test_the_password_and_database_are_sent_before_the_first_command(scripted) -> None:  # noqa: ANN001
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]) -> None:
        while True:
            seen.append(b" ".join(await read_command(reader)))
            writer.write(b"+OK\r\n")

    port, seen, _ = await scripted(server)
    client = RedisClient(f"redis://ops:s%40cret@127.0.0.1:{port}/3", timeout=WAIT)
    try:
        assert await client.execute(("PING",)) == ["OK"]
    finally:
        await client.close()
    assert seen == [b"AUTH ops s@cret", b"SELECT 3", b"PING"]


async def test_a_refused_password_is_an_error_and_no_command_is_sent(scripted) -> None:  # noqa: ANN001
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]) -> None:
        seen.append(b" ".join(await read_command(reader)))
        writer.write(b"-WRONGPASS invalid username-password pair\r\n")
        await reader.read()

    port, seen, _ = await scripted(server)
    client = RedisClient(f"redis://:nope@127.0.0.1:{port}", timeout=WAIT)
    try:
        with pytest.raises(RedisError, match="WRONGPASS"):
            await client.execute(("PING",))
    finally:
        await client.close()
    assert seen == [b"AUTH nope"]


async def test_replies_that_arrive_in_fragments_are_put_together(scripted) -> None:  # noqa: ANN001
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]) -> None:
        await read_command(reader)
        await read_command(reader)
        for byte in b"*2\r\n:1\r\n$5\r\nhello\r\n:42\r\n":
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0)
        await reader.read()

    port, _, _ = await scripted(server)
    client = RedisClient(f"redis://127.0.0.1:{port}", timeout=WAIT)
    try:
        assert await client.execute(("A",), ("B",)) == [[1, b"hello"], 42]
    finally:
        await client.close()


async def test_a_silent_redis_is_a_timeout_and_the_next_call_uses_a_new_connection(scripted) -> None:  # noqa: ANN001
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]) -> None:
        await read_command(reader)
        if len(seen) == 0:
            seen.append(b"stayed silent")
            await reader.read()  # never answers; ends when the client drops the connection
            return
        writer.write(b":1\r\n")
        await reader.read()

    port, seen, connections = await scripted(server)
    client = RedisClient(f"redis://127.0.0.1:{port}", timeout=0.2)
    try:
        with pytest.raises(TimeoutError):
            await client.execute(("PING",))
        assert await client.execute(("PING",)) == [1]
    finally:
        await client.close()
    assert connections[0] == 2


async def test_a_lost_connection_fails_the_waiting_call_and_the_next_call_reconnects(scripted) -> None:  # noqa: ANN001
    async def server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: list[bytes]) -> None:
        await read_command(reader)
        if not seen:
            seen.append(b"hung up")
            return  # closes without answering
        writer.write(b"+PONG\r\n")
        await reader.read()

    port, _, connections = await scripted(server)
    client = RedisClient(f"redis://127.0.0.1:{port}", timeout=WAIT)
    try:
        with pytest.raises(RedisError, match="closed the connection|lost"):
            await client.execute(("PING",))
        assert await client.execute(("PING",)) == ["PONG"]
    finally:
        await client.close()
    assert connections[0] == 2


def test_a_url_that_is_not_redis_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Redis URL"):
        RedisClient("http://127.0.0.1:6379")
