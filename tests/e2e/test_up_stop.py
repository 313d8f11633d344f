"""Stopping `llmgw up` stops the engines its agent ran, unless --keep-engines leaves them for the next one."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.helpers import Running, alive, drop_pg_database, llmgw_up
from tests.enginebin import llama_server_path, missing_reason

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(llama_server_path() is None, reason=missing_reason())]


def declare_tiny_model(data_dir: Path) -> None:
    """A tiny model in server.yaml, which the worker applies when it starts."""
    from tests.ggufgen import make_tiny_gguf

    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    weights = make_tiny_gguf(data_dir / "models" / "tiny.gguf")
    (data_dir / "server.yaml").write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "tiny",
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 1,
                                "context_size": 512,
                            }
                        ],
                    }
                ]
            }
        )
    )


def engines(data_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((data_dir / "agent" / "engines.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


def wait_for_engine(up: Running, data_dir: Path, timeout: float = 120) -> dict[str, Any]:
    """The one engine in the agent's engines.json, once it runs and answers its health check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = list(engines(data_dir).values())
        if len(records) == 1 and alive(records[0]["pid"]) and healthy(records[0]["port"]):
            return records[0]  # type: ignore[no-any-return]
        assert up.process.poll() is None, "".join(up.lines)
        time.sleep(0.5)
    raise AssertionError(f"no engine became ready: {engines(data_dir)}\n" + "".join(up.lines[-60:]))


def stop(up: Running, sig: signal.Signals) -> str:
    up.process.send_signal(sig)
    assert up.process.wait(timeout=90) == 0, "".join(up.lines)
    deadline = time.monotonic() + 5  # the pump thread reads the last lines
    while time.monotonic() < deadline and not (up.lines and up.lines[-1].startswith("llmgw up: stopped\n")):
        time.sleep(0.1)
    return "".join(up.lines)


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry))
    return members


def test_up_stops_its_engines_and_keep_engines_leaves_them_for_the_next_up(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    declare_tiny_model(data_dir)
    env = {"LLMGW_LLAMA_SERVER": str(llama_server_path())}
    database = None
    engine: dict[str, Any] = {}
    try:
        # --keep-engines: SIGTERM stops llmgw up, and the engine goes on serving.
        with llmgw_up(tmp_path, "--keep-engines", data_dir=data_dir, keep_database=True, **env) as first:
            database = first.database
            first.wait_for_line(r"llmgw up: ready at ")
            engine = wait_for_engine(first, data_dir)
            out = stop(first, signal.SIGTERM)
        assert "llmgw up: left 1 engine running (--keep-engines); the next llmgw up adopts them" in out, out
        assert "stopped 1 engine" not in out
        assert alive(engine["pid"]) and healthy(engine["port"])
        assert [r["pid"] for r in engines(data_dir).values()] == [engine["pid"]]

        # The next llmgw up adopts it (same process), and Ctrl-C then stops it with everything else.
        with llmgw_up(tmp_path, data_dir=data_dir, database=database, keep_database=True, **env) as second:
            second.wait_for_line(rf"adopted shard \S+ \(pid {engine['pid']}\)")
            second.wait_for_line(r"shard \S+: ready")
            assert wait_for_engine(second, data_dir)["pid"] == engine["pid"]
            out = stop(second, signal.SIGINT)
        assert "llmgw up: stopped 1 engine\n" in out, out
        assert not alive(engine["pid"])
        assert group_members(engine["pgid"]) == []
        assert engines(data_dir) == {}
        assert "Traceback" not in out and "ERROR" not in out, out
    finally:
        if engine and alive(engine["pid"]):
            os.killpg(engine["pgid"], signal.SIGKILL)
        if database:
            drop_pg_database(database)
