"""The batches' tests: `engine` (a mock engine) and `world` (the gateway, the batches' API and a
runner in front of it, on the test's database)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.batches.harness import World, world_fixture
from tests.gateway.harness import engine_fixture
from tests.gateway.mock_engine import MockEngine


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    async for mock in engine_fixture():
        yield mock


@pytest.fixture
async def world(
    transactional_db: Any, engine: MockEngine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> AsyncIterator[World]:
    async for made in world_fixture(engine, monkeypatch, tmp_path):
        yield made
