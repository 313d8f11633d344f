"""The engine supervisor against real processes: the real llama-server on a tiny GGUF (skipped when no
binary is found, see tests/enginebin.py), and small shell scripts standing in for engines that never
answer, ignore SIGTERM or cannot start."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent import protocol
from agent.engines import ShardSpec, parse_shard, spec_fingerprint
from agent.supervisor import FAILED, READY, STARTING, STOPPED, Supervisor, read_proc_stat
from tests import enginebin

LLAMA_SERVER = enginebin.llama_server_path()
needs_llama_server = pytest.mark.skipif(LLAMA_SERVER is None, reason=enginebin.missing_reason())
SECRET = "sk-test-shard-secret"
# Longer than the supervisor takes to see an idle engine twice (two reads, DRAIN_POLL_S apart).
DRAIN_SETTLE_CHECK_S = 2.0


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("gguf", reason="the gguf package (dev extra) writes the tiny test model")
    from tests.ggufgen import make_tiny_gguf

    path = make_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")
    assert path.stat().st_size < 1024 * 1024
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_spec(source: Path | str, **overrides: Any) -> ShardSpec:
    item: dict[str, Any] = {
        "shard": "tiny-r1-s0",
        "model": "tiny",
        "engine": "llama.cpp",
        "source": str(source),
        "cpu_cores": 1,
        "parallel": 2,
        "context_size": 256,
        "api_key": SECRET,
        "port": free_port(),
    }
    item.update(overrides)
    return parse_shard(item)


def supervisor(state_dir: Path, binary: Path | str | None = LLAMA_SERVER, **kwargs: Any) -> Supervisor:
    engines = {"llama.cpp": str(binary)} if binary is not None else {}
    kwargs.setdefault("ready_timeout", 30)
    kwargs.setdefault("stop_grace", 5)
    kwargs.setdefault("poll_interval", 0.05)
    return Supervisor(state_dir, engines, **kwargs)


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http(method: str, url: str, body: Any = None, key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with _NO_PROXY.open(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else None


async def chat(endpoint: str, key: str | None) -> tuple[int, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    return await asyncio.to_thread(http, "POST", endpoint + "/v1/chat/completions", body, key)


async def until(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def group_members(pgid: int) -> list[int]:
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = read_proc_stat(int(name))
            if stat is not None and stat.pgrp == pgid and not stat.dead:
                members.append(stat.pid)
    return members


def alive(pid: int) -> bool:
    stat = read_proc_stat(pid)
    return stat is not None and not stat.dead


def records(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "engines.json").read_text())


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


# --------------------------------------------------------------------------- the real llama-server


@needs_llama_server
async def test_ready_auth_adoption_and_stop(tmp_path: Path, tiny_model: Path) -> None:
    state_dir = tmp_path / "state"
    spec = make_spec(tiny_model)
    changes: list[int] = []
    sup = supervisor(state_dir, on_change=lambda: changes.append(1))
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == READY, state
    pid = state["pid"]
    assert pid and alive(pid)
    assert state["endpoint"] == f"http://127.0.0.1:{spec.port}"
    assert state["exit_code"] is None and state["log_tail"] is None
    # what one request may hold, as the engine itself says (its slot's share of --ctx-size)
    assert state["context_tokens"] == spec.context_size
    assert changes, "on_change is called on state changes"

    # engines.json: what a restarted agent needs to find the process again, readable by the agent only
    record = records(state_dir)[spec.shard]
    stat = read_proc_stat(pid)
    assert stat is not None
    assert record["pid"] == pid and record["pgid"] == pid == stat.pgrp
    assert record["start_ticks"] == stat.start_ticks
    assert record["port"] == spec.port
    assert record["fingerprint"] == spec_fingerprint(spec)
    assert parse_shard(record["spec"]) == spec
    assert record["started_at"] > 0
    assert (state_dir / "engines.json").stat().st_mode & 0o077 == 0
    assert (state_dir / "logs" / f"{spec.shard}.log").stat().st_size > 0
    assert SECRET not in (state_dir / "logs" / f"{spec.shard}.log").read_text()
    assert SECRET not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")

    # the engine answers with the shard's key only
    endpoint = state["endpoint"]
    status, answer = await chat(endpoint, SECRET)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] > 0 and answer["usage"]["completion_tokens"] > 0
    assert answer["model"] == "tiny"
    assert (await chat(endpoint, None))[0] == 401
    assert (await chat(endpoint, "sk-wrong"))[0] == 401

    assert pid in sup.managed_pids()
    usage = sup.process_usage()
    assert [u["shard"] for u in usage] == [spec.shard]
    assert usage[0]["memory_bytes"] > 0 and usage[0]["processes"] >= 1
    assert "cpu_cores" not in usage[0], "no rate before a second sample"
    await asyncio.sleep(0.05)
    usage = sup.process_usage()
    assert usage[0]["cpu_cores"] >= 0
    # both fit the protocol: states() in a report, process_usage() in a heartbeat sample
    protocol.parse_message(protocol.encode("report", {"shards": sup.states()}), expect="agent")
    protocol.parse_message(protocol.encode("heartbeat", {"sample": {"shards": usage}}), expect="agent")

    # the agent exits; its engines do not
    await sup.close()
    assert alive(pid)

    # a new agent adopts the running engine without restarting it
    sup2 = supervisor(state_dir)
    adopted = sup2.state(spec.shard)
    assert adopted is not None and adopted["state"] == STARTING and adopted["pid"] == pid
    await sup2.converge([spec])
    assert await sup2.wait_settled(10)
    state = sup2.state(spec.shard)
    assert state is not None and state["state"] == READY and state["pid"] == pid, state
    assert records(state_dir)[spec.shard]["start_ticks"] == record["start_ticks"]
    assert (await chat(endpoint, SECRET))[0] == 200
    assert pid in sup2.managed_pids()

    # a change that needs no restart keeps the process; converge([]) stops the whole group
    renamed = parse_shard({**spec.to_dict(), "model": "tiny-renamed", "memory_bytes": 1 << 20})
    await sup2.converge([renamed])
    assert sup2.state(spec.shard)["pid"] == pid  # type: ignore[index]
    await sup2.converge([])
    state = sup2.state(spec.shard)
    assert state is not None and state["state"] == STOPPED and state["pid"] is None
    assert group_members(pid) == []
    assert records(state_dir) == {}
    assert sup2.managed_pids() == set()
    await sup2.converge([])
    assert sup2.states() == [], "a stopped shard is reported once, then forgotten"
    await sup2.close()


@needs_llama_server
async def test_missing_model_file_fails_with_exit_code_and_log(tmp_path: Path) -> None:
    sup = supervisor(tmp_path / "state")
    spec = make_spec(tmp_path / "no-such-model.gguf")
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == FAILED, state
    assert state["exit_code"] not in (None, 0)
    assert state["log_tail"] and len(state["log_tail"]) <= 50
    assert any("no-such-model.gguf" in line for line in state["log_tail"]), state["log_tail"]
    assert "exited with code" in state["message"] and "before it was ready" in state["message"]
    protocol.parse_message(protocol.encode("report", {"shards": sup.states()}), expect="agent")
    assert records(tmp_path / "state") == {}
    await sup.close()


@needs_llama_server
async def test_death_is_reported_and_the_next_converge_starts_it_again(tmp_path: Path, tiny_model: Path) -> None:
    sup = supervisor(tmp_path / "state")
    spec = make_spec(tiny_model)
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    pid = sup.state(spec.shard)["pid"]  # type: ignore[index]
    os.kill(pid, signal.SIGKILL)
    await until(lambda: sup.state(spec.shard)["state"] == FAILED, what="the death to be noticed")  # type: ignore[index]
    state = sup.state(spec.shard)
    assert state is not None
    assert state["exit_code"] == -signal.SIGKILL and "SIGKILL" in state["message"]
    assert state["log_tail"], "the log tail says what the engine last did"
    assert records(tmp_path / "state") == {}
    await asyncio.sleep(0.3)
    assert sup.state(spec.shard)["state"] == FAILED, "the supervisor does not restart on its own"  # type: ignore[index]

    await sup.converge([spec])
    assert await sup.wait_settled(30)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == READY and state["pid"] != pid

    # a change that needs a restart: stop, then start with the new command line
    old = state["pid"]
    bigger = parse_shard({**spec.to_dict(), "parallel": 3})
    await sup.converge([bigger])
    assert group_members(old) == []
    assert await sup.wait_settled(30)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == READY and state["pid"] not in (None, old)
    assert "--parallel 3" in Path(f"/proc/{state['pid']}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    await sup.converge([])
    await sup.close()


# --------------------------------------------------------------------------- stand-in engines


async def test_a_reused_pid_is_never_signalled(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # A process this test started, in its own process group, recorded with a wrong start time,
    # and this test process itself: both look like a pid reused after the engine died.
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        stat = read_proc_stat(bystander.pid)
        assert stat is not None
        me = read_proc_stat(os.getpid())
        assert me is not None
        spec = make_spec("/models/x.gguf").to_dict()
        (state_dir / "engines.json").write_text(
            json.dumps(
                {
                    "gone-s0": {
                        "pid": bystander.pid,
                        "pgid": bystander.pid,
                        "start_ticks": stat.start_ticks + 1,
                        "port": spec["port"],
                        "fingerprint": "x",
                        "spec": {**spec, "shard": "gone-s0"},
                        "started_at": time.time(),
                    },
                    "self-s0": {
                        "pid": os.getpid(),
                        "pgid": me.pgrp,
                        "start_ticks": me.start_ticks - 1,
                        "port": spec["port"],
                        "fingerprint": "x",
                        "spec": {**spec, "shard": "self-s0"},
                        "started_at": time.time(),
                    },
                }
            )
        )
        sup = supervisor(state_dir, binary="/bin/false")
        for shard in ("gone-s0", "self-s0"):
            state = sup.state(shard)
            assert state is not None and state["state"] == FAILED and state["pid"] is None
            assert "belongs to another process" in state["message"]
        assert sup.managed_pids() == set()
        assert records(state_dir) == {}
        await sup.converge([])
        await asyncio.sleep(0.2)
        assert bystander.poll() is None, "the bystander was signalled"
        assert sup.states() == []
        await sup.close()
    finally:
        bystander.kill()
        bystander.wait()


async def test_an_engine_gone_while_the_agent_was_away_is_reported_failed(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    done = subprocess.Popen(["true"], start_new_session=True)
    stat = read_proc_stat(done.pid)
    assert stat is not None
    done.wait()
    spec = make_spec("/models/x.gguf")
    (state_dir / "engines.json").write_text(
        json.dumps(
            {
                spec.shard: {
                    "pid": done.pid,
                    "pgid": done.pid,
                    "start_ticks": stat.start_ticks,
                    "port": spec.port,
                    "fingerprint": spec_fingerprint(spec),
                    "spec": spec.to_dict(),
                    "started_at": time.time(),
                }
            }
        )
    )
    (state_dir / "logs").mkdir()
    (state_dir / "logs" / f"{spec.shard}.log").write_text("==== llmgw-agent start\nout of memory\n")
    sup = supervisor(state_dir, binary="/bin/false")
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == FAILED
    assert "while the agent was away" in state["message"]
    assert state["log_tail"] == ["out of memory"]
    await sup.converge([])
    assert sup.states() == []
    await sup.close()


async def test_not_ready_in_time_is_stopped_and_failed(tmp_path: Path) -> None:
    # Never answers HTTP; a child in its group must go too.
    engine = script(tmp_path, "slow-engine", 'echo "loading forever"\nsleep 60 &\nexec sleep 60\n')
    sup = supervisor(tmp_path / "state", binary=engine, ready_timeout=0.5)
    spec = make_spec("/models/x.gguf")
    await sup.converge([spec])
    pid = sup.state(spec.shard)["pid"]  # type: ignore[index]
    await until(lambda: len(group_members(pid)) == 2, what="the engine's child")
    assert sup.managed_pids() == set(group_members(pid))
    assert await sup.wait_settled(10)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == FAILED
    assert state["message"].startswith("not ready within 0.5 s")
    assert "loading forever" in state["log_tail"]
    assert group_members(pid) == []
    assert records(tmp_path / "state") == {}
    await sup.close()


async def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    engine = script(tmp_path, "stubborn-engine", "trap '' TERM\necho started\nwhile :; do sleep 0.1; done\n")
    sup = supervisor(tmp_path / "state", binary=engine, stop_grace=0.3)
    spec = make_spec("/models/x.gguf")
    await sup.converge([spec])
    pid = sup.state(spec.shard)["pid"]  # type: ignore[index]
    await until(
        lambda: "started" in (tmp_path / "state" / "logs" / f"{spec.shard}.log").read_text(), what="the trap to be set"
    )
    await sup.converge([])
    assert group_members(pid) == []  # it ignores SIGTERM: only SIGKILL after the grace ends it
    assert sup.state(spec.shard)["state"] == STOPPED  # type: ignore[index]
    await sup.close()


async def test_refusals_say_why(tmp_path: Path) -> None:
    spec = make_spec("/models/x.gguf")
    sup = supervisor(tmp_path / "a", binary=None)
    await sup.converge([spec])
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == FAILED
    assert "no llama.cpp binary is configured" in state["message"]

    sup = supervisor(tmp_path / "b", binary=tmp_path / "does-not-exist")
    await sup.converge([spec])
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == FAILED and "could not start" in state["message"]

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = parse_shard({**spec.to_dict(), "port": taken.getsockname()[1]})
        sup = supervisor(tmp_path / "c", binary="/bin/sleep")
        await sup.converge([busy])
        state = sup.state(spec.shard)
        assert state is not None and state["state"] == FAILED and "already in use" in state["message"]

    with pytest.raises(ValueError, match="listed twice"):
        await sup.converge([spec, spec])
    await sup.close()


# --------------------------------------------------------------------------- draining


def stream_chat(endpoint: str, max_tokens: int, out: list[Any]) -> None:
    """Stream a chat completion (in a thread): append the chunks' finish_reason, then "[DONE]", or
    the error that ended the stream."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        endpoint + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {SECRET}"},
    )
    try:
        with _NO_PROXY.open(request, timeout=60) as response:
            for line in response:
                if line.startswith(b"data: [DONE]"):
                    out.append("[DONE]")
                elif line.startswith(b"data: "):
                    finish = (
                        json.loads(line[6:])["choices"][0].get("finish_reason") if b'"choices":[{' in line else None
                    )
                    if finish:
                        out.append(finish)
    except Exception as exc:  # noqa: BLE001 - the test reads what ended it
        out.append(exc)


def long_spec(tiny_model: Path, **overrides: Any) -> ShardSpec:
    # --context-shift lets a request generate past the context, so a test can hold one open.
    return make_spec(tiny_model, context_size=512, extra_args=["--context-shift"], **overrides)


async def running_requests(endpoint: str) -> float:
    def read() -> float:
        request = urllib.request.Request(endpoint + "/metrics", headers={"Authorization": f"Bearer {SECRET}"})
        with _NO_PROXY.open(request, timeout=10) as response:
            text = response.read().decode()
        return sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("llamacpp:requests_processing")
        )

    return await asyncio.to_thread(read)


@needs_llama_server
async def test_a_shard_listed_as_draining_answers_its_stream_to_the_end_and_stops_once_idle(
    tmp_path: Path, tiny_model: Path
) -> None:
    from agent.supervisor import DRAINING

    spec = long_spec(tiny_model)
    sup = supervisor(tmp_path / "state")
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == READY
    pid, endpoint = state["pid"], state["endpoint"]
    ended: list[Any] = []
    stream = asyncio.create_task(asyncio.to_thread(stream_chat, endpoint, 6000, ended))
    deadline = time.monotonic() + 15
    while await running_requests(endpoint) < 1:
        assert time.monotonic() < deadline, "the stream never reached the engine"
        await asyncio.sleep(0.02)
    await sup.converge([], [protocol.DrainingShard(shard=spec.shard, grace=120, left=120, settle=0)])
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == DRAINING and state["pid"] == pid and alive(pid), state
    assert state["message"].startswith("draining: "), state
    assert spec.shard in await sup.engine_metrics()  # its figures are still read while it drains
    protocol.parse_message(protocol.encode("report", {"shards": sup.states()}), expect="agent")
    # The same lists again (a periodic push) change nothing.
    await sup.converge([], [protocol.DrainingShard(shard=spec.shard, grace=120, left=119, settle=0)])
    assert sup.state(spec.shard)["state"] == DRAINING  # type: ignore[index]

    await stream
    assert ended == ["length", "[DONE]"], ended  # answered to its end
    await until(lambda: sup.state(spec.shard)["state"] == STOPPED, timeout=30, what="the idle engine to stop")  # type: ignore[index]
    state = sup.state(spec.shard)
    assert state is not None and state["message"].startswith("stopped: idle after draining for "), state
    assert group_members(pid) == []
    assert records(tmp_path / "state") == {}
    await sup.converge([], [])
    assert sup.states() == []
    await sup.close()


@needs_llama_server
async def test_a_draining_shard_whose_grace_runs_out_is_stopped_with_what_it_still_held(
    tmp_path: Path, tiny_model: Path
) -> None:
    spec = long_spec(tiny_model)
    sup = supervisor(tmp_path / "state")
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    state = sup.state(spec.shard)
    assert state is not None
    pid, endpoint = state["pid"], state["endpoint"]
    ended: list[Any] = []
    stream = asyncio.create_task(asyncio.to_thread(stream_chat, endpoint, 10**7, ended))  # never ends by itself
    deadline = time.monotonic() + 15
    while await running_requests(endpoint) < 1:
        assert time.monotonic() < deadline, "the stream never reached the engine"
        await asyncio.sleep(0.02)
    await sup.converge([], [protocol.DrainingShard(shard=spec.shard, grace=2, left=1.5, settle=0)])
    await until(lambda: sup.state(spec.shard)["state"] == STOPPED, timeout=30, what="the grace to run out")  # type: ignore[index]
    state = sup.state(spec.shard)
    assert state is not None
    assert state["message"] == "stopped: its drain grace of 2 s ran out (1 request running, 0 waiting)", state
    assert group_members(pid) == []
    await stream
    assert "[DONE]" not in ended and "length" not in ended, ended  # cut off: the gateway tells its client why
    await sup.close()


@needs_llama_server
async def test_an_idle_draining_shard_waits_for_the_gateways_and_one_no_longer_listed_stops_at_once(
    tmp_path: Path, tiny_model: Path
) -> None:
    from agent.supervisor import DRAINING

    spec = long_spec(tiny_model)
    sup = supervisor(tmp_path / "state")
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    pid = sup.state(spec.shard)["pid"]  # type: ignore[index]
    # Idle, but a gateway may still send it a request for 30 s: it is not stopped meanwhile.
    draining = [protocol.DrainingShard(shard=spec.shard, grace=60, left=60, settle=30)]
    await sup.converge([], draining)
    await asyncio.sleep(DRAIN_SETTLE_CHECK_S)
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == DRAINING
    assert state["message"] == "draining: idle; stopped once every gateway has stopped routing to it"
    # Wanted again: it serves on, the same process.
    await sup.converge([spec])
    state = sup.state(spec.shard)
    assert state is not None and state["state"] == READY and state["pid"] == pid, state
    await sup.converge([], draining)
    assert sup.state(spec.shard)["state"] == DRAINING  # type: ignore[index]
    # The server lists it no more (its replica was released): stopped at once.
    await sup.converge([], [])
    state = sup.state(spec.shard)
    assert (
        state is not None
        and state["state"] == STOPPED
        and state["message"] == "stopped: no longer desired on this node"
    )
    assert group_members(pid) == []
    await sup.close()


@needs_llama_server
async def test_an_engine_that_exits_while_draining_is_reported_stopped_not_failed(
    tmp_path: Path, tiny_model: Path
) -> None:
    spec = long_spec(tiny_model)
    sup = supervisor(tmp_path / "state")
    await sup.converge([spec])
    assert await sup.wait_settled(30)
    pid = sup.state(spec.shard)["pid"]  # type: ignore[index]
    await sup.converge([], [protocol.DrainingShard(shard=spec.shard, grace=60, left=60, settle=30)])
    os.kill(pid, signal.SIGKILL)
    await until(lambda: sup.state(spec.shard)["state"] == STOPPED, what="the exit to be seen")  # type: ignore[index]
    state = sup.state(spec.shard)
    assert state is not None and state["message"] == "stopped: the engine was killed by SIGKILL while draining"
    assert state["exit_code"] == -signal.SIGKILL
    await sup.close()


async def test_a_shard_not_ready_yet_is_stopped_at_once_even_when_listed_as_draining(tmp_path: Path) -> None:
    # It never answered: no request can be in flight on it.
    engine = script(tmp_path, "slow-engine", 'echo "loading"\nexec sleep 60\n')
    sup = supervisor(tmp_path / "state", binary=engine)
    spec = make_spec("/models/x.gguf")
    await sup.converge([spec])
    pid = sup.state(spec.shard)["pid"]  # type: ignore[index]
    assert sup.state(spec.shard)["state"] == STARTING  # type: ignore[index]
    await sup.converge([], [protocol.DrainingShard(shard=spec.shard, grace=60, left=60)])
    assert sup.state(spec.shard)["state"] == STOPPED  # type: ignore[index]
    assert group_members(pid) == []
    await sup.close()


def test_a_draining_entry_is_read_back_whole_and_refused_naming_the_field() -> None:
    item = protocol.DrainingShard(shard="r12s0", grace=120, left=95.5, settle=1.25).to_message()
    assert protocol.parse_draining(item) == protocol.DrainingShard("r12s0", 120.0, 95.5, 1.25)
    assert protocol.parse_draining({"shard": "r1s0", "grace": 5, "left": 0}).settle == 0.0
    for bad, field in (
        ({"shard": "r1s0", "grace": -1, "left": 1}, "grace"),
        ({"shard": "r1s0", "grace": 1, "left": float("inf")}, "left"),
        ({"shard": "r1s0", "grace": 1, "left": True}, "left"),
        ({"shard": "r1s0", "grace": 1}, "left"),
        ({"shard": "../x", "grace": 1, "left": 1}, "shard"),
    ):
        with pytest.raises(ValueError, match=f"^{field}"):
            protocol.parse_draining(bad)
