"""The gateway tests' fixtures: `engine`, a scriptable mock engine, and `gw`, the gateway in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.gateway.harness import Gateway, engine_fixture, gateway_fixture
from tests.gateway.mock_engine import MockEngine


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async for mock in engine_fixture():
        yield mock


@pytest.fixture
async def gw(engine: MockEngine, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    async for gateway in gateway_fixture(engine, monkeypatch):
        yield gateway
