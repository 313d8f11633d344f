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
  failed is forgotten within minutes, not a day;
- a receive outlives a Redis outage: while Redis cannot be reached it waits and tries again
  (every 0.5 s, backing off to 5 s, with one warning per outage) instead of raising, which would
  end every websocket of the process at once; once Redis answers again the channel's group
  memberships are added anew, since a Redis that restarted without persistence has forgotten
  them. A group_add made while Redis is away fails to its caller but is remembered for that.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from channels.exceptions import ChannelFull
from channels_redis.core import RedisChannelLayer
from prometheus_client import Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = ["DROPPED", "ChannelLayer"]

log = logging.getLogger("llmgw.channels")

DROPPED = Counter("llmgw_channel_layer_dropped", "Channel layer messages dropped because an inbox was full", ["kind"])
_WARN_EVERY_S = 60.0
# What a Redis that went away (stopped, restarting, unreachable) raises.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)
_RETRY_FIRST_S, _RETRY_MAX_S = 0.5, 5.0


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
        self.pool_options = {"max_connections": 64, "timeout": 10, "health_check_interval": 15, **(pool or {})}
        # The groups each channel of this process joined (and has not left): what is added anew
        # after an outage.
        self.joined: dict[str, set[str]] = {}
        self.outage_since: float | None = None

    def create_pool(self, index: int) -> Any:
        from redis.asyncio import BlockingConnectionPool

        host = dict(self.hosts[index])
        address = host.pop("address", None)
        options = {**host, **self.pool_options}
        if address is not None:
            return BlockingConnectionPool.from_url(address, **options)
        return BlockingConnectionPool(**options)

    async def group_add(self, group: str, channel: str) -> None:
        self.joined.setdefault(channel, set()).add(group)
        await super().group_add(group, channel)

    async def group_discard(self, group: str, channel: str) -> None:
        groups = self.joined.get(channel)
        if groups is not None:
            groups.discard(group)
            if not groups:
                del self.joined[channel]
        await super().group_discard(group, channel)

    async def receive(self, channel: str) -> dict[str, Any]:
        wait = 0.0
        while True:
            try:
                if wait:
                    await asyncio.sleep(wait)
                    await self._rejoin(channel)
                message: dict[str, Any] = await super().receive(channel)
            except MaxConnectionsError:
                # Every pooled connection busy for the pool's whole timeout: an overloaded moment, not
                # a Redis that went away and forgot its memberships. Wait and try again.
                wait = min(max(wait * 2, _RETRY_FIRST_S), _RETRY_MAX_S)
                continue
            except UNREACHABLE as exc:
                if self.outage_since is None:
                    self.outage_since = time.monotonic()
                    log.warning(
                        "channel layer: Redis cannot be reached (%s: %s); agent connections stay open and wait for it",
                        type(exc).__name__,
                        exc,
                    )
                wait = min(max(wait * 2, _RETRY_FIRST_S), _RETRY_MAX_S)
                continue
            return message

    async def _rejoin(self, channel: str) -> None:
        """After a failed receive: add the memberships Redis may have lost again, every channel's
        the first time Redis answers after an outage (a channel waiting behind another's receive
        never saw it fail), only this channel's after that."""
        if self.outage_since is None:
            channels = [channel]
        else:
            channels = list(self.joined)
        for name in channels:
            for group in list(self.joined.get(name, ())):
                await super().group_add(group, name)
        if self.outage_since is not None:
            log.warning(
                "channel layer: Redis answers again after %.0f s; %s channels rejoined their groups",
                time.monotonic() - self.outage_since,
                len(channels),
            )
            self.outage_since = None

    async def send(self, channel: str, message: dict[str, Any]) -> None:
        try:
            await super().send(channel, message)
        except ChannelFull:
            DROPPED.labels(kind="send").inc()
            _warn(f"the inbox of {channel} is full")
            raise
