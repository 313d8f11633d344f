"""`llmgw web` started on its own, before any worker, on the SQLite default."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, free_port, llmgw_env

pytestmark = pytest.mark.e2e


def test_a_web_process_without_a_worker_can_queue_tasks_on_the_filesystem_broker(tmp_path: Path) -> None:
    port = free_port()
    env = llmgw_env(tmp_path / "data", port)
    env.pop("LLMGW_REDIS_URL", None)  # the filesystem transport is what is under test
    subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, cwd=REPO, check=True, timeout=300
    )
    web = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "web"], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert web.poll() is None, "llmgw web exited"
            time.sleep(0.1)
        else:
            pytest.fail("llmgw web did not answer /healthz")
        # Before anything asked for readiness (which makes a folder of its own): the web
        # process made the queue's folders itself, so its first task does not fail.
        queue = tmp_path / "data" / "queue"
        assert (queue / "messages").is_dir() and (queue / "control").is_dir()
    finally:
        web.terminate()
        web.wait(timeout=30)


def test_several_web_workers_without_redis_refuse_to_start_and_say_why(tmp_path: Path) -> None:
    env = llmgw_env(tmp_path / "data", free_port())
    env.pop("LLMGW_REDIS_URL", None)
    started = subprocess.run(
        [sys.executable, "-m", "llmgw", "web", "--workers", "2"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert "cannot start 2 workers without Redis" in started.stderr
    assert "LLMGW_REDIS_URL" in started.stderr
