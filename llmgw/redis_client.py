"""The synchronous Redis clients of a process, built in one place for settings.REDIS_URL.

`client(timeout)` gives the process's client for that timeout, made at the first call and kept:
it holds a connection pool, so a client per call would open a connection per call (this runs for
every heartbeat batch and on request paths). None when no Redis is configured: each caller then
keeps its figures in the local cache or in the process, or reads them as unknown.

The timeouts are short because nothing asked of these clients is worth waiting for: they read and
write figures and hints (the nodes' histories, the fleet rollup, the gateway's queue counts, a
"tables changed" message), each with a fallback or an "unknown" when Redis does not answer. A
Redis that is down or stalled must cost a request or a heartbeat write a second or two, never the
socket's default of waiting for ever.

`fresh(timeout)` is an uncached client, for a check that must open a connection of its own rather
than reuse one a pool already holds (the readiness probe, which asks whether Redis can be reached
now). Its caller closes it.

The asynchronous client of the gateway's shared slots and the quota limiter
(apps.quotas.resp.RedisClient) and the channel layer's pool are separate: they live on an event
loop, these do not.
"""

from __future__ import annotations

import contextlib
import threading

import redis
from django.conf import settings

__all__ = ["client", "fresh", "reset"]

_clients: dict[tuple[str, float], redis.Redis] = {}
_lock = threading.Lock()


def client(timeout: float = 1.0) -> redis.Redis | None:
    """The process's client for settings.REDIS_URL with `timeout` seconds to connect and to answer,
    None when no Redis is configured."""
    url = settings.REDIS_URL
    if not url:
        return None
    key = (url, float(timeout))
    found = _clients.get(key)
    if found is None:
        with _lock:  # web processes call this from several threads at once; keep one pool per key
            found = _clients.get(key)
            if found is None:
                found = _clients[key] = fresh(timeout)
    return found


def fresh(timeout: float = 1.0) -> redis.Redis:
    """A new client for settings.REDIS_URL, shared with nobody; the caller closes it. Raises when
    no Redis is configured: ask `client()` where None is an answer."""
    if not settings.REDIS_URL:
        raise ValueError("no Redis is configured (LLMGW_REDIS_URL is empty)")
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=timeout)


def reset() -> None:
    """Forget the cached clients (closing their connections), so the next call builds new ones: for
    tests that change settings.REDIS_URL, and for a process that forked after using one."""
    with _lock:
        stale = list(_clients.values())
        _clients.clear()
    for old in stale:
        with contextlib.suppress(Exception):  # a connection already gone is what closing wanted
            old.close()
