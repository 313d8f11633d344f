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


#: `llmgw web|worker|beat` as far as the settings they load: each prints its database OPTIONS.
SHOW_DATABASE = """
import sys
from llmgw import cli
from llmgw.cli import serve

def show(args):
    from django.conf import settings
    print(sorted(settings.DATABASES["default"]["OPTIONS"]), settings.DATABASES["default"]["CONN_MAX_AGE"])
    return 0

serve.run_web = serve.run_worker = serve.run_beat = show
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    ("command", "options"),
    [
        (["web"], "['pool', 'sslmode'] 0"),
        (["worker", "--no-restart"], "['sslmode'] 0"),
        (["beat"], "['sslmode'] 0"),
    ],
)
def test_only_web_processes_keep_a_postgresql_pool(tmp_path, command: list[str], options: str) -> None:
    """Celery closes a prefork process's pool after every task, under the feet of the batch runner's
    thread in the same process: the worker and beat connect per thread instead."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "DJANGO_"))}
    environment.update(
        {
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "LLMGW_DATA_DIR": str(tmp_path),
            "LLMGW_DATABASE_URL": "postgres://llmgw@db.invalid:5432/llmgw?sslmode=require",
            "LLMGW_PROCESS": "web" if command[0] != "web" else "worker",  # the command's own word wins
        }
    )
    result = subprocess.run(
        [sys.executable, "-c", SHOW_DATABASE, *command],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == options


def test_an_unknown_process_kind_stops_startup_naming_it(tmp_path) -> None:
    result = run_check(tmp_path, LLMGW_PROCESS="scheduler")
    assert result.returncode != 0
    assert "LLMGW_PROCESS='scheduler': expected web, worker or beat" in result.stderr
