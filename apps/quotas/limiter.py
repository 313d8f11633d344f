"""Rate limits for the gateway: admit a request or say which limit refused it, with the numbers.

The gateway holds each key's limits in memory (`Limit`, loaded from `RateLimit` rows by
its background key-table refresh through `load_all_limits()` / `limits_for()`) and asks a
limiter per request. At request time this module is pure asyncio: no ORM, no blocking I/O.
Nor does it make, per request, what a limit asks (its checks and counter names): each `Limit`
holds them, made on first use and named again when the minute changes. A Limit never changes;
the refresh makes new ones when a limit does, and what was made from the old one goes with it.

Windows are fixed and named by their start: the current minute (requests and tokens),
the UTC day (tokens) and the UTC calendar month (the token budget). A refusal's
`retry_after_s` is the time until the window that refused rolls over.

`admit()` is atomic: one Lua script in Redis (`RedisLimiter`), one lock-protected pass
over a dict without any await in between (`MemoryLimiter`). It checks every limit of
every scope and only if none is used up counts the request in each scope's per-minute
request window, so a refused request counts nothing and request limits are exact, even
for requests racing each other across gateway processes.

Tokens are only known after a request ends (`record_tokens()`), and `admit()` compares
the tokens already recorded with the limit. Requests that are in flight when the last
tokens under the limit are used still finish, so a token limit can be overshot by at
most (requests of that scope in flight at once) × (their max_tokens plus prompt); the
next request after the overshoot is refused. Request limits are not overshot.

`RedisLimiter` adds a process's recorded tokens up and writes them every `flush_s`
(0.1 s) in one pipeline, instead of one round trip per request. Until then the other
processes do not see them, which raises that bound by the tokens of the scope's requests
that ended in the last 0.1 s on each other gateway process. Closing the limiter writes
what is left; a process that is killed loses at most its last 0.1 s of counts.

A Redis failure must not take the gateway down: `admit()` then fails open (admits,
returning None) and `record_tokens()` drops the count, logging at most once a minute.
Limits are a fairness tool here, not a security boundary, and a refused request is
worse for an internal service than an uncounted one. After a failure the limiter does
not ask Redis again for `backoff_s` (2 s), so a Redis that hangs costs each request at
most the short socket timeout once, not on every request.

`MemoryLimiter` counts per process; with several gateway processes each one allows
the whole limit. It is the default when no LLMGW_REDIS_URL is set (one machine).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from typing import Any, NamedTuple

from django.utils.translation import gettext

from apps.quotas.resp import RedisError

__all__ = [
    "Headroom",
    "Limit",
    "MemoryLimiter",
    "RedisLimiter",
    "Refusal",
    "Window",
    "limits_for",
    "load_all_limits",
    "make_limiter",
    "pick_limits",
]

log = logging.getLogger(__name__)

REQUESTS_PER_MINUTE = "requests per minute"
TOKENS_PER_MINUTE = "tokens per minute"
TOKENS_PER_DAY = "tokens per day"
MONTHLY_TOKEN_BUDGET = "monthly token budget"

# Narrowest first: a refusal names the narrowest scope that is over a limit.
SCOPE_ORDER = {"key": 0, "project": 1, "team": 2, "org": 3}


@dataclass(frozen=True)
class Limit:
    """One scope's limits as the gateway holds them. None is no limit."""

    scope: str  # "org:1", "team:3", "project:7", "key:12"
    label: str  # "team Vision", for messages
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    monthly_token_budget: int | None = None

    @cached_property
    def _plan(self) -> _Plan:
        # Made from the fields above, which never change: the gateway's table refresh makes new
        # Limits when a limit changes, and with them new plans. Not a field: equality, hashing,
        # repr and dataclasses.replace() ignore it.
        return _Plan(self)


@dataclass(frozen=True)
class Window:
    """One window of a limit as a client is told it: allowed, left, and seconds until it rolls over."""

    allowed: int
    remaining: int
    reset_s: float


@dataclass(frozen=True)
class Headroom:
    """What an admitted request leaves of its scopes' limits: the tightest request window and the
    tightest token window (None where no limit governs it), for the rate-limit headers."""

    requests: Window | None
    tokens: Window | None


def headroom(checks: Sequence[_Check], used: list[int], now: float) -> Headroom:
    """The tightest window of each kind, once the request was counted (the first of equals)."""
    requests: _Check | None = None
    tokens: _Check | None = None
    requests_left = tokens_left = 0
    for check, count in zip(checks, used, strict=True):
        left = check.allowed - count
        if check.counts_request:  # a request window: the request itself is counted in it
            left = left - 1 if left > 0 else 0
            if requests is None or left < requests_left:
                requests, requests_left = check, left
        else:
            left = left if left > 0 else 0
            if tokens is None or left < tokens_left:
                tokens, tokens_left = check, left
    return Headroom(
        Window(requests.allowed, requests_left, requests.window_end - now) if requests is not None else None,
        Window(tokens.allowed, tokens_left, tokens.window_end - now) if tokens is not None else None,
    )


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: which limit of which scope, how much was used, and when to retry."""

    limit: str  # "requests per minute" | "tokens per minute" | "tokens per day" | "monthly token budget"
    scope: str
    label: str
    used: int
    allowed: int
    retry_after_s: int

    @property
    def message(self) -> str:
        values = {"label": self.label, "allowed": self.allowed, "used": self.used, "retry": self.retry_after_s}
        if self.limit == REQUESTS_PER_MINUTE:
            text = gettext(
                "%(label)s is over its limit of %(allowed)s requests per minute (%(used)s used); retry in %(retry)s s"
            )
        elif self.limit == TOKENS_PER_MINUTE:
            text = gettext(
                "%(label)s is over its limit of %(allowed)s tokens per minute (%(used)s used); retry in %(retry)s s"
            )
        elif self.limit == TOKENS_PER_DAY:
            text = gettext(
                "%(label)s is over its limit of %(allowed)s tokens per day (%(used)s used); retry in %(retry)s s"
            )
        else:
            text = gettext(
                "%(label)s is over its monthly budget of %(allowed)s tokens (%(used)s used); retry in %(retry)s s"
            )
        return text % values


# Windows -------------------------------------------------------------------------------


def _minute(now: float) -> tuple[str, float]:
    start = math.floor(now / 60) * 60
    return f"m{int(start)}", start + 60


def _day(now: float) -> tuple[str, float]:
    start = math.floor(now / 86400) * 86400
    return f"d{int(start)}", start + 86400


_current_month: tuple[float, float, str] = (0.0, 0.0, "")  # start, end, key of the month last asked for


def _month(now: float) -> tuple[str, float]:
    global _current_month
    start, end, key = _current_month
    if start <= now < end:
        return key, end
    moment = datetime.fromtimestamp(now, UTC)
    year, month = (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
    key = f"M{moment.year:04d}{moment.month:02d}"
    start = datetime(moment.year, moment.month, 1, tzinfo=UTC).timestamp()
    end = datetime(year, month, 1, tzinfo=UTC).timestamp()
    _current_month = (start, end, key)
    return key, end


def _retry_after(window_end: float, now: float) -> int:
    return max(1, math.ceil(window_end - now))


@dataclass(frozen=True, slots=True)
class _Check:
    scope: str
    label: str
    kind: str
    key: str  # counter name, without the limiter's prefix
    allowed: int
    window_end: float
    counts_request: bool


class _Named(NamedTuple):
    """One limit's checks and token counters, named for the windows of one minute."""

    minute: int  # math.floor(now / 60): the minute they were named for
    checks: tuple[_Check, ...]
    tokens: tuple[tuple[str, float], ...]  # (counter, window end)


_UNNAMED = _Named(-1, (), ())


class _Plan:
    """What a request asks of one Limit, made once per Limit (`Limit._plan`) and named again
    once a minute (`_named()`).

    Per request, a limiter reads the checks and counter names from here instead of making
    them: a minute's windows lie inside one UTC day and one calendar month, so the minute
    alone says when the names change. `named` is replaced whole, never changed in place, so
    a task or thread reading it sees one minute's names or the next one's, never a mix.
    Nothing here refers back to the Limit, so a Limit the tables dropped is freed at once.
    """

    __slots__ = ("named", "rank")

    def __init__(self, limit: Limit) -> None:
        self.rank = SCOPE_ORDER.get(limit.scope.split(":", 1)[0], 9)
        self.named = _UNNAMED


def _named(limit: Limit, minute: int, now: float) -> _Named:
    """The limit's checks and token counters in the minute `minute` (math.floor(now / 60))."""
    plan = limit._plan
    named = plan.named
    if named.minute != minute:
        named = plan.named = _name(limit, minute, now)
    return named


def _rank(limit: Limit) -> int:
    return limit._plan.rank


def _name(limit: Limit, minute_index: int, now: float) -> _Named:
    """Every limit to check, in a scope the longest window first; and every token window.

    Windows nest (a month holds the day, the day the minute), so when several limits of
    one scope are used up the one named is the one whose retry time is real. The token
    counters are all three windows whatever the limits, so a limit added later in the day
    or month starts from what was used.
    """
    minute, minute_end = _minute(now)
    day, day_end = _day(now)
    month, month_end = _month(now)
    scope, label = limit.scope, limit.label
    checks = []
    if limit.monthly_token_budget is not None:
        checks.append(
            _Check(
                scope, label, MONTHLY_TOKEN_BUDGET, f"{scope}:tok:{month}", limit.monthly_token_budget, month_end, False
            )
        )
    if limit.tokens_per_day is not None:
        checks.append(_Check(scope, label, TOKENS_PER_DAY, f"{scope}:tok:{day}", limit.tokens_per_day, day_end, False))
    if limit.tokens_per_minute is not None:
        checks.append(
            _Check(scope, label, TOKENS_PER_MINUTE, f"{scope}:tok:{minute}", limit.tokens_per_minute, minute_end, False)
        )
    if limit.requests_per_minute is not None:
        checks.append(
            _Check(
                scope, label, REQUESTS_PER_MINUTE, f"{scope}:req:{minute}", limit.requests_per_minute, minute_end, True
            )
        )
    tokens: tuple[tuple[str, float], ...] = ()
    if (
        limit.tokens_per_minute is not None
        or limit.tokens_per_day is not None
        or limit.monthly_token_budget is not None
    ):
        tokens = (
            (f"{scope}:tok:{minute}", minute_end),
            (f"{scope}:tok:{day}", day_end),
            (f"{scope}:tok:{month}", month_end),
        )
    return _Named(minute_index, tuple(checks), tokens)


def _checks(limits: Sequence[Limit], now: float) -> Sequence[_Check]:
    """Every limit to check, narrowest scope first (a refusal names the narrowest scope over a limit)."""
    minute = math.floor(now / 60)
    if len(limits) == 1:
        return _named(limits[0], minute, now).checks
    checks: list[_Check] = []
    for limit in sorted(limits, key=_rank):
        checks += _named(limit, minute, now).checks
    return checks


def _token_counters(limits: Sequence[Limit], now: float) -> list[tuple[str, float]]:
    """(counter, window end) for every token window of every scope with a token limit."""
    minute = math.floor(now / 60)
    return [counter for limit in limits for counter in _named(limit, minute, now).tokens]


def _refusal(check: _Check, used: int, now: float) -> Refusal:
    return Refusal(
        limit=check.kind,
        scope=check.scope,
        label=check.label,
        used=int(used),
        allowed=check.allowed,
        retry_after_s=_retry_after(check.window_end, now),
    )


# In process ----------------------------------------------------------------------------


class MemoryLimiter:
    """Counters in a dict, for one process. See the module docstring."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._ends: dict[str, float] = {}
        # A thread lock held with no await inside: atomic against other tasks and threads alike.
        self._lock = threading.Lock()
        self._swept_at = 0.0

    async def admit(self, limits: list[Limit], now: float) -> Refusal | Headroom | None:
        """Refusal when a limit is used up; else what is left (None when no limit governs)."""
        checks = _checks(limits, now)
        if not checks:
            return None
        counts, ends = self._counts, self._ends
        with self._lock:
            if now - self._swept_at >= 60:
                self._sweep(now)
            used = [counts.get(check.key, 0) for check in checks]
            for check, count in zip(checks, used, strict=True):
                if count >= check.allowed:
                    return _refusal(check, count, now)
            for check in checks:
                if check.counts_request:
                    key = check.key
                    counts[key] = counts.get(key, 0) + 1
                    ends[key] = check.window_end
        return headroom(checks, used, now)

    async def record_tokens(self, limits: list[Limit], tokens: int, now: float) -> None:
        if tokens <= 0:
            return
        tokens = int(tokens)
        minute = math.floor(now / 60)
        counts, ends = self._counts, self._ends
        with self._lock:
            for limit in limits:
                for key, end in _named(limit, minute, now).tokens:
                    counts[key] = counts.get(key, 0) + tokens
                    ends[key] = end

    async def close(self) -> None:
        return None

    def _sweep(self, now: float) -> None:
        # Forget windows that ended more than a minute ago, at most once a minute (admit() asks).
        self._swept_at = now
        for key in [key for key, end in self._ends.items() if end < now - 60]:
            self._counts.pop(key, None)
            self._ends.pop(key, None)


# Redis ---------------------------------------------------------------------------------

# KEYS: every counter to check, in order. ARGV[1]: how many; then for each counter its
# allowed amount, whether it counts the request (1/0) and its TTL in seconds.
# Returns {0, used of each counter} when admitted, else {index (1-based), used}.
ADMIT_SCRIPT = """
local n = tonumber(ARGV[1])
local counts = {0}
for i = 1, n do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used >= tonumber(ARGV[1 + (i - 1) * 3 + 1]) then
    return {i, used}
  end
  counts[i + 1] = used
end
for i = 1, n do
  if ARGV[1 + (i - 1) * 3 + 2] == '1' then
    redis.call('INCR', KEYS[i])
    redis.call('EXPIRE', KEYS[i], tonumber(ARGV[1 + (i - 1) * 3 + 3]))
  end
end
return counts
"""

ADMIT_SHA = hashlib.sha1(ADMIT_SCRIPT.encode()).hexdigest()  # noqa: S324 - Redis names scripts by SHA-1

# Windows are kept a little past their end so a clock slightly behind still finds them.
TTL_GRACE_S = 120


class RedisLimiter:
    """Counters in Redis, shared by every gateway process. See the module docstring.

    `timeout` bounds each call (a Redis that hangs must not hold every request for long);
    `backoff_s` is how long to leave Redis alone after a failure; `flush_s` how often the
    recorded tokens are written.
    """

    def __init__(
        self, url: str, prefix: str = "llmgw:rl", *, timeout: float = 0.5, backoff_s: float = 2.0, flush_s: float = 0.1
    ) -> None:
        from apps.quotas.resp import RedisClient

        self.prefix = prefix
        self.backoff_s = backoff_s
        # One pipelined connection (apps.quotas.resp): a burst of admits shares it, each call
        # bounded by `timeout`, with no retry (a second try doubles the wait of a request
        # that is admitted anyway).
        self._redis = RedisClient(url, timeout=timeout)
        self._down_until = 0.0
        self._logged_at = -math.inf
        self.flush_s = flush_s
        self._pending: dict[str, tuple[int, int]] = {}  # counter -> (tokens to add, TTL in s)
        self._flush_at: asyncio.TimerHandle | None = None
        self._flushing: set[asyncio.Task[None]] = set()

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{name}"

    def _failed(self, what: str, exc: BaseException) -> None:
        moment = time.monotonic()
        self._down_until = moment + self.backoff_s
        if moment - self._logged_at >= 60:
            self._logged_at = moment
            log.warning(
                "rate limits: Redis failed during %s (%s: %s); admitting requests without counting them",
                what,
                type(exc).__name__,
                exc,
            )

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def admit(self, limits: list[Limit], now: float) -> Refusal | Headroom | None:
        """Refusal when a limit is used up; else what is left (None when no limit governs, or
        Redis is away and the request is admitted uncounted)."""
        checks = _checks(limits, now)
        if not checks or not self._available():
            return None
        args: list[Any] = [len(checks)]
        for check in checks:
            args += [
                check.allowed,
                1 if check.counts_request else 0,
                max(1, math.ceil(check.window_end - now)) + TTL_GRACE_S,
            ]
        keys = [self._key(c.key) for c in checks]
        try:
            [reply] = await self._redis.execute(("EVALSHA", ADMIT_SHA, len(keys), *keys, *args))
            if isinstance(reply, RedisError) and str(reply).startswith("NOSCRIPT"):
                [reply] = await self._redis.execute(("EVAL", ADMIT_SCRIPT, len(keys), *keys, *args))
            if isinstance(reply, Exception):
                raise reply
            index = int(reply[0])
        except Exception as exc:  # any Redis or network error: fail open
            self._failed("admit", exc)
            return None
        if not index:
            return headroom(checks, [int(count) for count in reply[1:]], now)
        return _refusal(checks[index - 1], int(reply[1]), now)

    async def record_tokens(self, limits: list[Limit], tokens: int, now: float) -> None:
        """Add the tokens to what this process writes at its next flush (see the module docstring)."""
        counters = _token_counters(limits, now)
        if tokens <= 0 or not counters:
            return
        pending = self._pending
        for name, end in counters:
            key = self._key(name)
            ttl = max(1, math.ceil(end - now)) + TTL_GRACE_S
            held = pending.get(key)
            pending[key] = (held[0] + int(tokens), max(held[1], ttl)) if held else (int(tokens), ttl)
        if self.flush_s <= 0:
            await self.flush()
        elif self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(self.flush_s, self._flush_soon)

    def _flush_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def flush(self) -> None:
        """Write the tokens recorded since the last flush, in one pipeline."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        pending, self._pending = self._pending, {}
        if not pending or not self._available():
            return  # Redis is down: dropped, like any count made while it is
        commands: list[tuple[Any, ...]] = []
        for key, (tokens, ttl) in pending.items():
            commands += [("INCRBY", key, tokens), ("EXPIRE", key, ttl)]
        try:
            for reply in await self._redis.execute(*commands):
                if isinstance(reply, Exception):
                    raise reply
        except Exception as exc:
            self._failed("record_tokens", exc)

    async def close(self) -> None:
        if self._flushing:  # a timed flush under way finishes on the connection before it closes
            await asyncio.gather(*self._flushing, return_exceptions=True)
        await self.flush()
        await self._redis.close()


def make_limiter() -> RedisLimiter | MemoryLimiter:
    """Redis when LLMGW_REDIS_URL is set (shared by all gateway processes), else in process."""
    from django.conf import settings

    if settings.REDIS_URL:
        # Under the installation's prefix, so two installations sharing a Redis never share counters.
        return RedisLimiter(settings.REDIS_URL, prefix=f"{settings.REDIS_PREFIX}:rl")
    return MemoryLimiter()


# Loading limits (background refresh, not per request) ------------------------------------


def _limit_from_row(row: Any) -> Limit:
    if row.api_key_id:
        label = gettext("API key %(name)s (%(prefix)s…)") % {"name": row.api_key.name, "prefix": row.api_key.prefix}
    elif row.project_id:
        label = gettext("project %(name)s") % {"name": row.project.name}
    elif row.team_id:
        label = gettext("team %(name)s") % {"name": row.team.name}
    else:
        label = gettext("organisation %(name)s") % {"name": row.organization.name}
    return Limit(
        scope=row.scope,
        label=label,
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        tokens_per_day=row.tokens_per_day,
        monthly_token_budget=row.monthly_token_budget,
    )


def _rows() -> Any:
    from apps.quotas.models import RateLimit

    return RateLimit.objects.select_related("organization", "team", "project", "api_key").only(
        "organization__name",
        "team__name",
        "project__name",
        "api_key__name",
        "api_key__prefix",
        "requests_per_minute",
        "tokens_per_minute",
        "tokens_per_day",
        "monthly_token_budget",
    )


def load_all_limits() -> dict[str, Limit]:
    """Every rate limit, keyed by scope ("team:3"), in one query. For the gateway's key-table refresh."""
    return {limit.scope: limit for limit in map(_limit_from_row, _rows())}


def pick_limits(
    table: dict[str, Limit],
    *,
    key_id: int | None,
    project_id: int | None = None,
    team_id: int | None = None,
    org_id: int | None = None,
) -> list[Limit]:
    """The limits that apply to one key, narrowest first, from a `load_all_limits()` table."""
    scopes = [
        f"key:{key_id}" if key_id else None,
        f"project:{project_id}" if project_id else None,
        f"team:{team_id}" if team_id else None,
        f"org:{org_id}" if org_id else None,
    ]
    return [table[scope] for scope in scopes if scope is not None and scope in table]


def limits_for(
    key_id: int | None, user_id: int | None, project_id: int | None, team_id: int | None, org_id: int | None
) -> list[Limit]:
    """The limits that apply to one key, narrowest first, read from the database.

    `user_id` is accepted for the gateway's call but unused: limits belong to keys and to
    branches of the tree, not to people.
    """
    from django.db.models import Q

    wanted = Q(pk__in=[])
    for field, value in (
        ("api_key_id", key_id),
        ("project_id", project_id),
        ("team_id", team_id),
        ("organization_id", org_id),
    ):
        if value:
            wanted |= Q(**{field: value})
    table = {limit.scope: limit for limit in map(_limit_from_row, _rows().filter(wanted))}
    return pick_limits(table, key_id=key_id, project_id=project_id, team_id=team_id, org_id=org_id)
