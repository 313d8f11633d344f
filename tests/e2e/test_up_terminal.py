"""What `llmgw up` shows on its terminal, and what it writes only to its log file."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from llmgw.cli.up import NO_ENGINE, LineFilter, Output, no_engine_line
from tests.e2e.helpers import llmgw_up
from tests.enginebin import llama_server_path

QUIET_LINES = 30  # generous: a quiet `llmgw up` shows about five


@pytest.mark.e2e
def test_up_shows_the_address_and_password_and_keeps_the_rest_in_its_log(tmp_path: Path) -> None:
    engine = llama_server_path()
    env = {"LLMGW_LLAMA_SERVER": str(engine)} if engine else {}
    with llmgw_up(tmp_path, **env) as up:
        log_line = up.wait_for_line(r"^llmgw up: the full output of every process goes to (\S+)$")
        password = up.wait_for_line(r"created the first administrator (\S+) with password (\S+)")
        up.wait_for_line(r"llmgw up: ready at ")
        time.sleep(15)  # three rounds of the scheduler's tasks, which the terminal does not show
        quiet = list(up.lines)
        up.process.send_signal(signal.SIGINT)
        assert up.process.wait(timeout=90) == 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and up.lines[-1] != "llmgw up: stopped\n":
            time.sleep(0.1)
    out = "".join(up.lines)

    assert len(quiet) < QUIET_LINES, out
    assert "celery" not in out.lower() and "SecurityWarning" not in out, out
    assert "ERROR" not in out and "Traceback" not in out, out
    # The password comes at the end of start-up, after the address, and only once.
    lines = [line.rstrip("\n") for line in up.lines]
    ready = next(i for i, line in enumerate(lines) if line.startswith("llmgw up: ready at "))
    shown = next(i for i, line in enumerate(lines) if "with password" in line)
    assert ready < shown
    assert lines[shown + 1] == "llmgw up: this password is shown only once; only its hash is kept."
    assert sum(password.group(2) in line for line in lines) == 1
    assert lines[-2:] == ["llmgw up: stopping", "llmgw up: stopped"], out

    log = Path(log_line.group(1))
    assert log == Path(up.env["LLMGW_DATA_DIR"]) / "logs" / "up.log"
    text = log.read_text()
    assert re.search(r"^worker \| .*celery@\S+ ready", text, re.MULTILINE), text[-3000:]
    assert re.search(r"^worker \| .*Scheduler: Sending due task", text, re.MULTILINE)
    assert re.search(r"^web    \| .*GET /healthz", text, re.MULTILINE)
    assert re.search(r"^agent  \| .*registered as node", text, re.MULTILINE)
    assert password.group(2) not in text
    assert "ERROR" not in text and "Traceback" not in text, text[-3000:]


def test_the_terminal_shows_warnings_errors_and_changes_and_hides_routine_lines() -> None:
    def shown(*lines: str) -> list[str]:
        keep = LineFilter()
        return [line for line in lines if keep.shown(line)]

    routine = [
        "INFO:     Uvicorn running on http://127.0.0.1:8000 (Press CTRL+C to quit)",
        "2026-12-01 12:31:26,764 INFO celery.beat: Scheduler: Sending due task reconcile (apps.cluster.tasks.x)",
        " -------------- celery@vm v5.7.0 (collider)",
        "2026-12-01 12:31:21,440 INFO llmgw.agent: registered as node vm; heartbeat every 10 s",
        "/venv/lib/python3.12/site-packages/celery/platforms.py:893: SecurityWarning: You're running the worker "
        "with superuser privileges: this is",
        "absolutely not recommended!",
        "2026-12-01 12:31:21,715 WARNING kombu.connection: No hostname was supplied. Reverting to default 'localhost'",
        "2026-12-03 14:52:41,921 WARNING kombu.transport.virtual.base: Requeuing undeliverable message for queue "
        "'celery': No consumers.",
    ]
    assert shown(*routine) == []
    needed = [
        "2026-12-01 12:31:20,523 WARNING llmgw.agent: connection to ws://127.0.0.1:8000/ws/agent/ failed",
        "[2026-12-01 12:31:56,368: ERROR/MainProcess] Process 'ForkPoolWorker-2' pid:31491 exited",
        "ERROR:    Exception in ASGI application",
        "llmgw worker: it stopped (exit code 1); starting it again in 1 s",
        "2026-12-01 12:38:37,451 INFO llmgw.agent.supervisor: shard r1s0: failed (the engine exited with code 1)",
        "/app/x.py:3: RuntimeWarning: coroutine 'f' was never awaited",
    ]
    assert shown(*needed) == needed
    # A traceback: its exception is shown, not its frames.
    assert shown(
        "2026-12-01 12:00:00,000 ERROR llmgw.agent: handling desired failed",
        "Traceback (most recent call last):",
        '  File "agent/main.py", line 3, in handle',
        "    x()",
        "ValueError: no such shard",
        "INFO next",
    ) == ["2026-12-01 12:00:00,000 ERROR llmgw.agent: handling desired failed", "ValueError: no such shard"]


def test_every_line_goes_to_the_log_and_only_needed_ones_to_the_terminal(tmp_path: Path) -> None:
    import io

    terminal, errors = io.StringIO(), io.StringIO()
    output = Output(tmp_path / "logs" / "up.log", terminal, errors)
    output.child("worker", "2026-12-01 12:31:26,764 INFO celery.beat: Scheduler: Sending due task reconcile")
    output.child("agent", "2026-12-01 12:31:20,523 WARNING llmgw.agent: connection failed")
    output.say("llmgw up: created the first administrator a@b with password secret", log=False)
    output.say("llmgw up: web exited with code 1; stopping the rest", error=True)
    output.close()
    assert terminal.getvalue() == (
        "agent  | 2026-12-01 12:31:20,523 WARNING llmgw.agent: connection failed\n"
        "llmgw up: created the first administrator a@b with password secret\n"
    )
    assert errors.getvalue() == "llmgw up: web exited with code 1; stopping the rest\n"
    log = (tmp_path / "logs" / "up.log").read_text()
    assert "worker | 2026-12-01 12:31:26,764 INFO celery.beat: Scheduler" in log
    assert "agent  | 2026-12-01 12:31:20,523 WARNING" in log
    assert "up     | llmgw up: web exited with code 1" in log
    assert "secret" not in log
    assert output.tail("worker") == ["2026-12-01 12:31:26,764 INFO celery.beat: Scheduler: Sending due task reconcile"]


def test_without_an_engine_up_says_how_to_get_one(tmp_path: Path) -> None:
    line = no_engine_line(None, None)
    assert line == NO_ENGINE
    assert line.startswith("llmgw up: this machine has no llama.cpp engine, so models will stay pending until")
    for way in ("LLMGW_LLAMA_SERVER=/path/to/llama-server", "llama-server on PATH", "scripts/ensure-llama-server"):
        assert way in line
    assert no_engine_line(None, "/nowhere/llama-server") == (
        NO_ENGINE + " (LLMGW_LLAMA_SERVER=/nowhere/llama-server is not an executable file)"
    )
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert no_engine_line(str(binary), str(binary)) is None
    assert no_engine_line(str(binary), None) is None
    assert no_engine_line(str(binary), "/nowhere/llama-server") == (
        f"llmgw up: LLMGW_LLAMA_SERVER=/nowhere/llama-server is not an executable file; using {binary}"
    )
