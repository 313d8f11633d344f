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

The queue: when every slot of a model (and of its fallbacks) is taken, a request waits in the
model's fair queue (apps.gateway.fairness; the admission stage, apps.gateway.admission, runs it).
With Redis the queue is shared too: its tags, bands and the turn are kept and decided by the
scripts below, by the same rules as the in-process FairQueue, so the order holds across every
gateway process; a ticket whose process died expires with its lease and gives its place back.

The interactive reserve: while interactive requests have been seen for a model, a batch-band request
takes a slot only if interactive requests in flight + free slots after it >= the reserve, the most
interactive requests in flight at once over the last RESERVE_WINDOW_S seconds (never more than the
model's slots minus one; 0 once none came for that long, so idle slots all go to batch). A batch
request cannot be cut off without failing it, so without the reserve an interactive request that
found every slot taken by batch waited for a whole batch answer. `Interactive` keeps the count and
its recent peak in one process; with Redis, the acquire script keeps them per model (the
interactive leases in a set, each count's last moment in another) so every process agrees.
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
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from apps.gateway import metrics
from apps.gateway.fairness import BATCH, INTERACTIVE
from apps.gateway.routing import LOAD_BOUND, pick, preference
from apps.gateway.tables import Tables, Upstream

__all__ = [
    "RESERVE_WINDOW_S",
    "Gone",
    "InFlight",
    "Interactive",
    "Lease",
    "NotYourTurn",
    "QueueFull",
    "Reserved",
    "SharedSlots",
    "SlotKeeper",
    "queue_keys",
    "shared_key",
]

log = logging.getLogger("llmgw.gateway")

#: How far back the interactive reserve looks for the most interactive requests in flight at once.
RESERVE_WINDOW_S = 30.0


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


class Interactive:
    """One model's interactive requests holding slots in this process, and the most held at once
    over the last `window` seconds.

    `past` holds (the last moment a count was held, the count) for counts given up, counts falling
    from front to back: a count is noted only when it falls (a rise is covered by the higher count
    held from that moment on), and a noted count hides those before it that were no higher. So the
    peak is the front's count, or the one held now: one deque append per request, O(1) amortised.
    """

    __slots__ = ("held", "past", "window")

    def __init__(self, window: float) -> None:
        self.held = 0
        self.past: deque[tuple[float, int]] = deque()
        self.window = window

    def gave_back(self, now: float) -> None:
        past, held = self.past, self.held
        while past and past[-1][1] <= held:
            past.pop()
        past.append((now, held))
        self.held = held - 1

    def peak(self, now: float) -> int:
        past = self.past
        edge = now - self.window
        while past and past[0][0] < edge:
            past.popleft()
        return max(self.held, past[0][1]) if past else self.held


class Reserved(Exception):
    """A batch-band request may not take a free slot: `kept` of the model's `slots` are kept for
    interactive requests, the most in flight at once (`peak`) over the last `window` seconds."""

    def __init__(self, kept: int, peak: int, slots: int, window: float) -> None:
        super().__init__(kept, peak, slots)
        self.kept = kept
        self.peak = peak
        self.slots = slots
        self.window = window

    def __str__(self) -> str:
        return (
            f"{self.kept} of {self.slots} slots kept for interactive requests "
            f"(peak {self.peak} in the last {self.window:g} s)"
        )


def reserve(peak: int, slots: int) -> int:
    """Slots kept from the batch band: the recent interactive peak, leaving batch at least one."""
    return max(0, min(peak, slots - 1))


class Lease:
    """One request's hold on one slot of one upstream; given back once, to the InFlight it came from.
    `who` is whose request holds it (apps.gateway.fairness.Who.token), "" when it is nobody's;
    `band` the request's band (None for the gateway's own requests: a guard model's)."""

    __slots__ = ("band", "inflight", "released", "token", "upstream", "who")

    def __init__(
        self, upstream: Upstream, inflight: InFlight, token: str | None, who: str = "", band: int | None = None
    ) -> None:
        self.upstream = upstream
        self.inflight = inflight
        self.token = token  # the shared lease's id, when Redis counts it
        self.released = False
        self.who = who
        self.band = band


class QueueFull(Exception):
    """Too many requests wait for this model already; `tag` is the refused request's own."""

    def __init__(self, model: str, tag: float = 0.0) -> None:
        super().__init__(model)
        self.tag = tag


class NotYourTurn(Exception):
    """Another request waits ahead for this model; `head` is the ticket whose turn it is."""

    def __init__(self, head: str | None, free: int = 0) -> None:
        super().__init__(head)
        self.head = head
        self.free = free  # the slots free now, which those waiting are about to take


class Gone(Exception):
    """The ticket is no longer queued: it was pushed out to make room for a request nearer its share."""


def queue_keys(prefix: str, model: str) -> list[str]:
    """The Redis keys of a model's shared queue (SharedSlots.queue_keys), for readers outside a gateway."""
    return [shared_key(prefix, kind, model) for kind in ("fair0", "fair1", "waiting", "fair")]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# The shared counts ---------------------------------------------------------------------------------

# KEYS: the candidates' lease sets in preference order, then the queue these candidates serve (its
# two bands' tag sets, its tickets' expiry set, its state hash), then its interactive leases and its
# interactive counts' last moments (the reserve). ARGV: lease ms, token, mode, bound, the queue
# ticket ("" for none), BATCH_EVERY, the key id and cost / share to charge a request taken with no
# ticket ("" and 0 for none), the request's band (-1 for none), the caller's clock and the reserve's
# window (ms), then each candidate's capacity. Returns {index, ""}: the 1-based index of the chosen
# candidate, 0 when all are full (with the reserve, its peak and the slots when a batch request is
# held back by the reserve), -1 with the ticket whose turn it is when it is another's (a request
# with no ticket may not pass anyone waiting: -1 then only when a slot is free, which one of those
# waiting is about to take, with how many are; an interactive one passes batch requests the reserve
# holds back), -2 when the ticket is no longer queued (pushed out). Taking a slot with a ticket
# leaves the queue in the same step, moves the model's virtual time to its tag, and counts a grant
# the batch band waited for. A batch head the reserve holds back gives its turn to the interactive
# band.
ACQUIRE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local mode = tonumber(ARGV[3])
local rband = tonumber(ARGV[9])
local n = #ARGV - 11
local z0, z1, wq, st = KEYS[n + 1], KEYS[n + 2], KEYS[n + 3], KEYS[n + 4]
local live, pk = KEYS[n + 5], KEYS[n + 6]
local dead = redis.call('ZRANGEBYSCORE', wq, '-inf', now)
for _, d in ipairs(dead) do redis.call('ZREM', z0, d); redis.call('ZREM', z1, d) end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', wq, '-inf', now) end
local c0, c1 = redis.call('ZCARD', z0), redis.call('ZCARD', z1)
local loads, caps = {}, {}
local sum, usable, free, total = 0, 0, 0, 0
for i = 1, n do
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  loads[i] = redis.call('ZCARD', KEYS[i])
  caps[i] = tonumber(ARGV[11 + i])
  total = total + caps[i]
  if loads[i] < caps[i] then sum = sum + loads[i]; usable = usable + 1; free = free + caps[i] - loads[i] end
end
local kept = nil
local function held_back()
  if kept == nil then
    local clock, window = tonumber(ARGV[10]), tonumber(ARGV[11])
    local before = redis.call('ZCARD', live)
    redis.call('ZREMRANGEBYSCORE', live, '-inf', now)
    local busy = redis.call('ZCARD', live)
    if busy < before then
      redis.call('ZADD', pk, clock, before)
      redis.call('PEXPIRE', pk, window * 2)
    end
    redis.call('ZREMRANGEBYSCORE', pk, '-inf', clock - window)
    local peak = busy
    for _, v in ipairs(redis.call('ZRANGE', pk, 0, -1)) do peak = math.max(peak, tonumber(v)) end
    local reserve = math.max(0, math.min(peak, total - 1))
    kept = {free > 0 and free - 1 + busy < reserve, reserve, peak, total}
  end
  return kept[1]
end
local ticket = ARGV[5]
local band = -1
if ticket == '' then
  if c0 + c1 > 0 then
    if rband == 1 and held_back() then return {0, '', kept[2], kept[3], kept[4]} end
    if not (rband == 0 and c0 == 0 and held_back()) then
      if free > 0 then return {-1, '', free} end
      return {0, ''}
    end
  end
else
  if redis.call('ZSCORE', z0, ticket) then band = 0
  elseif redis.call('ZSCORE', z1, ticket) then band = 1
  else return {-2, ''} end
  local skips = tonumber(redis.call('HGET', st, 's') or '0')
  local batch_turn = c0 == 0 or (c1 > 0 and skips >= tonumber(ARGV[6]) - 1)
  if batch_turn and c0 > 0 and held_back() then batch_turn = false end
  local head
  if batch_turn then head = redis.call('ZRANGE', z1, 0, 0)[1]
  else head = redis.call('ZRANGE', z0, 0, 0)[1] end
  for i = n + 1, n + 4 do redis.call('PEXPIRE', KEYS[i], lease * 4) end
  if band == 1 and held_back() then return {0, '', kept[2], kept[3], kept[4]} end
  if head ~= ticket then return {-1, head} end
end
if usable == 0 then return {0, ''} end
if rband == 1 and held_back() then return {0, '', kept[2], kept[3], kept[4]} end
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
if rband == 0 then
  redis.call('ZADD', live, now + lease, ARGV[2] .. '~i')
  redis.call('PEXPIRE', live, lease * 4)
end
if band >= 0 then
  local z = z0
  if band == 1 then z = z1 end
  local tag = tonumber(redis.call('ZSCORE', z, ticket))
  redis.call('ZREM', z, ticket)
  redis.call('ZREM', wq, ticket)
  if c0 + c1 == 1 then
    redis.call('DEL', st)
  else
    local v = tonumber(redis.call('HGET', st, 'v') or '0')
    if tag > v then redis.call('HSET', st, 'v', string.format('%.17g', tag)) end
    if band == 0 and c1 > 0 then redis.call('HINCRBY', st, 's', 1) else redis.call('HSET', st, 's', 0) end
  end
elseif ARGV[7] ~= '' then
  local v = tonumber(redis.call('HGET', st, 'v') or '0')
  local s = math.max(v, tonumber(redis.call('HGET', st, 'k' .. ARGV[7]) or '0'))
  redis.call('HSET', st, 'k' .. ARGV[7], string.format('%.17g', s + tonumber(ARGV[8])), 'v', string.format('%.17g', s))
  redis.call('PEXPIRE', st, lease * 4)
end
if kept ~= nil then return {chosen, '', kept[2], kept[3], kept[4]} end
return {chosen, ''}
"""

# KEYS: a model's queue (two tag sets, the expiry set, the state hash). ARGV: lease ms, ticket, the
# most that may wait, band, key id, cost / share. Returns {1, tag, pushed ticket or ""} when queued,
# {0, tag, ""} when the queue is full and this request is the one refused (apps.gateway.fairness).
ENTER_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now)
for _, d in ipairs(dead) do redis.call('ZREM', KEYS[1], d); redis.call('ZREM', KEYS[2], d) end
if #dead > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now) end
local v = tonumber(redis.call('HGET', KEYS[4], 'v') or '0')
local f = tonumber(redis.call('HGET', KEYS[4], 'k' .. ARGV[5]) or '0')
local s = math.max(v, f)
local band = tonumber(ARGV[4])
local pushed = ''
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[3]) then
  local vz, vband = KEYS[2], 1
  if redis.call('ZCARD', KEYS[2]) == 0 then vz, vband = KEYS[1], 0 end
  local top = redis.call('ZREVRANGE', vz, 0, 0, 'WITHSCORES')
  if #top == 0 or vband < band or (vband == band and tonumber(top[2]) <= s) then
    return {0, string.format('%.17g', s), ''}
  end
  pushed = top[1]
  redis.call('ZREM', vz, pushed)
  redis.call('ZREM', KEYS[3], pushed)
end
redis.call('HSET', KEYS[4], 'k' .. ARGV[5], string.format('%.17g', s + tonumber(ARGV[6])))
redis.call('ZADD', KEYS[band + 1], s, ARGV[2])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[1]), ARGV[2])
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[1]) * 4) end
return {1, string.format('%.17g', s), pushed}
"""

# KEYS: a model's queue. ARGV: ticket, key id, refund (its cost / share). A ticket that leaves
# without a slot gives its place back and its key is not charged for it; 1 when it was queued.
LEAVE_SCRIPT = """
local gone = redis.call('ZREM', KEYS[1], ARGV[1]) + redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if gone > 0 then
  local f = redis.call('HGET', KEYS[4], 'k' .. ARGV[2])
  if f then
    local v = tonumber(redis.call('HGET', KEYS[4], 'v') or '0')
    local back = math.max(v, tonumber(f) - tonumber(ARGV[3]))
    redis.call('HSET', KEYS[4], 'k' .. ARGV[2], string.format('%.17g', back))
  end
end
if redis.call('ZCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) == 0 then redis.call('DEL', KEYS[4]) end
return gone
"""

# KEYS: a model's state hash. ARGV: key id, what to add to its finish tag, the lowest it may become.
CORRECT_SCRIPT = """
local f = redis.call('HGET', KEYS[1], 'k' .. ARGV[1])
if not f then return 0 end
local moved = math.max(tonumber(ARGV[3]), tonumber(f) + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'k' .. ARGV[1], string.format('%.17g', moved))
return 1
"""

# KEYS: the lease's slot set, the model's interactive leases, its interactive counts' last moments.
# ARGV: the lease, its interactive member, the caller's clock and the reserve's window (ms). An
# interactive lease given back notes the count it leaves, at this moment, for the reserve's peak.
RELEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREM', KEYS[1], ARGV[1])
local busy = redis.call('ZCOUNT', KEYS[2], now, '+inf')
if redis.call('ZREM', KEYS[2], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[3], ARGV[3], math.max(busy, 1))
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[4]) * 2)
end
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


_ALL = (ACQUIRE_SCRIPT, ENTER_SCRIPT, LEAVE_SCRIPT, CORRECT_SCRIPT, RENEW_SCRIPT, RELEASE_SCRIPT)
_SCRIPTS = {_sha(s): s for s in _ALL}
ACQUIRE_SHA, ENTER_SHA, LEAVE_SHA, CORRECT_SHA, RENEW_SHA, RELEASE_SHA = (_sha(s) for s in _ALL)


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

    def queue_keys(self, model: str) -> list[str]:
        """A model's queue: its bands' tag sets, its tickets' expiry set ("waiting": what the cluster
        page counts), its state (virtual time, keys' finish tags, grants past a waiting batch)."""
        return queue_keys(self.base, model)

    async def acquire(
        self,
        order: Sequence[Upstream],
        mode: int,
        queue: str,
        ticket: str | None = None,
        *,
        batch_every: int = 10,
        charge: tuple[int, float] | None = None,
        who: str = "",
        band: int | None = None,
        clock: float = 0.0,
        window: float = RESERVE_WINDOW_S,
    ) -> tuple[int | None, str]:
        """Take a slot on one of `order` by pick's rule: (its index or None, the lease's token). The
        candidates serve `queue`'s model: without a ticket a slot is taken only while nobody waits
        for it; with one, only when it is the ticket's turn (NotYourTurn otherwise, Gone when the
        ticket was pushed out), and the ticket leaves the queue in the same step. A batch-band
        request the interactive reserve holds back gets Reserved; `clock` (the caller's, seconds)
        and `window` date the reserve's peak."""
        # A lease's member names whose request holds it (a model's card reads them back).
        token = f"{self._token()}|{who}" if who else self._token()
        keys = [self._key("slots", u.id) for u in order]
        window_ms = int(window * 1000)
        reply = await self._script(
            ACQUIRE_SHA,
            [*keys, *self.queue_keys(queue), self._key("interactive", queue), self._key("peak", queue)],
            [
                self.lease_ms,
                token,
                mode,
                LOAD_BOUND,
                ticket or "",
                batch_every,
                charge[0] if charge else "",
                repr(charge[1]) if charge else 0,
                -1 if band is None else band,
                int(clock * 1000),
                window_ms,
                *(u.capacity for u in order),
            ],
        )
        chosen, head = int(reply[0]), _text(reply[1])
        if chosen == -1:
            raise NotYourTurn(head or None, int(reply[2]) if len(reply) > 2 else 0)
        if chosen == -2:
            raise Gone()
        if len(reply) > 4:  # the reserve, reckoned for a batch request
            metrics.interactive_reserve(queue, int(reply[2]))
            if not chosen:
                raise Reserved(int(reply[2]), int(reply[3]), int(reply[4]), window)
        if not chosen:
            return None, token
        self._held[token] = keys[chosen - 1]
        if band == INTERACTIVE:
            self._held[token + "~i"] = self._key("interactive", queue)
        if ticket is not None:
            self._held.pop(ticket, None)  # out of the queue already
        return chosen - 1, token

    def release(self, token: str, model: str, clock: float = 0.0, window: float = RESERVE_WINDOW_S) -> None:
        """Give a lease back in the background (a lease that cannot be given back expires)."""
        key = self._held.pop(token, None)
        if key is not None:
            live = self._held.pop(token + "~i", None)
            self._background(self._release(key, live, token, model, clock, window))

    async def release_now(self, token: str, model: str, clock: float = 0.0, window: float = RESERVE_WINDOW_S) -> None:
        """Give a lease back before going on: a request that answers its client after this cannot
        be followed by one of the same client's that finds the slot still taken."""
        key = self._held.pop(token, None)
        if key is not None:
            live = self._held.pop(token + "~i", None)
            await self._release(key, live, token, model, clock, window)

    async def _release(self, key: str, live: str | None, token: str, model: str, clock: float, window: float) -> None:
        """ZREM the lease; an interactive one's through RELEASE_SCRIPT, which notes the count it leaves."""
        try:
            if live is None:
                await self.client.execute(("ZREM", key, token), ("PUBLISH", self.channel, model))
                return
            keys = [key, live, self._key("peak", model)]
            args = [token, token + "~i", int(clock * 1000), int(window * 1000)]
            [reply, _] = await self.client.execute(
                ("EVALSHA", RELEASE_SHA, len(keys), *keys, *args), ("PUBLISH", self.channel, model)
            )
            if isinstance(reply, Exception):
                await self._script(RELEASE_SHA, keys, args)  # NOSCRIPT: sent whole once
        except Exception as exc:
            self.failed("release", exc)

    async def enter(
        self, model: str, who: str, band: int, key: int, cost_over_share: float, most: int
    ) -> tuple[str, float, str | None]:
        """A ticket in the model's queue, counted across processes, with its tag: (ticket, tag,
        the ticket pushed out to make room or None). QueueFull when this request is the one refused."""
        ticket = f"{self._token()}|{who}"
        reply = await self._script(
            ENTER_SHA, self.queue_keys(model), [self.lease_ms, ticket, most, band, key, repr(cost_over_share)]
        )
        tag = float(_text(reply[1]))
        if not int(reply[0]):
            raise QueueFull(model, tag)
        self._held[ticket] = self._key("waiting", model)
        pushed = _text(reply[2])
        if pushed:
            self._background(self._announce(model))  # the one pushed out hears it and leaves
        return ticket, tag, pushed or None

    async def leave(self, model: str, ticket: str, key: int, refund: float) -> None:
        if self._held.pop(ticket, None) is None:
            return
        try:
            await self._script(LEAVE_SHA, self.queue_keys(model), [ticket, key, repr(refund)])
        except Exception as exc:
            self.failed("leaving the queue", exc)

    async def correct(self, model: str, key: int, delta: float, floor: float) -> None:
        """Move a key's finish tag by what its request really cost (in the background)."""
        try:
            await self._script(CORRECT_SHA, [self._key("fair", model)], [key, repr(delta), repr(floor)])
        except Exception as exc:
            self.failed("correcting a charge", exc)

    async def waiters(self, model: str) -> list[str]:
        """The tickets waiting for the model in both bands (each carries its owner's path)."""
        z0, z1 = self.queue_keys(model)[:2]
        replies = await self.client.execute(("ZRANGE", z0, 0, -1), ("ZRANGE", z1, 0, -1))
        return [_text(item) for reply in replies if isinstance(reply, list) for item in reply]

    def announce(self, model: str) -> None:
        """Tell every process (in the background) that the model's waiters should look again."""
        self._background(self._announce(model))

    def spawn(self, work: Any) -> None:
        """Run a shared-state call in the background; its failure is counted, never raised."""
        self._background(work)

    async def _announce(self, model: str) -> None:
        try:
            await self.client.execute(("PUBLISH", self.channel, model))
        except Exception as exc:
            self.failed("announcing", exc)

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

    def __init__(self, shared: SharedSlots | None = None, *, window: float = RESERVE_WINDOW_S) -> None:
        self.shared = shared
        self._by_id: dict[str, InFlight] = {}
        self._leases: set[Lease] = set()  # those held now
        self.on_release: Callable[[str], None] = lambda model: None
        # The interactive reserve: its window and clock (wall time, so that processes agree through
        # Redis; a test moves it), and this process's interactive requests by model.
        self.window = window
        self.clock: Callable[[], float] = time.time
        self._interactive: dict[str, Interactive] = {}

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
        self,
        upstreams: Sequence[Upstream],
        key: str | None,
        *,
        exclude: Iterable[str] = (),
        queue: str | None = None,
        ticket: str | None = None,
        batch_every: int = 10,
        charge: tuple[int, float] | None = None,
        who: str = "",
        band: int | None = None,
    ) -> Lease | None:
        """A slot on one of the upstreams (prefix affinity under the load bound, else the least
        loaded), or None when every usable one is full. Upstreams in `exclude` or marked failed
        are passed over. With Redis, `queue` names the model whose shared queue these upstreams
        serve: `ticket`, the request's place in it, takes the slot only in its turn (NotYourTurn,
        Gone), and a request with none only while nobody waits. Without Redis the caller's own
        queue says whose turn it is. `who` (fairness.Who.token) goes with the lease, so whose requests
        hold a model's slots can be told (`holders`). `band`: a batch request the interactive reserve
        holds back gets Reserved (module docstring); an interactive one is counted for the reserve."""
        now = time.monotonic()
        skip = set(exclude)
        candidates = [u for u in upstreams if u.id not in skip and self.inflight(u).failed_until <= now]
        if not candidates:
            return None
        order, mode = preference(candidates, key)
        shared = self.shared
        if shared is not None and shared.available() and not order[0].id.startswith("external:"):
            try:
                index, token = await shared.acquire(
                    order,
                    mode,
                    queue or order[0].model,
                    ticket,
                    batch_every=batch_every,
                    charge=charge,
                    who=who,
                    band=band,
                    clock=self.clock(),
                    window=self.window,
                )
            except (NotYourTurn, Gone, Reserved):
                raise
            except Exception as exc:
                shared.failed("acquire", exc)
            else:
                return None if index is None else self._take(order[index], token, who, band)
        if band == BATCH:
            kept = self._kept(candidates)
            if kept is not None:
                raise kept
        index = pick([self.inflight(u).held for u in order], [u.capacity for u in order], mode)
        return None if index is None else self._take(order[index], None, who, band)

    def reserved(self, upstreams: Sequence[Upstream], exclude: Iterable[str] = ()) -> Reserved | None:
        """Whether the interactive reserve holds a batch request back from these upstreams (of one
        model) in this process now: Reserved with the numbers, or None."""
        now = time.monotonic()
        skip = set(exclude)
        return self._kept([u for u in upstreams if u.id not in skip and self.inflight(u).failed_until <= now])

    def _kept(self, candidates: Sequence[Upstream]) -> Reserved | None:
        if not candidates:
            return None
        state = self._interactive.get(candidates[0].model)
        if state is None:
            return None
        slots = free = 0
        for upstream in candidates:
            slots += upstream.capacity
            free += max(0, upstream.capacity - self.inflight(upstream).held)
        peak = state.peak(self.clock())
        kept = reserve(peak, slots)
        metrics.interactive_reserve(candidates[0].model, kept)
        if free > 0 and free - 1 + state.held < kept:
            return Reserved(kept, peak, slots, self.window)
        return None

    def _take(self, upstream: Upstream, token: str | None, who: str, band: int | None) -> Lease:
        inflight = self.inflight(upstream)
        inflight.held += 1
        metrics.IN_FLIGHT.inc()
        if band == INTERACTIVE:
            state = self._interactive.get(upstream.model)
            if state is None:
                state = self._interactive[upstream.model] = Interactive(self.window)
            state.held += 1
        lease = Lease(upstream, inflight, token, who, band)
        self._leases.add(lease)
        return lease

    def holders(self, model: str) -> list[str]:
        """Whose requests hold the model's slots in this process: a Who token per lease ("" for a
        lease that is nobody's). Safe to call from another thread: the set is copied in one step."""
        return [lease.who for lease in list(self._leases) if lease.upstream.model == model and not lease.released]

    def release(self, lease: Lease) -> None:
        """Give the lease's slot back (a second call does nothing); the shared count follows in the
        background."""
        if self._give_back(lease) and lease.token is not None and self.shared is not None:
            self.shared.release(lease.token, lease.upstream.model, self.clock(), self.window)

    async def give_back(self, lease: Lease) -> None:
        """Give the lease's slot back, the shared count too, before the caller answers its client."""
        if self._give_back(lease) and lease.token is not None and self.shared is not None:
            await self.shared.release_now(lease.token, lease.upstream.model, self.clock(), self.window)

    def _give_back(self, lease: Lease) -> bool:
        if lease.released:
            return False
        lease.released = True
        lease.inflight.held -= 1
        self._leases.discard(lease)
        metrics.IN_FLIGHT.dec()
        if lease.band == INTERACTIVE:
            self._interactive[lease.upstream.model].gave_back(self.clock())
        self.on_release(lease.upstream.model)
        return True

    def mark_failed(self, upstream: Upstream, seconds: float) -> None:
        self.inflight(upstream).failed_until = time.monotonic() + seconds
