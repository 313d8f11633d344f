"""Shared fixtures for the agent probe tests (pure parsers; no Django needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, fixtures_root, read_text

__all__ = ["fixture_files", "fixture_text", "read_text"]


@pytest.fixture
def fixtures_dir() -> Path:
    """The shared fixtures folder; skips the test when it is absent."""
    root = fixtures_root()
    if not root.is_dir():
        pytest.skip(f"fixtures folder {root} not found (set LLMGW_FIXTURES_DIR)")
    return root
