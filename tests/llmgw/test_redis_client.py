"""The process's Redis clients: one per URL and timeout, none without Redis. No Redis server is
needed: a client connects at its first command, and nothing here sends one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llmgw import redis_client


@pytest.fixture(autouse=True)
def _forget_clients() -> Iterator[None]:
    redis_client.reset()
    yield
    redis_client.reset()


def test_without_redis_there_is_no_client(settings: Any) -> None:
    settings.REDIS_URL = ""
    assert redis_client.client() is None
    with pytest.raises(ValueError, match="LLMGW_REDIS_URL"):
        redis_client.fresh()


def test_the_client_for_a_timeout_is_made_once_and_kept(settings: Any) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/3"
    first = redis_client.client()
    assert first is not None and redis_client.client(1.0) is first
    kwargs = first.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 1.0 and kwargs["socket_connect_timeout"] == 1.0 and kwargs["db"] == 3
    slower = redis_client.client(timeout=2.0)
    assert slower is not None and slower is not first
    assert slower.connection_pool.connection_kwargs["socket_timeout"] == 2.0


def test_a_changed_url_or_a_reset_gives_a_new_client(settings: Any) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/3"
    first = redis_client.client()
    settings.REDIS_URL = "redis://127.0.0.1:1/4"
    other = redis_client.client()
    assert other is not None and other is not first and other.connection_pool.connection_kwargs["db"] == 4
    redis_client.reset()
    assert redis_client.client() is not other


def test_a_fresh_client_is_shared_with_nobody(settings: Any) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/3"
    fresh = redis_client.fresh(timeout=2.0)
    assert fresh is not redis_client.client(2.0) and fresh is not redis_client.fresh(timeout=2.0)
    fresh.close()
