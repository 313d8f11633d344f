"""Each engine's version, read from its `--version` once per binary and sent at registration."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from agent import main as agent_main
from agent import protocol
from agent.config import AgentConfig
from agent.main import Agent, engine_version, parse_engine_version
from tests import enginebin

LLAMA_SERVER = enginebin.llama_server_path()


@pytest.fixture(autouse=True)
def fresh_cache() -> None:
    agent_main._versions.clear()


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def counting(tmp_path: Path, output: str) -> tuple[str, Path]:
    """An engine whose --version prints `output` (to stderr, as llama.cpp does) and counts its runs."""
    runs = tmp_path / "runs"
    return script(tmp_path / "llama-server", f"echo run >> {runs}\nprintf '{output}' >&2\n"), runs


def test_parses_llama_cpp_and_bare_versions() -> None:
    text = "version: 6500 (abc1234)\nbuilt with cc (GCC) 12.2.0 for x86_64-linux-gnu\n"
    assert parse_engine_version(text) == "6500 (abc1234)"
    assert (
        parse_engine_version("ggml_cuda_init: found 1 CUDA devices\nversion: 0.5.0-dev (build 1, commit 0c1e570)\n")
        == "0.5.0-dev (build 1, commit 0c1e570)"
    )
    assert (
        parse_engine_version("INFO 10-01 12:00:00 __init__.py:207 Automatically detected platform cuda.\n0.6.3.post1\n")
        == "0.6.3.post1"
    )
    assert parse_engine_version("") is None
    assert parse_engine_version("usage: llama-server [options]\nerror: unknown argument\n") is None


def test_reads_the_version_once_per_binary_and_again_when_it_changes(tmp_path: Path) -> None:
    binary, runs = counting(tmp_path, "version: 6500 (abc1234)\\nbuilt with GNU 12.2.0 for Linux x86_64\\n")
    assert engine_version(binary) == "6500 (abc1234)"
    assert engine_version(binary) == "6500 (abc1234)"
    assert runs.read_text().count("run") == 1
    # A new build in the same place (another modification time) is read again.
    stat = os.stat(binary)
    os.utime(binary, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert engine_version(binary) == "6500 (abc1234)"
    assert runs.read_text().count("run") == 2


def test_an_unreadable_version_is_null_not_zero(tmp_path: Path) -> None:
    assert engine_version(script(tmp_path / "silent", "exit 1\n")) is None
    assert engine_version(script(tmp_path / "chatty", "echo 'something went wrong'\nexit 3\n")) is None
    assert engine_version(str(tmp_path / "absent")) is None
    hung = script(tmp_path / "hung", "sleep 60\n")
    assert engine_version(hung, timeout=0.5) is None
    assert engine_version(hung, timeout=0.5) is None  # remembered: not waited for at every reconnect


@pytest.mark.skipif(LLAMA_SERVER is None, reason=enginebin.missing_reason())
def test_the_real_llama_server_says_its_version() -> None:
    version = engine_version(str(LLAMA_SERVER))
    assert version and version != "0"


def test_the_register_schema_takes_engine_versions() -> None:
    def register(versions: Any) -> str:
        return protocol.encode(
            "register",
            {"agent_version": "0.1.0", "hardware": {"engines": ["llama.cpp", "vllm"], "engine_versions": versions}},
        )

    message = protocol.parse_message(register({"llama.cpp": "6500 (abc1234)", "vllm": None}), expect="agent")
    assert message.body["hardware"]["engine_versions"] == {"llama.cpp": "6500 (abc1234)", "vllm": None}
    with pytest.raises(protocol.ProtocolError, match="engine_versions"):
        protocol.parse_message(register({"llama.cpp": 6500}), expect="agent")
    with pytest.raises(protocol.ProtocolError, match="engine_versions"):
        protocol.parse_message(register(["6500"]), expect="agent")


class _NoFabrics:
    def snapshot(self) -> None:
        return None

    def due(self) -> None:
        return None


class _StillSampler:
    fabrics = _NoFabrics()

    async def hardware(self) -> tuple[dict[str, Any], list[str]]:
        return {"hostname": "test"}, []

    async def sample(self, force: bool = False) -> dict[str, Any]:
        return {}


async def test_the_agent_registers_with_each_engines_version(tmp_path: Path) -> None:
    from websockets.asyncio.server import serve

    llama, runs = counting(tmp_path, "version: 6500 (abc1234)\\n")
    broken = script(tmp_path / "vllm", "exit 1\n")
    received: list[str] = []

    async def handler(ws: Any) -> None:
        received.append(await ws.recv())
        await ws.send(protocol.encode("registered", {"node": "test", "heartbeat_interval": 10}))
        await ws.close()

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        config = AgentConfig(
            server=f"http://127.0.0.1:{port}",
            state_dir=tmp_path / "state",
            engines={"llama.cpp": llama, "vllm": broken, "sglang": str(tmp_path / "none")},
        )
        agent = Agent(config, sampler=_StillSampler())  # type: ignore[arg-type]
        for _ in range(2):  # a reconnect registers again, without running --version again
            assert await asyncio.wait_for(agent.session("credential"), 30)
        await agent.supervisor.close()

    assert len(received) == 2
    for raw in received:
        body = protocol.parse_message(raw, expect="agent").body
        assert body["hardware"]["engines"] == ["llama.cpp", "vllm"]
        assert body["hardware"]["engine_versions"] == {"llama.cpp": "6500 (abc1234)", "vllm": None}
        assert json.loads(raw)["hardware"]["engine_versions"]["vllm"] is None
    assert runs.read_text().count("run") == 1
