"""Rate limiting, for the in-process limiter and the Redis one alike (no database)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from apps.quotas.limiter import Headroom, Limit, MemoryLimiter, RedisLimiter, Refusal, Window

REDIS_TEST_URL = "redis://127.0.0.1:6379/12"

# 2026-10-03 12:00:48 UTC: 12 s before the minute rolls over.
NOW = datetime(2026, 10, 3, 12, 0, 48, tzinfo=UTC).timestamp()


def _redis_reachable() -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(REDIS_TEST_URL, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
    except Exception:
        return False


@pytest.fixture(params=["memory", "redis"])
async def limiter(request: Any) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield MemoryLimiter()
        return
    if not _redis_reachable():
        pytest.skip(f"Redis is not reachable at {REDIS_TEST_URL}")
    prefix = f"llmgw:test:{uuid.uuid4().hex[:12]}"
    # A generous timeout: these tests are about what is counted, and a busy test machine can
    # take longer than the production half second to open a burst of connections, after
    # which the limiter would (rightly) fail open and admit without counting.
    # Tokens written at once (flush_s=0): these tests read the counts right after recording them.
    # Batched writes have a test of their own.
    redis_limiter = RedisLimiter(REDIS_TEST_URL, prefix=prefix, timeout=10.0, flush_s=0)
    yield redis_limiter
    import redis.asyncio

    client = redis.asyncio.Redis.from_url(REDIS_TEST_URL)
    keys = [key async for key in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
    await redis_limiter.close()


def admitted(answer: object) -> bool:
    """Admitted: what is left of the limits (or None when none governs), not a refusal."""
    return not isinstance(answer, Refusal)


def team(**limits: int) -> Limit:
    return Limit(scope="team:3", label="team Vision", **limits)


async def test_the_request_over_the_limit_is_refused_with_the_numbers(limiter: Any) -> None:
    limits = [team(requests_per_minute=3)]
    for _ in range(3):
        assert admitted(await limiter.admit(limits, NOW))
    refusal = await limiter.admit(limits, NOW)
    assert refusal == Refusal(
        limit="requests per minute", scope="team:3", label="team Vision", used=3, allowed=3, retry_after_s=12
    )
    assert refusal.message == "team Vision is over its limit of 3 requests per minute (3 used); retry in 12 s"


async def test_a_refused_request_counts_nothing(limiter: Any) -> None:
    key = Limit(scope="key:12", label="API key ci", requests_per_minute=2)
    org = Limit(scope="org:1", label="organisation Acme", requests_per_minute=5)
    assert admitted(await limiter.admit([key, org], NOW))
    assert admitted(await limiter.admit([key, org], NOW))
    for _ in range(5):
        refusal = await limiter.admit([key, org], NOW)
        assert refusal is not None and refusal.scope == "key:12"
    # The organisation counted only the two admitted requests: three more fit through another key.
    other = Limit(scope="key:13", label="API key other", requests_per_minute=100)
    for _ in range(3):
        assert admitted(await limiter.admit([other, org], NOW))
    refusal = await limiter.admit([other, org], NOW)
    assert refusal is not None and (refusal.scope, refusal.used) == ("org:1", 5)


async def test_token_limits_refuse_once_recorded_tokens_reach_them(limiter: Any) -> None:
    limits = [team(tokens_per_minute=1000)]
    assert admitted(await limiter.admit(limits, NOW))
    await limiter.record_tokens(limits, 600, NOW)
    assert admitted(await limiter.admit(limits, NOW))
    await limiter.record_tokens(limits, 600, NOW)
    refusal = await limiter.admit(limits, NOW)
    assert refusal is not None
    assert (refusal.limit, refusal.used, refusal.allowed) == ("tokens per minute", 1200, 1000)
    assert refusal.retry_after_s == 12


async def test_the_daily_and_monthly_windows_refuse_until_they_roll_over(limiter: Any) -> None:
    daily = [team(tokens_per_day=100)]
    await limiter.record_tokens(daily, 100, NOW)
    refusal = await limiter.admit(daily, NOW)
    assert refusal is not None and refusal.limit == "tokens per day"
    assert refusal.retry_after_s == 12 * 3600 - 48
    assert admitted(await limiter.admit(daily, datetime(2026, 10, 4, tzinfo=UTC).timestamp()))

    monthly = [Limit(scope="org:1", label="organisation Acme", monthly_token_budget=1000)]
    await limiter.record_tokens(monthly, 1000, NOW)
    refusal = await limiter.admit(monthly, NOW)
    assert refusal is not None and refusal.limit == "monthly token budget"
    assert refusal.retry_after_s == int(datetime(2026, 11, 1, tzinfo=UTC).timestamp() - NOW)
    assert "monthly budget of 1000 tokens (1000 used)" in refusal.message
    assert admitted(await limiter.admit(monthly, datetime(2026, 11, 1, 0, 0, 1, tzinfo=UTC).timestamp()))


async def test_the_minute_window_rolls_over(limiter: Any) -> None:
    limits = [team(requests_per_minute=1)]
    assert admitted(await limiter.admit(limits, NOW))
    assert await limiter.admit(limits, NOW + 11) is not None
    assert admitted(await limiter.admit(limits, NOW + 12))  # 12:01:00, a new minute


async def test_december_rolls_over_into_january(limiter: Any) -> None:
    late = datetime(2026, 12, 31, 23, 59, 30, tzinfo=UTC).timestamp()
    limits = [team(monthly_token_budget=10)]
    await limiter.record_tokens(limits, 10, late)
    refusal = await limiter.admit(limits, late)
    assert refusal is not None and refusal.retry_after_s == 30
    assert admitted(await limiter.admit(limits, late + 30))


async def test_the_narrowest_scope_over_a_limit_is_named(limiter: Any) -> None:
    org = Limit(scope="org:1", label="organisation Acme", requests_per_minute=1)
    project = Limit(scope="project:7", label="project Search", requests_per_minute=1)
    key = Limit(scope="key:12", label="API key ci", requests_per_minute=10)
    assert admitted(await limiter.admit([org, project, key], NOW))
    refusal = await limiter.admit([org, project, key], NOW)  # order given does not matter
    assert refusal is not None and refusal.scope == "project:7" and refusal.label == "project Search"


async def test_in_one_scope_the_longest_window_is_named(limiter: Any) -> None:
    limits = [team(requests_per_minute=1, tokens_per_day=10)]
    assert admitted(await limiter.admit(limits, NOW))
    await limiter.record_tokens(limits, 50, NOW)
    refusal = await limiter.admit(limits, NOW)
    assert refusal is not None and refusal.limit == "tokens per day"


async def test_no_limits_admit_everything(limiter: Any) -> None:
    assert await limiter.admit([], NOW) is None
    assert await limiter.admit([team()], NOW) is None
    await limiter.record_tokens([team()], 10, NOW)


async def test_concurrent_requests_are_admitted_exactly_up_to_the_limit(limiter: Any) -> None:
    limits = [team(requests_per_minute=50)]
    answers = await asyncio.gather(*(limiter.admit(limits, NOW) for _ in range(200)))
    assert getattr(limiter, "_down_until", 0.0) == 0.0, "the limiter failed open during the burst"
    assert sum(admitted(answer) for answer in answers) == 50
    assert {answer.used for answer in answers if isinstance(answer, Refusal)} == {50}


async def test_redis_tokens_are_added_up_and_written_together_after_the_flush_interval() -> None:
    if not _redis_reachable():
        pytest.skip(f"Redis is not reachable at {REDIS_TEST_URL}")
    import redis.asyncio

    prefix = f"llmgw:test:{uuid.uuid4().hex[:12]}"
    # An interval long enough that a loaded machine looks before it ends: the first look must
    # come before the flush, whatever else the machine is doing.
    limiter = RedisLimiter(REDIS_TEST_URL, prefix=prefix, timeout=10.0, flush_s=1.0)
    client = redis.asyncio.Redis.from_url(REDIS_TEST_URL)
    limits = [team(tokens_per_minute=1000)]
    try:
        for _ in range(3):
            await limiter.record_tokens(limits, 200, NOW)
        keys = await client.keys(f"{prefix}:*")  # one round trip: a scan of a full database is many
        assert keys == []  # nothing written yet: one pipeline per interval, not a round trip per request
        assert admitted(await limiter.admit(limits, NOW))
        async with asyncio.timeout(10):
            while not await client.keys(f"{prefix}:*"):
                await asyncio.sleep(0.01)
        keys = await client.keys(f"{prefix}:*")  # the minute, day and month windows
        assert [int(await client.get(key)) for key in keys] == [600] * len(keys)
        assert all([await client.ttl(key) > 0 for key in keys])
        await limiter.record_tokens(limits, 500, NOW)
        await limiter.close()  # what is left is written on the way out
        assert [int(await client.get(key)) for key in keys] == [1100] * len(keys)
        other = RedisLimiter(REDIS_TEST_URL, prefix=prefix, timeout=10.0)  # another gateway process
        refusal = await other.admit(limits, NOW)
        await other.close()
        assert refusal is not None and refusal.used == 1100
    finally:
        keys = [key async for key in client.scan_iter(f"{prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def test_redis_that_lost_the_script_is_sent_it_again() -> None:
    if not _redis_reachable():
        pytest.skip(f"Redis is not reachable at {REDIS_TEST_URL}")
    from apps.quotas.resp import RedisClient

    prefix = f"llmgw:test:{uuid.uuid4().hex[:12]}"
    limiter = RedisLimiter(REDIS_TEST_URL, prefix=prefix, timeout=10.0)
    admin = RedisClient(REDIS_TEST_URL, timeout=10.0)
    limits = [team(requests_per_minute=1)]
    try:
        await admin.execute(("SCRIPT", "FLUSH"))  # as after a Redis restart
        assert admitted(await limiter.admit(limits, NOW))
        refusal = await limiter.admit(limits, NOW)
        assert refusal is not None and refusal.used == 1
        assert limiter._down_until == 0.0  # answered by Redis, not failed open
    finally:
        await limiter.close()
        [keys] = await admin.execute(("KEYS", f"{prefix}:*"))
        if keys:
            await admin.execute(("DEL", *keys))
        await admin.close()


async def test_redis_down_fails_open_and_logs_once(caplog: Any) -> None:
    limiter = RedisLimiter("redis://127.0.0.1:1/0", prefix="llmgw:test:down", backoff_s=0)
    limits = [team(requests_per_minute=1)]
    with caplog.at_level(logging.WARNING, logger="apps.quotas.limiter"):
        for _ in range(3):
            assert admitted(await limiter.admit(limits, NOW))
        await limiter.record_tokens(limits, 10, NOW)
    assert len([r for r in caplog.records if "Redis failed" in r.getMessage()]) == 1
    await limiter.close()


async def test_after_a_redis_failure_redis_is_left_alone_for_a_while() -> None:
    limiter = RedisLimiter("redis://127.0.0.1:1/0", prefix="llmgw:test:down", backoff_s=60)
    calls = 0
    original = limiter._redis.execute

    async def counting(*commands: Any) -> Any:
        nonlocal calls
        calls += 1
        return await original(*commands)

    limiter._redis.execute = counting  # type: ignore[method-assign]
    for _ in range(5):
        assert admitted(await limiter.admit([team(requests_per_minute=1)], NOW))
    assert calls == 1
    await limiter.close()


def test_make_limiter_follows_the_redis_setting(settings: Any) -> None:
    from apps.quotas.limiter import make_limiter

    settings.REDIS_URL = ""
    assert isinstance(make_limiter(), MemoryLimiter)
    settings.REDIS_URL = REDIS_TEST_URL
    assert isinstance(make_limiter(), RedisLimiter)


def test_the_limiter_imports_no_models() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import apps.quotas.limiter; "
        "assert not [m for m in sys.modules if m.endswith('.models') or m == 'django.db.models'], "
        "sorted(m for m in sys.modules if 'models' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_month_window_is_right_in_any_order_of_asking() -> None:
    from datetime import UTC, datetime

    from apps.quotas.limiter import _month

    def at(*parts: int) -> float:
        return datetime(*parts, tzinfo=UTC).timestamp()

    cases = [
        (at(2026, 12, 31, 23, 59, 59), "M202612", at(2027, 1, 1)),
        (at(2027, 1, 1), "M202701", at(2027, 2, 1)),
        (at(2026, 2, 14, 12), "M202602", at(2026, 3, 1)),
        (at(2026, 12, 1), "M202612", at(2027, 1, 1)),
        (at(2026, 11, 30, 23, 59, 59), "M202611", at(2026, 12, 1)),
    ]
    for now, key, end in cases + cases[::-1]:
        assert _month(now) == (key, end)


async def test_an_admitted_request_is_told_what_is_left_of_its_tightest_limits(limiter: Any) -> None:
    """What the rate-limit headers say: the tightest request window and the tightest token window,
    the request itself counted."""
    key = Limit("key:1", "key k", requests_per_minute=10, tokens_per_minute=1000)
    org = Limit("org:1", "organisation o", requests_per_minute=3, tokens_per_day=500)
    left = await limiter.admit([key, org], NOW)
    assert isinstance(left, Headroom) and left.requests is not None
    assert (left.requests.allowed, left.requests.remaining) == (3, 2) and 0 < left.requests.reset_s <= 60
    assert left.tokens is not None and (left.tokens.allowed, left.tokens.remaining) == (500, 500)
    await limiter.record_tokens([key, org], 450, NOW)
    left = await limiter.admit([key, org], NOW)
    assert isinstance(left, Headroom) and left.tokens is not None and left.requests is not None
    assert (left.tokens.allowed, left.tokens.remaining) == (500, 50)  # the day's window is the tightest
    assert left.requests.remaining == 1
    assert isinstance(left.tokens, Window) and left.tokens.reset_s > 60
