"""Locating the real-output fixtures for the agent probe tests.

Most live outside the repository: ``$LLMGW_FIXTURES_DIR`` if set, else
``<repo root>/../shared/fixtures``. Output we captured ourselves on real machines lives in
``tests/agent/captured/`` under the same folder names (its SOURCES.md says where and when).
Parametrised tests glob a fixture folder in both places at collection time, so a file dropped
into either is tested without code changes; when neither has the folder they collect a single
skipped case that says why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def fixtures_root() -> Path:
    env = os.environ.get("LLMGW_FIXTURES_DIR")
    if env:
        return Path(env)
    return REPO_ROOT.parent / "shared" / "fixtures"


CAPTURED = Path(__file__).resolve().parent / "captured"


def fixture_files(folder: str, pattern: str = "*") -> list:
    """``pytest.param(path, id=name)`` for every file of ``folder`` matching ``pattern`` in the
    shared fixtures and in our own captures (``SOURCES.md`` and other notes excluded), or one
    skipped param when neither has a matching file."""
    directories = [d for d in (fixtures_root() / folder, CAPTURED / folder) if d.is_dir()]
    if not directories:
        return [
            pytest.param(
                None,
                id=f"{folder}-missing",
                marks=pytest.mark.skip(
                    reason=f"fixtures folder {fixtures_root() / folder} not found (set LLMGW_FIXTURES_DIR)"
                ),
            )
        ]
    files = sorted(
        (p for d in directories for p in d.glob(pattern) if p.is_file() and p.name not in ("SOURCES.md", "README.md")),
        key=lambda p: p.name,
    )
    if not files:
        return [
            pytest.param(
                None, id=f"{folder}-empty", marks=pytest.mark.skip(reason=f"no files in {folder} match {pattern}")
            )
        ]
    return [pytest.param(p, id=p.name) for p in files]


def read_text(path: Path) -> str:
    """The file's text exactly as stored: CRLF and a BOM are kept for the parsers to handle."""
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        return handle.read()


def fixture_text(folder: str, name: str) -> str:
    """Text of one named fixture (shared, else captured); skips the calling test when it is not there."""
    path = fixtures_root() / folder / name
    if not path.is_file() and (CAPTURED / folder / name).is_file():
        path = CAPTURED / folder / name
    if not path.is_file():
        pytest.skip(f"fixture {path} not found (set LLMGW_FIXTURES_DIR)")
    return read_text(path)
