"""The channel layer on the suite's Redis: a message that does not fit an inbox is counted and said."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid

import pytest
from channels.exceptions import ChannelFull

from llmgw.channel_layer import DROPPED, ChannelLayer, _CapacityLog

REDIS_URL = os.environ.get("LLMGW_REDIS_URL", "")
pytestmark = pytest.mark.skipif(not REDIS_URL, reason="the Redis channel layer needs Redis; this run has none")


def layer(capacity: int) -> ChannelLayer:
    return ChannelLayer(hosts=[{"address": REDIS_URL}], prefix=f"llmgw-test-{uuid.uuid4().hex[:8]}",
                        capacity=capacity)


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
    names = [await channels.new_channel() for _ in range(20)]

    # Twenty group changes at once through a pool of two: they queue for a connection, none fails.
    await asyncio.gather(*(channels.group_add("many", name) for name in names))
    await asyncio.gather(*(channels.group_discard("many", name) for name in names))
    await channels.flush()
