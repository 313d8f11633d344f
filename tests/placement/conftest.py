"""Placement tests need no database, cache or settings: the project-wide autouse fixtures are replaced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _plain_static_storage() -> None:
    return None


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    yield
