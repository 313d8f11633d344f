"""A bad environment stops start-up with the variable's name, before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_check(tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    environment.update({"LLMGW_DATA_DIR": str(tmp_path), **env})
    return subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "check"],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("LLMGW_DEBUG", "maybe", "LLMGW_DEBUG='maybe': expected a boolean"),
        ("LLMGW_LISTEN", "localhost", "LLMGW_LISTEN='localhost': expected host:port"),
        ("LLMGW_DATABASE_URL", "oracle://x/y", "LLMGW_DATABASE_URL='oracle://x/y': expected a URL"),
        ("LLMGW_REDIS_URL", "localhost:6379", "LLMGW_REDIS_URL='localhost:6379': expected a URL"),
    ],
)
def test_a_malformed_variable_stops_startup_naming_it(tmp_path, variable: str, value: str, expected: str) -> None:
    result = run_check(tmp_path, **{variable: value})
    assert result.returncode != 0
    assert expected in result.stderr


def test_the_defaults_start(tmp_path) -> None:
    result = run_check(tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "secret_key").exists()
