"""A limit changed in the tables is the limit the next request meets.

The limiters keep what they make of a key's limits (checks, counter names) between requests.
These tests change a limit through the API, let the gateway's table refresh load it, and ask
the limiter again in the same minute: nothing kept from before the change may answer for it.
What was counted before the change still counts after it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from django.conf import settings

from apps.accounts.models import ApiKey, User
from apps.quotas.limiter import Headroom, Limit, MemoryLimiter, RedisLimiter, Refusal
from tests.quotas.conftest import Tree, make_key

# Every request of a test falls in this one minute, day and month.
NOW = datetime(2026, 10, 3, 12, 0, 30, tzinfo=UTC).timestamp()


@dataclass
class Gateway:
    """A limiter, and the limits of a key as the gateway's table refresh loads them."""

    limiter: MemoryLimiter | RedisLimiter
    loop: asyncio.AbstractEventLoop

    def run(self, work: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(work)

    def limits(self, key: ApiKey) -> list[Limit]:
        from apps.gateway.tables import load_tables

        return list(load_tables().keys[key.key_hash].limits)

    def admit(self, key: ApiKey) -> Refusal | Headroom | None:
        """One request of the key, against its limits as the tables hold them now."""
        return self.run(self.limiter.admit(self.limits(key), NOW))

    def record(self, key: ApiKey, tokens: int) -> None:
        self.run(self.limiter.record_tokens(self.limits(key), tokens, NOW))


@pytest.fixture(params=["memory", "redis"])
def gateway(request: Any, db: Any) -> Iterator[Gateway]:
    loop = asyncio.new_event_loop()
    limiter: MemoryLimiter | RedisLimiter
    if request.param == "memory":
        limiter = MemoryLimiter()
    elif not settings.REDIS_URL:
        loop.close()
        pytest.skip("no LLMGW_REDIS_URL")
    else:
        # Tokens written at once (flush_s=0), under a prefix of this test's own.
        limiter = RedisLimiter(settings.REDIS_URL, prefix=f"llmgw:test:{uuid.uuid4().hex[:12]}", flush_s=0)
    yield Gateway(limiter, loop)
    if isinstance(limiter, RedisLimiter):
        _forget(limiter.prefix)
    loop.run_until_complete(limiter.close())
    loop.close()


def _forget(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(settings.REDIS_URL)
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def set_limit(api: Any, **fields: Any) -> int:
    response = api.post("/api/v1/limits", fields, format="json")
    assert response.status_code == 201, response.content
    return int(response.json()["id"])


def change_limit(api: Any, limit_id: int, **fields: Any) -> None:
    response = api.patch(f"/api/v1/limits/{limit_id}", fields, format="json")
    assert response.status_code == 200, response.content


@pytest.fixture
def admin_api(api: Any, alice: User) -> Any:
    api.force_authenticate(alice)
    return api


def test_a_lowered_request_limit_refuses_the_next_request(gateway: Gateway, admin_api: Any, bob: User) -> None:
    key = make_key(bob)
    limit_id = set_limit(admin_api, api_key=key.pk, requests_per_minute=5)
    for remaining in (4, 3):
        left = gateway.admit(key)
        assert isinstance(left, Headroom) and left.requests is not None
        assert (left.requests.allowed, left.requests.remaining) == (5, remaining)
    change_limit(admin_api, limit_id, requests_per_minute=2)
    refusal = gateway.admit(key)
    assert isinstance(refusal, Refusal)
    assert (refusal.limit, refusal.used, refusal.allowed, refusal.retry_after_s) == ("requests per minute", 2, 2, 30)
    assert "limit of 2 requests per minute (2 used)" in refusal.message


def test_a_raised_request_limit_admits_again_with_what_is_left(gateway: Gateway, admin_api: Any, bob: User) -> None:
    key = make_key(bob)
    limit_id = set_limit(admin_api, api_key=key.pk, requests_per_minute=1)
    assert isinstance(gateway.admit(key), Headroom)
    assert isinstance(gateway.admit(key), Refusal)
    change_limit(admin_api, limit_id, requests_per_minute=3)
    left = gateway.admit(key)
    assert isinstance(left, Headroom) and left.requests is not None
    assert (left.requests.allowed, left.requests.remaining) == (3, 1)


def test_a_lowered_token_limit_refuses_with_the_tokens_already_used(
    gateway: Gateway, admin_api: Any, bob: User, tree: Tree
) -> None:
    key = make_key(bob, tree.project)
    limit_id = set_limit(admin_api, team=tree.team.pk, tokens_per_minute=1000)
    assert isinstance(gateway.admit(key), Headroom)
    gateway.record(key, 600)
    left = gateway.admit(key)
    assert isinstance(left, Headroom) and left.tokens is not None
    assert (left.tokens.allowed, left.tokens.remaining) == (1000, 400)
    change_limit(admin_api, limit_id, tokens_per_minute=500)
    refusal = gateway.admit(key)
    assert isinstance(refusal, Refusal)
    assert (refusal.limit, refusal.scope, refusal.used, refusal.allowed) == (
        "tokens per minute",
        f"team:{tree.team.pk}",
        600,
        500,
    )


def test_a_limit_of_another_kind_added_to_a_scope_is_checked_at_once(
    gateway: Gateway, admin_api: Any, bob: User, tree: Tree
) -> None:
    key = make_key(bob, tree.project)
    limit_id = set_limit(admin_api, project=tree.project.pk, requests_per_minute=100, tokens_per_minute=10_000)
    gateway.record(key, 300)  # counted in the day's and the month's windows too, which no limit governs yet
    left = gateway.admit(key)
    assert isinstance(left, Headroom) and left.tokens is not None
    assert (left.tokens.allowed, left.tokens.remaining) == (10_000, 9_700)
    change_limit(admin_api, limit_id, tokens_per_day=200)
    refusal = gateway.admit(key)
    assert isinstance(refusal, Refusal)
    assert (refusal.limit, refusal.used, refusal.allowed) == ("tokens per day", 300, 200)


def test_a_removed_limit_governs_nothing_and_a_new_one_governs_the_next_request(
    gateway: Gateway, admin_api: Any, bob: User, tree: Tree
) -> None:
    key = make_key(bob, tree.project)
    limit_id = set_limit(admin_api, organization=tree.org.pk, requests_per_minute=1)
    assert isinstance(gateway.admit(key), Headroom)
    assert isinstance(gateway.admit(key), Refusal)
    assert admin_api.delete(f"/api/v1/limits/{limit_id}").status_code == 204
    assert gateway.admit(key) is None
    set_limit(admin_api, api_key=key.pk, requests_per_minute=1)
    assert isinstance(gateway.admit(key), Headroom)
    refusal = gateway.admit(key)
    assert isinstance(refusal, Refusal) and refusal.scope == f"key:{key.pk}"


def test_a_renamed_scope_is_named_in_the_next_refusal(gateway: Gateway, admin_api: Any, bob: User, tree: Tree) -> None:
    key = make_key(bob, tree.project)
    set_limit(admin_api, team=tree.team.pk, requests_per_minute=1)
    assert isinstance(gateway.admit(key), Headroom)
    refusal = gateway.admit(key)
    assert isinstance(refusal, Refusal) and refusal.label == "team Vision"
    tree.team.name = "Perception"
    tree.team.save(update_fields=["name"])
    refusal = gateway.admit(key)
    assert isinstance(refusal, Refusal) and refusal.label == "team Perception"
