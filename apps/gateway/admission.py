"""The admission stage: who gets the next free slot of a model.

1. The caller's limits (apps.quotas.limiter): past one, 429 with the numbers.
2. Its band: interactive unless it asks for batch (`x-llmgw-priority`, the body's
   `metadata.priority`, or OpenAI's `service_tier: "flex"`), and never above the band its key or
   project may use (it is then served at that band, and the answer says so).
3. A slot of the model, or of a fallback the key may use: taken at once when one is free and
   nobody waits for it. Otherwise the request waits in the model's fair queue
   (apps.gateway.fairness), charged its expected tokens, until it is its turn and a slot is free,
   for at most LLMGW_GATEWAY_QUEUE_TIMEOUT seconds (LLMGW_GATEWAY_BATCH_QUEUE_TIMEOUT in the batch
   band). With Redis the queue is shared by every gateway process (apps.gateway.slots decides the
   turn); without it, this process's queue is the only one. A batch request takes a slot only
   outside the interactive reserve (apps.gateway.slots): held back by it, it waits like any other,
   and an interactive request takes a reserved slot past it.
4. When the request ends, its key is charged what it really cost, and what its key's requests
   to the model produce is remembered for the next estimate.

A request refused here says why with the numbers: the queue's size, the band, the key's share of
the model and how many of its requests wait, and its place. Answers say how long the request
waited (`x-llmgw-queue-ms`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from apps.gateway import metrics
from apps.gateway.errors import Refused
from apps.gateway.fairness import BANDS, BATCH, INTERACTIVE, FairQueue, Full, Ticket, Waiting, Who, band_named
from apps.gateway.intake import Call, ClientLeft
from apps.gateway.routing import affinity_key
from apps.gateway.slots import Gone, Lease, NotYourTurn, QueueFull, Reserved, SharedSlots, SlotKeeper
from apps.gateway.tables import KeyEntry, ModelRoute, Tables
from apps.gateway.tokens import estimate_prompt_tokens
from apps.quotas.limiter import REQUESTS_PER_MINUTE, Headroom, Refusal, Window

__all__ = ["Admission", "Waiter", "limit_headers"]

log = logging.getLogger("llmgw.gateway")

#: Output tokens expected of a request whose key has not yet been seen using the model.
EXPECTED_OUTPUT = 256
#: How much one finished request moves its key's expected output (a moving average).
OUTPUT_WEIGHT = 0.2
#: How long a shared queue's shares (read from Redis) are used before they are read again.
SHARES_S = 0.2
#: How often a waiting request looks again without being woken.
RECHECK_S = 1.0
#: How many keys' Who are kept (all of them but in a very large deployment; past it, made anew).
MAX_WHOS = 100_000

Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(eq=False)
class Waiter:
    """A request waiting in a model's queue: its ticket here, and in the shared queue when there is one."""

    model: str
    ticket: Ticket
    key: int
    entered: float
    token: str | None = None
    share: float = 1.0
    tag: float = 0.0
    charged_shared: bool = False  # taken at once and charged in the shared queue (no ticket there)
    # Made when first needed: most requests take a slot at once and are never woken.
    _event: asyncio.Event | None = field(default=None, init=False, repr=False)

    @property
    def band(self) -> int:
        return self.ticket.band

    @property
    def event(self) -> asyncio.Event:
        event = self._event
        if event is None:
            event = self._event = asyncio.Event()
        return event


class Admission:
    """The stage, one per gateway process. `tables()` gives the current tables; `busy(model)` and
    `demand(model)` tell the reconciler that a model is short of replicas or wanted from zero."""

    def __init__(
        self,
        keeper: SlotKeeper,
        *,
        most: int,
        timeouts: tuple[float, float],
        cold_start_timeout: float,
        batch_every: int,
        tables: Callable[[], Tables],
        busy: Callable[[str], None],
        demand: Callable[[str], None],
    ) -> None:
        self.keeper = keeper
        self.queue = FairQueue(most, batch_every=batch_every)
        self.most = most
        self.timeouts = timeouts
        self.cold_start_timeout = cold_start_timeout
        self.batch_every = batch_every
        self.tables = tables
        self.busy = busy
        self.demand = demand
        self.limiter: Any = None
        self.shared: SharedSlots | None = None
        self._waiters: dict[str, dict[Ticket, Waiter]] = {}
        self._by_token: dict[str, Waiter] = {}
        self._outputs: dict[tuple[int, str], float] = {}
        self._shares: dict[str, tuple[float, Waiting]] = {}
        # Each key's Who and its token, made once per key entry (the tables make new entries).
        self._whos: dict[int, tuple[KeyEntry, Who, str]] = {}
        keeper.on_release = self.released

    # Waking -----------------------------------------------------------------------------------

    def released(self, model: str) -> None:
        """A slot of `model` came free (here, or through Redis in another process): the request
        whose turn it is in this process looks again."""
        head = self.queue.head(model)
        waiters = self._waiters.get(model)
        if head is None or waiters is None:
            return
        waiter = waiters.get(head)
        if waiter is not None:
            waiter.event.set()
        if head.band == BATCH:  # the interactive reserve may hold it back: the interactive band's first looks too
            first = self.queue.top(model, INTERACTIVE)
            waiter = waiters.get(first) if first is not None else None
            if waiter is not None:
                waiter.event.set()

    def wake_all(self) -> None:
        """The tables changed (new replicas may serve): every waiter looks again."""
        for waiters in self._waiters.values():
            for waiter in waiters.values():
                waiter.event.set()

    # Limits and bands -------------------------------------------------------------------------

    async def check_limits(self, call: Call) -> Headroom | None:
        """What the caller's limits leave once this request is counted (None when none governs it);
        a 429 with the numbers, and the limit headers, when one is used up."""
        if self.limiter is None or call.entry is None or not call.entry.limits:
            return None
        answer: Headroom | None = await self.limiter.admit(list(call.entry.limits), time.time())
        if isinstance(answer, Refusal):
            spent = Window(answer.allowed, 0, float(answer.retry_after_s))
            used_up = Headroom(spent, None) if answer.limit == REQUESTS_PER_MINUTE else Headroom(None, spent)
            headers = {"retry-after": str(max(1, int(answer.retry_after_s)))}
            headers.update((k.decode(), v.decode()) for k, v in limit_headers(call.endpoint.protocol, used_up))
            raise Refused(429, answer.message, kind="rate_limit_error", code="rate_limit_exceeded", headers=headers)
        return answer

    @staticmethod
    def choose_band(call: Call, headers: list[tuple[bytes, bytes]]) -> None:
        """The request's band, from what it asks and what its key and project may use."""
        assert call.entry is not None
        asked: object = None
        where = ""
        for name, value in headers:
            if name == b"x-llmgw-priority":
                asked, where = value.decode("latin-1"), "x-llmgw-priority"
        if asked is None:
            metadata = call.original.get("metadata")
            if isinstance(metadata, dict) and "priority" in metadata:
                asked, where = metadata["priority"], "metadata.priority"
            elif "service_tier" in call.original and call.endpoint.protocol == "openai":
                asked, where = call.original["service_tier"], "service_tier"
        band = INTERACTIVE if asked is None else band_named(asked)
        if band is None:
            raise Refused(
                400,
                f"{where}: {str(asked)[:40]!r} is not a priority band; the bands are interactive and batch.",
                kind="invalid_request_error",
                code="invalid_priority",
                param=where,
            )
        ceiling = call.entry.ceiling
        if band < ceiling:
            call.band_note = f"{BANDS[ceiling]}; asked {BANDS[band]}, the most this key may use is {BANDS[ceiling]}"
            band = ceiling
        call.band = band

    def cost(self, call: Call) -> float:
        """Tokens it is expected to take: its prompt, and its max_tokens bounded by what its key's
        requests to the model produce. Reckoned once per request: the slot's charge and the queue's
        take the same figure."""
        if call.cost is not None:
            return call.cost
        assert call.entry is not None
        body = call.body
        asked = next((body[k] for k in ("max_completion_tokens", "max_tokens") if isinstance(body.get(k), int)), None)
        usual = self._outputs.get((call.entry.key_id, call.model))
        expected = EXPECTED_OUTPUT if usual is None else max(1.0, usual * 1.5)
        if asked is not None and asked > 0:
            expected = min(float(asked), expected)
        call.cost = float(estimate_prompt_tokens(body)) + expected
        return call.cost

    # A slot -----------------------------------------------------------------------------------

    async def acquire(
        self, call: Call, route: ModelRoute, receive: Receive | None, *, exclude: frozenset[str] = frozenset()
    ) -> Lease | None:
        """A slot for the model, or for a fallback the key may use; waiting in the model's queue
        when none can be taken, and starting a model kept at zero replicas on demand. A model that
        cannot be placed anywhere, with nothing starting, is refused at once with placement's
        reason. None only when every upstream left is in `exclude`. A client that leaves while
        its request waits gives up its place at once (ClientLeft)."""
        assert call.entry is not None
        key: str | None = None  # the prompt's affinity, reckoned once a route has more than one upstream
        keyed = False
        names = [route.name, *(f for f in route.fallbacks if f != route.name and call.entry.may_use(f))]
        started = time.monotonic()
        deadline = started + self.timeouts[call.band]
        demanded = False
        waiter: Waiter | None = None
        watcher: asyncio.Task[None] | None = None
        free: dict[str, int] = {}  # the slots free that waiters ahead are about to take, by model
        kept: dict[str, Reserved] = {}  # the interactive reserve that last held this batch request back, by model
        try:
            while True:
                tables = self.tables()
                current = tables.models.get(route.name, route)
                if not demanded and _cold(current):
                    demanded = True
                    self.demand(route.name)
                    deadline = max(deadline, time.monotonic() + self.cold_start_timeout)
                routes = [r for r in (tables.models.get(n) for n in names) if r is not None]
                if not keyed and any(len(r.upstreams) > 1 for r in routes):
                    key, keyed = affinity_key(call.body), True
                lease = await self._take(call, routes, key, exclude, waiter, free, kept)
                if lease is not None:
                    self._took(call, waiter, started, lease)
                    return lease
                if exclude and not any(r.starting or any(u.id not in exclude for u in r.upstreams) for r in routes):
                    return None
                _refuse_unplaceable(route.name, current, routes)
                if waiter is None:
                    if current.upstreams and current.max_replicas > len(current.upstreams):
                        self.busy(route.name)
                    waiter = await self._enter(call, route.name, room=free.get(route.name, 0))
                if waiter.ticket.gone == "full":  # the shared queue had no place for it
                    raise self._full(call, route.name, waiter.share, shared=True)
                if waiter.ticket.gone is not None:
                    raise self._pushed_out(call, waiter)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._timed_out(call, waiter, current, kept.get(current.name))
                watcher = await self._wait(waiter, receive, watcher, min(remaining, RECHECK_S))
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            if waiter is not None and not waiter.ticket.granted:
                await self._leave(waiter)

    def _shared_ok(self) -> bool:
        return self.shared is not None and self.shared.available()

    async def _take(
        self,
        call: Call,
        routes: list[ModelRoute],
        key: str | None,
        exclude: frozenset[str],
        waiter: Waiter | None,
        free: dict[str, int] | None = None,
        kept: dict[str, Reserved] | None = None,
    ) -> Lease | None:
        """A slot of the first route that gives one: the waiter's own model in its turn, another
        only while nobody waits for it (a fallback is never taken past its own queue). `free`
        gets, by model, how many slots were free but for waiters ahead to take; `kept`, the
        interactive reserve that held a batch request back. A batch head the reserve holds back
        gives the turn to the interactive band, and an interactive request with none waiting ahead
        of it in its band takes a free reserved slot at once."""
        shared = self._shared_ok()
        for candidate in routes:
            if not candidate.upstreams:
                continue
            mine = waiter is not None and candidate.name == waiter.model
            if not shared:
                turn = self.queue.head(candidate.name)
                held = (
                    self.keeper.reserved(candidate.upstreams, exclude)
                    if turn is not None and turn.band == BATCH
                    else None
                )
                if held is not None:
                    turn = self.queue.top(candidate.name, INTERACTIVE)
                    if kept is not None and call.band == BATCH:
                        kept[candidate.name] = held
                if (mine and waiter is not None and turn is not waiter.ticket) or (not mine and turn is not None):
                    continue
            elif mine and waiter is not None and waiter.token is None:
                await self._join_shared(waiter)
            charge = None if mine else (call.entry.key_id if call.entry else 0, self.cost(call))
            try:
                lease = await self.keeper.acquire(
                    candidate.upstreams,
                    key,
                    exclude=exclude,
                    queue=candidate.name,
                    ticket=waiter.token if mine and waiter is not None else None,
                    batch_every=self.batch_every,
                    charge=charge,
                    who=self._whom(call)[2],  # whose request holds the slot (a model's card shows it)
                    band=call.band,
                )
            except Reserved as reserved:
                if kept is not None:
                    kept[candidate.name] = reserved
                continue
            except NotYourTurn as other:
                if free is not None:
                    free[candidate.name] = other.free
                ahead = self._by_token.get(other.head or "")
                if ahead is not None:
                    ahead.event.set()  # it is that one's turn, and it waits in this process
                continue
            except Gone:
                if mine and waiter is not None:
                    waiter.ticket.gone = "pushed out"
                continue
            if lease is not None:
                return lease
        return None

    def _took(self, call: Call, waiter: Waiter | None, started: float, lease: Lease) -> None:
        waited = time.monotonic() - started
        call.queue_ms = waited * 1000 if waiter is not None else 0.0
        if waiter is None:
            # Taken at once: in service all the same, so charged (the shared queue charged it in the
            # same step as the slot was taken).
            model = lease.upstream.model
            ticket = self.queue.charge(model, self._who(call), call.band, self.cost(call))
            call.waited = Waiter(model, ticket, ticket.who.key, started, share=ticket.share, tag=ticket.tag)
            call.waited.charged_shared = lease.token is not None
            return
        self.queue.grant(waiter.model, waiter.ticket)
        self._forget(waiter)
        call.waited = waiter
        metrics.queue_wait(waiter.model, BANDS[waiter.band], waited)
        self.released(waiter.model)  # more slots may be free: the next in turn looks too
        if waiter.token is not None and self.shared is not None:
            self.shared.announce(waiter.model)

    # The queue -----------------------------------------------------------------------------------

    def _who(self, call: Call) -> Who:
        return self._whom(call)[1]

    def _whom(self, call: Call) -> tuple[KeyEntry, Who, str]:
        """The caller's entry, Who and Who's token, kept while the tables keep the entry."""
        entry = call.entry
        assert entry is not None
        known = self._whos.get(entry.key_id)
        if known is None or known[0] is not entry:
            if len(self._whos) > MAX_WHOS:
                self._whos.clear()
            who = Who(entry.org_id or 0, entry.team_id or 0, entry.project_id or 0, entry.key_id, entry.weights)
            known = self._whos[entry.key_id] = (entry, who, who.token())
        return known

    async def _enter(self, call: Call, model: str, *, room: int = 0) -> Waiter:
        """A place in the model's queue. `room` more than its maximum where slots are free now: the
        waiters they are about to go to still count as waiting, and must not make this one's place
        look like one too many (a client at exactly the queue's size was refused)."""
        who = self._who(call)
        cost = self.cost(call)
        try:
            ticket, pushed = self.queue.enter(model, who, call.band, cost, room=room)
        except Full as full:
            raise self._full(call, model, full.ticket.share) from None
        waiter = Waiter(model, ticket, who.key, time.monotonic(), share=ticket.share, tag=ticket.tag)
        self._waiters.setdefault(model, {})[ticket] = waiter
        if pushed is not None:
            self._wake_ticket(model, pushed)
        if self._shared_ok():
            await self._join_shared(waiter, room=room)
        metrics.queued(model, BANDS[call.band], 1)
        return waiter

    async def _join_shared(self, waiter: Waiter, *, room: int = 0) -> None:
        """Take a place in the shared queue (for a waiter that has none: it came while Redis was away)."""
        shared = self.shared
        if shared is None:
            return
        ticket = waiter.ticket
        try:
            share = await self._shared_share(waiter.model, ticket.who)
            token, tag, pushed = await shared.enter(
                waiter.model, ticket.who.token(), ticket.band, waiter.key, ticket.cost / share, self.most + room
            )
        except QueueFull:
            self.queue.leave(waiter.model, ticket)
            ticket.gone = "full"
            return
        except Exception as exc:
            shared.failed("joining the queue", exc)
            return
        waiter.token, waiter.share, waiter.tag = token, share, tag
        self._by_token[token] = waiter
        if pushed is not None and (other := self._by_token.get(pushed)) is not None:
            other.ticket.gone = "pushed out"
            other.event.set()

    async def _shared_share(self, model: str, who: Who) -> float:
        """The key's share of the model among those waiting in every process (read from Redis at
        most every SHARES_S seconds)."""
        assert self.shared is not None
        cached = self._shares.get(model)
        if cached is None or time.monotonic() - cached[0] > SHARES_S:
            waiting = Waiting()
            for token in await self.shared.waiters(model):
                found = Who.from_token(token.rpartition("|")[2])
                if found is not None:
                    waiting.add(found, 1)
            cached = self._shares[model] = (time.monotonic(), waiting)
        return cached[1].share(who)

    def _wake_ticket(self, model: str, ticket: Ticket) -> None:
        waiter = self._waiters.get(model, {}).get(ticket)
        if waiter is not None:
            waiter.event.set()

    async def _wait(
        self, waiter: Waiter, receive: Receive | None, watcher: asyncio.Task[None] | None, timeout: float
    ) -> asyncio.Task[None] | None:
        """Until the waiter is woken, the client leaves (ClientLeft) or `timeout` passes."""
        if receive is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter.event.wait(), timeout)
            waiter.event.clear()
            return None
        if watcher is None:  # only a request that waits pays for watching its client
            watcher = asyncio.create_task(_watch_disconnect(receive))
        woken = asyncio.create_task(waiter.event.wait())
        try:
            await asyncio.wait({woken, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
        waiter.event.clear()
        if watcher.done():
            raise ClientLeft("the client went away while waiting for a replica")
        return watcher

    async def _leave(self, waiter: Waiter) -> None:
        was_head = self.queue.head(waiter.model) is waiter.ticket
        self.queue.leave(waiter.model, waiter.ticket)
        self._forget(waiter)
        if waiter.token is not None and self.shared is not None:
            await self.shared.leave(waiter.model, waiter.token, waiter.key, waiter.ticket.cost / waiter.share)
        if was_head:
            self.released(waiter.model)

    def _forget(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.model)
        if waiters is not None:
            waiters.pop(waiter.ticket, None)
            if not waiters:
                del self._waiters[waiter.model]
        if waiter.token is not None:
            self._by_token.pop(waiter.token, None)
        metrics.queued(waiter.model, BANDS[waiter.band], -1)

    # The end of a request --------------------------------------------------------------------------

    def settle(self, call: Call) -> None:
        """Charge the key what its request really cost, and remember what it produced."""
        entry = call.entry
        if entry is None or call.completion_tokens is None:
            return
        key = (entry.key_id, call.model)
        usual = self._outputs.get(key)
        produced = float(call.completion_tokens)
        self._outputs[key] = produced if usual is None else usual + OUTPUT_WEIGHT * (produced - usual)
        waiter = call.waited
        if not isinstance(waiter, Waiter) or call.prompt_tokens is None:
            return
        real = float(call.prompt_tokens + call.completion_tokens)
        self.queue.correct(waiter.model, waiter.ticket, real)
        shared = self.shared
        if (waiter.token is not None or waiter.charged_shared) and shared is not None and shared.available():
            delta = (real - waiter.ticket.cost) / waiter.share
            floor = waiter.tag if waiter.token is not None else 0.0  # a shared charge's own start is not known here
            shared.spawn(shared.correct(waiter.model, waiter.key, delta, floor))

    # Refusals, with the numbers -------------------------------------------------------------------

    def _mine(self, model: str, key: int) -> int:
        return sum(1 for t in self.queue.tickets(model) if t.who.key == key)

    def _full(self, call: Call, model: str, share: float, *, shared: bool = False) -> Refused:
        assert call.entry is not None
        # The shared queue (every web process's waiters) was full when the local one was not: its
        # count is its maximum, and whose they are is Redis's to know, not this process's.
        waiting = (
            f"{self.most} of {self.most} waiting in all web processes"
            if shared
            else (f"{self.queue.waiting(model)} of {self.most} waiting")
        )
        mine = "" if shared else f", and {self._mine(model, call.entry.key_id)} of the requests waiting are its own"
        return Refused(
            503,
            f"The queue for “{model}” is full ({waiting}): those waiting are of a higher band or nearer "
            f"their share than this one (band {BANDS[call.band]}; this key's share of “{model}” is "
            f"{share:.1%}{mine}).",
            kind="overloaded_error",
            code="queue_full",
            headers={"retry-after": "5"},
        )

    def _pushed_out(self, call: Call, waiter: Waiter) -> Refused:
        return Refused(
            503,
            f"This request was let go from the queue for “{waiter.model}” to make room for one of a higher "
            f"band or nearer its share (band {BANDS[waiter.band]}; this key's share was {waiter.share:.1%}, "
            f"and {self._mine(waiter.model, waiter.key) + 1} of those waiting were its own).",
            kind="overloaded_error",
            code="queue_full",
            headers={"retry-after": "5"},
        )

    def _timed_out(self, call: Call, waiter: Waiter, current: ModelRoute, kept: Reserved | None = None) -> Refused:
        place, of = self.queue.place(waiter.model, waiter.ticket)
        ready = len(current.upstreams)
        waited = self.timeouts[waiter.band]
        if kept is not None and ready:
            reason = (
                f"{kept.kept} of the {kept.slots} slots of “{current.name}” are kept for interactive requests "
                f"(peak {kept.peak} in the last {kept.window:g} s), and the others stayed busy for {waited:g} s"
            )
        elif ready:
            reason = f"every one of the {ready} ready replicas of “{current.name}” stayed busy for {waited:g} s"
        else:
            reason = f"“{current.name}” has no ready replica"
        where = f"; this request was {place} of {of} waiting in the {BANDS[waiter.band]} band" if place else ""
        return Refused(
            503,
            f"No capacity: {reason}{where} (this key's share of “{waiter.model}” is {waiter.share:.1%}).",
            kind="overloaded_error",
            headers={"retry-after": "10"},
        )


def limit_headers(protocol: str, left: Headroom) -> list[tuple[bytes, bytes]]:
    """The rate-limit headers clients read: OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,
    tokens} (resets as durations, "6m0s"), Anthropic's anthropic-ratelimit-{requests,tokens}-{limit,
    remaining,reset} (resets as RFC 3339 times). Only for the kinds a limit governs."""
    out: list[tuple[bytes, bytes]] = []
    anthropic = protocol == "anthropic"
    for kind, window in (("requests", left.requests), ("tokens", left.tokens)):
        if window is None:
            continue
        limit, remaining, reset = _LIMIT_NAMES[anthropic, kind]
        if anthropic:
            at = datetime.fromtimestamp(time.time() + window.reset_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        else:
            at = _duration(window.reset_s)
        out += [(limit, str(window.allowed).encode()), (remaining, str(window.remaining).encode())]
        out.append((reset, at.encode()))
    return out


#: The rate-limit headers' names (limit, remaining, reset) by (Anthropic's protocol or not, kind),
#: made once rather than for every answer.
_LIMIT_NAMES = {
    (anthropic, kind): tuple(
        (f"anthropic-ratelimit-{kind}-{part}" if anthropic else f"x-ratelimit-{part}-{kind}").encode()
        for part in ("limit", "remaining", "reset")
    )
    for anthropic in (False, True)
    for kind in ("requests", "tokens")
}


def _duration(seconds: float) -> str:
    """A reset as OpenAI writes it: "1s", "59s", "6m0s", "1h2m3s"."""
    total = max(0, math.ceil(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _cold(route: ModelRoute) -> bool:
    """A model kept at zero replicas with none ready or starting: asked for, it is started."""
    return not route.upstreams and not route.starting and route.min_replicas == 0 and not route.external


def _refuse_unplaceable(name: str, current: ModelRoute, routes: list[ModelRoute]) -> None:
    if not any(r.upstreams or r.starting for r in routes) and current.unplaceable:
        raise Refused(
            503,
            f"“{name}” cannot be served now: no node can take it ({current.unplaceable}).",
            kind="overloaded_error",
            code="model_unplaceable",
            headers={"retry-after": "30"},
        )


async def _watch_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
