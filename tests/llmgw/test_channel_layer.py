"""The channel layer on the suite's Redis: a message that does not fit an inbox is counted and said."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid

import pytest
from channels.exceptions import ChannelFull

from llmgw.channel_layer import DROPPED, UNREACHABLE, ChannelLayer, _CapacityLog

REDIS_URL = os.environ.get("LLMGW_REDIS_URL", "")
pytestmark = pytest.mark.skipif(not REDIS_URL, reason="the Redis channel layer needs Redis; this run has none")


def layer(capacity: int) -> ChannelLayer:
    return ChannelLayer(hosts=[{"address": REDIS_URL}], prefix=f"llmgw-test-{uuid.uuid4().hex[:8]}", capacity=capacity)


async def test_a_group_send_past_an_inbox_capacity_is_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    channels = layer(capacity=1)
    name = await channels.new_channel()
    await channels.group_add("nodes", name)
    before = DROPPED.labels(kind="group_send")._value.get()
    _CapacityLog.last_warned = -1e9  # the warning is said at most once a minute
    with caplog.at_level(logging.WARNING, logger="llmgw.channels"):
        for _ in range(3):
            await channels.group_send("nodes", {"type": "agent.send", "text": "x"})
    assert DROPPED.labels(kind="group_send")._value.get() - before >= 2
    assert "raise LLMGW_CHANNEL_CAPACITY" in caplog.text
    await channels.flush()


async def test_a_send_to_a_full_inbox_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    channels = layer(capacity=1)
    name = await channels.new_channel()
    await channels.send(name, {"type": "agent.send"})
    before = DROPPED.labels(kind="send")._value.get()
    with pytest.raises(ChannelFull):
        await channels.send(name, {"type": "agent.send"})
    assert DROPPED.labels(kind="send")._value.get() == before + 1
    await channels.flush()


async def test_the_pool_waits_for_a_free_connection_instead_of_failing() -> None:
    channels = layer(capacity=100)
    channels.pool_options["max_connections"] = 2
    names = [await channels.new_channel() for _ in range(300)]

    # Three hundred group changes at once through a pool of two (redis-py's own pool refuses past
    # its limit with "Too many connections"): they queue for a connection, none fails.
    await asyncio.gather(*(channels.group_add("many", name) for name in names))
    pool = channels.connection(0).connection_pool
    assert pool.max_connections == 2 and len(pool._in_use_connections) + len(pool._available_connections) <= 2
    await asyncio.gather(*(channels.group_discard("many", name) for name in names))
    await channels.flush()


@pytest.mark.skipif(not shutil.which("redis-server"), reason="no redis-server to stop and start again")
async def test_receives_wait_through_a_redis_restart_and_the_groups_are_joined_again(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two consumers of one process hear on their channels; Redis stops, and comes back empty."""
    from tests.e2e.production import RedisServer

    redis = RedisServer(tmp_path)
    redis.start()
    try:
        own = ChannelLayer(hosts=[{"address": redis.url}], prefix="llmgw-restart")
        first, second = await own.new_channel(), await own.new_channel()
        await own.group_add("node-1", first)
        await own.group_add("node-2", second)
        receives = [asyncio.create_task(own.receive(first)), asyncio.create_task(own.receive(second))]
        await asyncio.sleep(0.3)
        with caplog.at_level(logging.WARNING, logger="llmgw.channels"):
            redis.stop()
            await asyncio.sleep(3)  # several failed tries; a plain channels_redis receive raises at the first
            assert not any(task.done() for task in receives)
            redis.start()
            assert redis.keys() == 0  # it forgot every membership
            sender = ChannelLayer(hosts=[{"address": redis.url}], prefix="llmgw-restart")
            async with asyncio.timeout(30):
                while True:  # the memberships come back within a retry or two of Redis answering
                    await sender.group_send("node-1", {"type": "agent.send", "text": "one"})
                    await sender.group_send("node-2", {"type": "agent.send", "text": "two"})
                    if all(task.done() for task in receives):
                        break
                    await asyncio.sleep(0.5)
        assert [task.result()["text"] for task in receives] == ["one", "two"]
        assert "Redis cannot be reached" in caplog.text and "Redis answers again" in caplog.text
    finally:
        redis.stop()


async def test_a_group_left_is_not_joined_again_after_an_outage() -> None:
    own = ChannelLayer(hosts=[{"address": "redis://127.0.0.1:1/0"}], prefix="llmgw-gone")
    channel = await own.new_channel()
    with pytest.raises(UNREACHABLE):
        await own.group_add("node-1", channel)  # Redis is away: the caller hears it, the layer remembers
    assert own.joined == {channel: {"node-1"}}
    with pytest.raises(UNREACHABLE):
        await own.group_discard("node-1", channel)
    assert own.joined == {}
