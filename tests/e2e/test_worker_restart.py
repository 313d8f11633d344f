"""`llmgw worker` starts its Celery worker again when it stops on its own, and stops with it on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, alive, descendants, free_port, llmgw_env

pytestmark = pytest.mark.e2e


def _worker_children(parent: int) -> list[int]:
    found = []
    for pid in descendants(parent):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--no-restart" in command:
            found.append(pid)
    return sorted(found)


def _wait(check, what: str, timeout: float = 120) -> object:  # noqa: ANN001 - a small local helper
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def test_a_worker_that_dies_is_started_again_and_sigterm_stops_both(tmp_path: Path) -> None:
    env = llmgw_env(tmp_path / "data", free_port())
    env.pop("LLMGW_REDIS_URL", None)
    subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, cwd=REPO, check=True, timeout=300
    )
    log = (tmp_path / "worker.log").open("wb")
    parent = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "worker", "--concurrency", "1"],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        first = _wait(lambda: _worker_children(parent.pid), "the Celery worker")[0]  # type: ignore[index]
        os.kill(first, signal.SIGKILL)  # as the kernel's OOM killer, or a worker giving up, would end it
        second = _wait(lambda: [p for p in _worker_children(parent.pid) if p != first], "a new worker")[0]  # type: ignore[index]
        assert parent.poll() is None and alive(second)
        assert "starting it again" in (tmp_path / "worker.log").read_text(errors="replace")
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=60) == 0
        _wait(lambda: not alive(second), "the worker to stop with its parent", timeout=30)
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait(timeout=30)
