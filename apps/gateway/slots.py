"""Slots: how many requests each upstream holds, and the queue of those waiting for one.

An upstream serves at most `capacity` requests at once (the profile's parallel slots). The
count is kept per upstream id, in an `InFlight` object that lives as long as the process needs it,
never in the tables: the tables are rebuilt on every change and every RELOAD seconds, and a
count copied from one table to the next was lost whenever a request ended on the other side
of a reload. A request holds a `Lease` on the InFlight it took, and gives back exactly that one,
whatever happened to the tables, the replica or the request meanwhile.

With several gateway processes (`llmgw web --workers N`, or web servers on several hosts) the
counts must be shared, or each process would fill every slot by itself. With Redis configured,
`SharedSlots` keeps each upstream's leases in a sorted set (member: the lease's id, score: when
it expires). One Lua script drops the expired leases of the candidates, reads their counts,
picks by the same rule as one process (apps.gateway.routing.pick) and adds the new lease, so a
slot is never given twice. Each process renews its leases every lease/3 seconds; those of a
process that dies expire within LEASE seconds and their slots come back. A release is
published, so a request waiting in another process tries again at once.

Bounds, stated in docs/gateway.md:
- Redis up: an upstream never holds more than its capacity from all processes together.
- A process killed while holding leases: its slots are counted until their leases expire
  (at most LLMGW_GATEWAY_SLOT_LEASE_SECONDS), so others may wait that long, never overfill.
- Redis down: each process counts on its own (a warning is logged and
  llmgw_gateway_shared_slots_failures_total counts it), so an upstream may hold up to
  capacity x processes until Redis answers again. Requests are never refused for it.

The queue (`WaitingRoom`): when every slot of a model (and of its fallbacks) is taken, a
request waits, up to LLMGW_GATEWAY_QUEUE_MAX per model (counted across processes in Redis
too) and LLMGW_GATEWAY_QUEUE_TIMEOUT seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from apps.gateway import metrics
from apps.gateway.routing import LOAD_BOUND, pick, preference
from apps.gateway.tables import Tables, Upstream

__all__ = ["InFlight", "Lease", "QueueFull", "SharedSlots", "SlotKeeper", "WaitingRoom", "shared_key"]

log = logging.getLogger("llmgw.gateway")


def shared_key(prefix: str, kind: str, name: str) -> str:
    """The Redis key of a model's shared slots ("slots") or waiting tickets ("waiting"). One hash tag
    for every key, so the scripts' keys sit in one slot of a Redis Cluster too."""
    return f"{prefix}:{{gw}}:{kind}:{name}"


class InFlight:
    """One upstream's requests in flight in this process, and when it may be tried again."""

    __slots__ = ("failed_until", "held", "id")

    def __init__(self, upstream_id: str) -> None:
        self.id = upstream_id
        self.held = 0
        self.failed_until = 0.0

    def __repr__(self) -> str:
        return f"InFlight({self.id!r}, held={self.held})"


class Lease:
    """One request's hold on one slot of one upstream; given back once, to the InFlight it came from."""

    __slots__ = ("inflight", "released", "token", "upstream")

    def __init__(self, upstream: Upstream, inflight: InFlight, token: str | None) -> None:
        self.upstream = upstream
        self.inflight = inflight
        self.token = token  # the shared lease's id, when Redis counts it
        self.released = False


class QueueFull(Exception):
    """Too many requests wait for this model already."""


# The shared counts ---------------------------------------------------------------------------------

# KEYS: the candidates' lease sets in preference order, then (with a ticket) the queue it is in.
# ARGV: lease ms, token, mode, bound, the queue ticket ("" for none), then each candidate's
# capacity. Returns the 1-based index of the chosen candidate, or 0 (all full). A request that
# takes a slot leaves the queue in the same step, so no other sees it both waiting and served.
ACQUIRE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local mode = tonumber(ARGV[3])
local n = #ARGV - 5
local loads, caps = {}, {}
local sum, usable = 0, 0
for i = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  loads[i] = redis.call('ZCARD', KEYS[i])
  caps[i] = tonumber(ARGV[5 + i])
  if loads[i] < caps[i] then sum = sum + loads[i]; usable = usable + 1 end
end
if usable == 0 then return 0 end
local chosen = 0
if mode == 2 then
  for i = 1, n do if loads[i] < caps[i] then chosen = i; break end end
elseif mode == 1 then
  local limit = sum / usable * tonumber(ARGV[4]) + 1
  for i = 1, n do if loads[i] < caps[i] and loads[i] <= limit then chosen = i; break end end
end
if chosen == 0 then
  local best = nil
  for i = 1, n do
    if loads[i] < caps[i] and (best == nil or loads[i] < best) then best = loads[i]; chosen = i end
  end
end
redis.call('ZADD', KEYS[chosen], now + lease, ARGV[2])
redis.call('PEXPIRE', KEYS[chosen], lease * 4)
if ARGV[5] ~= '' then redis.call('ZREM', KEYS[n + 1], ARGV[5]) end
return chosen
"""

# KEYS[1]: a model's waiting set. ARGV: lease ms, token, the most that may wait. 1 joined, 0 full.
JOIN_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[2])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 4)
return 1
"""

# KEYS: sets to renew leases in. ARGV: lease ms, then (key index, token) pairs.
RENEW_SCRIPT = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local key = KEYS[tonumber(ARGV[i])]
  redis.call('ZADD', key, expiry, ARGV[i + 1])
  redis.call('PEXPIRE', key, tonumber(ARGV[1]) * 4)
end
return 1
"""


def _sha(script: str) -> str:
    return hashlib.sha1(script.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA-1


_SCRIPTS = {_sha(s): s for s in (ACQUIRE_SCRIPT, JOIN_SCRIPT, RENEW_SCRIPT)}
ACQUIRE_SHA, JOIN_SHA, RENEW_SHA = (_sha(s) for s in (ACQUIRE_SCRIPT, JOIN_SCRIPT, RENEW_SCRIPT))


class SharedSlots:
    """Slot leases and the waiting count in Redis, shared by every gateway process (module docstring).

    `client` is an apps.quotas.resp.RedisClient (one pipelined connection); `subscribe` opens the
    connection releases are heard on (a coroutine taking the channel and a callback), None to
    hear nothing (waiters then retry once a second).
    """

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "llmgw",
        lease_s: float = 15.0,
        backoff_s: float = 2.0,
        subscribe: Callable[[str, Callable[[str], None]], Any] | None = None,
    ) -> None:
        self.client = client
        self.base = prefix
        self.prefix = f"{prefix}:{{gw}}"
        self.lease_ms = max(1000, int(lease_s * 1000))
        self.backoff_s = backoff_s
        self.channel = f"{self.prefix}:released"
        self._subscribe = subscribe
        self._held: dict[str, str] = {}  # token -> the set it is in (slot leases and waiting tickets)
        self._ids = itertools.count(1)
        self._process = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self._down_until = 0.0
        self._logged_at = -math.inf
        self._tasks: set[asyncio.Task[Any]] = set()
        self._renewer: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self.on_released: Callable[[str], None] = lambda model: None

    # Life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._renewer = asyncio.create_task(self._renew_loop(), name="gateway-slot-leases")
        if self._subscribe is not None:
            self._listener = asyncio.create_task(self._subscribe(self.channel, self._heard), name="gateway-releases")

    async def stop(self) -> None:
        for task in (self._renewer, self._listener):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._held:  # a clean stop gives its slots back now, not when their leases expire
            commands = [("ZREM", key, token) for token, key in self._held.items()]
            self._held.clear()
            with contextlib.suppress(Exception):
                await self.client.execute(*commands)

    # Health ------------------------------------------------------------------------------------

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, what: str, exc: BaseException) -> None:
        moment = time.monotonic()
        self._down_until = moment + self.backoff_s
        metrics.SHARED_SLOT_FAILURES.inc()
        if moment - self._logged_at >= 60:
            self._logged_at = moment
            log.warning(
                "replica slots: Redis failed during %s (%s: %s); counting this process's requests only",
                what,
                type(exc).__name__,
                exc,
            )

    # Calls -------------------------------------------------------------------------------------

    def _key(self, kind: str, name: str) -> str:
        return shared_key(self.base, kind, name)

    def _token(self) -> str:
        return f"{self._process}:{next(self._ids)}"

    async def _script(self, sha: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        [reply] = await self.client.execute(("EVALSHA", sha, len(keys), *keys, *args))
        if isinstance(reply, Exception) and str(reply).startswith("NOSCRIPT"):
            [reply] = await self.client.execute(("EVAL", _SCRIPTS[sha], len(keys), *keys, *args))
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def acquire(self, order: Sequence[Upstream], mode: int, ticket: str | None = None) -> tuple[int | None, str]:
        """Take a slot on one of `order` by pick's rule: (its index or None, the lease's token).
        With the request's queue ticket, taking a slot also takes it out of the queue."""
        token = self._token()
        keys = [self._key("slots", u.id) for u in order]
        queue = self._held.get(ticket) if ticket is not None else None
        chosen = await self._script(
            ACQUIRE_SHA,
            [*keys, *([queue] if queue else [])],
            [self.lease_ms, token, mode, LOAD_BOUND, ticket if queue else "", *(u.capacity for u in order)],
        )
        if not chosen:
            return None, token
        self._held[token] = keys[int(chosen) - 1]
        if queue and ticket is not None:
            self._held.pop(ticket, None)  # out of the queue already
        return int(chosen) - 1, token

    def release(self, token: str, model: str) -> None:
        """Give a lease back in the background (a lease that cannot be given back expires)."""
        key = self._held.pop(token, None)
        if key is not None:
            self._background(self._release(key, token, model))

    async def release_now(self, token: str, model: str) -> None:
        """Give a lease back before going on: a request that answers its client after this cannot
        be followed by one of the same client's that finds the slot still taken."""
        key = self._held.pop(token, None)
        if key is not None:
            await self._release(key, token, model)

    async def _release(self, key: str, token: str, model: str) -> None:
        try:
            await self.client.execute(("ZREM", key, token), ("PUBLISH", self.channel, model))
        except Exception as exc:
            self.failed("release", exc)

    async def join(self, model: str, most: int) -> str:
        """A ticket in the model's queue, counted across processes; QueueFull past `most`."""
        token = self._token()
        key = self._key("waiting", model)
        if not await self._script(JOIN_SHA, [key], [self.lease_ms, token, most]):
            raise QueueFull(model)
        self._held[token] = key
        return token

    async def leave(self, token: str) -> None:
        key = self._held.pop(token, None)
        if key is not None:
            try:
                await self.client.execute(("ZREM", key, token))
            except Exception as exc:
                self.failed("leaving the queue", exc)

    def _background(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def renew(self) -> None:
        """Push every lease and ticket this process holds LEASE further out (one script call)."""
        if not self._held:
            return
        keys: dict[str, int] = {}
        args: list[Any] = [self.lease_ms]
        for token, key in list(self._held.items()):
            index = keys.setdefault(key, len(keys) + 1)
            args += [index, token]
        await self._script(RENEW_SHA, list(keys), args)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                await self.renew()
            except Exception as exc:
                self.failed("renewing leases", exc)

    def _heard(self, model: str) -> None:
        self.on_released(model)


# One process's view -----------------------------------------------------------------------------------


class SlotKeeper:
    """Every upstream's InFlight in this process, by upstream id, and the shared counts when there are.

    `bind(tables)` gives each upstream of a new table the InFlight of its id (made on first sight).
    An InFlight is forgotten once no table lists its id and nothing holds it; one still held when its
    replica left the table is kept until its last lease is given back.
    """

    def __init__(self, shared: SharedSlots | None = None) -> None:
        self.shared = shared
        self._by_id: dict[str, InFlight] = {}
        self.on_release: Callable[[str], None] = lambda model: None

    def bind(self, tables: Tables) -> None:
        live: set[str] = set()
        for upstream in tables.upstreams():
            upstream.inflight = self.inflight(upstream)
            live.add(upstream.id)
        for upstream_id in [i for i, s in self._by_id.items() if i not in live and s.held == 0]:
            del self._by_id[upstream_id]

    def inflight(self, upstream: Upstream) -> InFlight:
        inflight = upstream.inflight
        if inflight is None:
            inflight = self._by_id.get(upstream.id)
            if inflight is None:
                inflight = self._by_id[upstream.id] = InFlight(upstream.id)
            upstream.inflight = inflight
        return inflight

    def held(self) -> int:
        """Requests holding a slot in this process (what llmgw_gateway_in_flight shows)."""
        return sum(s.held for s in self._by_id.values())

    def known(self) -> Iterable[InFlight]:
        return self._by_id.values()

    async def acquire(
        self, upstreams: Sequence[Upstream], key: str | None, *, exclude: Iterable[str] = (), ticket: str | None = None
    ) -> Lease | None:
        """A slot on one of the upstreams (prefix affinity under the load bound, else the least
        loaded), or None when every usable one is full. Upstreams in `exclude` or marked failed
        are passed over. `ticket`: the request's place in the shared queue, given up with the slot."""
        now = time.monotonic()
        skip = set(exclude)
        candidates = [u for u in upstreams if u.id not in skip and self.inflight(u).failed_until <= now]
        if not candidates:
            return None
        order, mode = preference(candidates, key)
        shared = self.shared
        if shared is not None and shared.available() and not order[0].id.startswith("external:"):
            try:
                index, token = await shared.acquire(order, mode, ticket)
            except Exception as exc:
                shared.failed("acquire", exc)
            else:
                return None if index is None else self._take(order[index], token)
        index = pick([self.inflight(u).held for u in order], [u.capacity for u in order], mode)
        return None if index is None else self._take(order[index], None)

    def _take(self, upstream: Upstream, token: str | None) -> Lease:
        inflight = self.inflight(upstream)
        inflight.held += 1
        metrics.IN_FLIGHT.inc()
        return Lease(upstream, inflight, token)

    def release(self, lease: Lease) -> None:
        """Give the lease's slot back (a second call does nothing); the shared count follows in the
        background."""
        if self._give_back(lease) and lease.token is not None and self.shared is not None:
            self.shared.release(lease.token, lease.upstream.model)

    async def give_back(self, lease: Lease) -> None:
        """Give the lease's slot back, the shared count too, before the caller answers its client."""
        if self._give_back(lease) and lease.token is not None and self.shared is not None:
            await self.shared.release_now(lease.token, lease.upstream.model)

    def _give_back(self, lease: Lease) -> bool:
        if lease.released:
            return False
        lease.released = True
        lease.inflight.held -= 1
        metrics.IN_FLIGHT.dec()
        self.on_release(lease.upstream.model)
        return True

    def mark_failed(self, upstream: Upstream, seconds: float) -> None:
        self.inflight(upstream).failed_until = time.monotonic() + seconds


class WaitingRoom:
    """Per model: how many requests wait for a slot (at most `most`), and the event that wakes them."""

    def __init__(self, most: int, shared: SharedSlots | None = None) -> None:
        self.most = most
        self.shared = shared
        self.waiting: dict[str, int] = {}
        self._events: dict[str, asyncio.Event] = {}

    def event(self, model: str) -> asyncio.Event:
        event = self._events.get(model)
        if event is None:
            event = self._events[model] = asyncio.Event()
        return event

    def released(self, model: str) -> None:
        """A slot of `model` came free (here or, through Redis, in another process): wake its waiters."""
        event = self._events.pop(model, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        for model in list(self._events):
            self.released(model)

    async def enter(self, model: str) -> str | None:
        """Join the model's queue; QueueFull when `most` wait already. Returns the shared ticket."""
        ticket = None
        if self.waiting.get(model, 0) >= self.most:
            raise QueueFull(model)
        shared = self.shared
        if shared is not None and shared.available():
            try:
                ticket = await shared.join(model, self.most)
            except QueueFull:
                raise
            except Exception as exc:
                shared.failed("joining the queue", exc)
        self.waiting[model] = self.waiting.get(model, 0) + 1
        metrics.QUEUE_DEPTH.labels(model=model).inc()
        return ticket

    async def leave(self, model: str, ticket: str | None) -> None:
        self.waiting[model] -= 1
        if not self.waiting[model]:
            del self.waiting[model]
        metrics.QUEUE_DEPTH.labels(model=model).dec()
        if ticket is not None and self.shared is not None:
            await self.shared.leave(ticket)
