"""Placement tests need no database, cache or settings: the project-wide autouse fixtures are replaced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apps.cluster.placement import REGISTRY, builtin_registry


@pytest.fixture(autouse=True)
def _plain_static_storage() -> None:
    return None


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    yield


@pytest.fixture(autouse=True)
def _builtin_plugins_only() -> Iterator[None]:
    """These tests hold the built-in plugins to their contract: where Django is set up in the same
    run, the apps' plugins (fabrics) are on REGISTRY, so it holds only the built-ins meanwhile."""
    saved = dict(vars(REGISTRY))
    vars(REGISTRY).update(vars(builtin_registry()))
    yield
    vars(REGISTRY).clear()
    vars(REGISTRY).update(saved)
