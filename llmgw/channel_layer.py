"""The channel layer agents' connections hear on: channels_redis's, sized and made to say when it drops.

channels_redis keeps one inbox per web process in Redis, for every consumer of that process
together, with room for `capacity` messages (100 by default); what does not fit is dropped with
an INFO line. With thousands of agents on a process, one push to every node overflowed it, and
nobody knew. Here:

- the capacity is LLMGW_CHANNEL_CAPACITY (default 20,000), enough for a push to every agent a
  process holds and then some; a drop is counted in llmgw_channel_layer_dropped_total and
  logged as a warning (at most once a minute), whichever call dropped it;
- the connection pool to Redis waits for a free connection (up to its timeout) instead of
  failing with "Too many connections" when thousands of agents disconnect at once, and checks
  an idle connection before using it, so pooled connections to a Redis that went away are made
  anew on first use instead of failing every call;
- group memberships expire after LLMGW_CHANNEL_GROUP_EXPIRY seconds (default 900) unless the
  member renews them (each agent connection does every few minutes), so a member whose discard
  failed is forgotten within minutes, not a day.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from prometheus_client import Counter

__all__ = ["DROPPED", "ChannelLayer"]

log = logging.getLogger("llmgw.channels")

DROPPED = Counter("llmgw_channel_layer_dropped", "Channel layer messages dropped because an inbox was full",
                  ["kind"])
_WARN_EVERY_S = 60.0


class _CapacityLog(logging.Filter):
    """Turns channels_redis's INFO line for a group send that did not fit into a count and a warning."""

    last_warned = -_WARN_EVERY_S

    def filter(self, record: logging.LogRecord) -> bool:
        if "over capacity" in str(record.msg) and record.args and isinstance(record.args, tuple):
            dropped = record.args[0]
            if isinstance(dropped, int) and dropped > 0:
                DROPPED.labels(kind="group_send").inc(dropped)
                _warn(f"{dropped} of {record.args[1]} channels were over capacity in group {record.args[2]}")
        return True


def _warn(text: str) -> None:
    moment = time.monotonic()
    if moment - _CapacityLog.last_warned >= _WARN_EVERY_S:
        _CapacityLog.last_warned = moment
        log.warning("channel layer: messages dropped: %s (raise LLMGW_CHANNEL_CAPACITY)", text)


logging.getLogger("channels_redis.core").addFilter(_CapacityLog())


class ChannelLayer(RedisChannelLayer):
    def __init__(self, *args: Any, pool: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool_options = {"max_connections": 64, "timeout": 10, "health_check_interval": 15,
                             **(pool or {})}

    def create_pool(self, index: int) -> Any:
        from redis.asyncio import BlockingConnectionPool

        host = dict(self.hosts[index])
        address = host.pop("address", None)
        options = {**host, **self.pool_options}
        if address is not None:
            return BlockingConnectionPool.from_url(address, **options)
        return BlockingConnectionPool(**options)

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        try:
            await super().send(channel, message)
        except ChannelFull:
            DROPPED.labels(kind="send").inc()
            _warn(f"the inbox of {channel} is full")
            raise
