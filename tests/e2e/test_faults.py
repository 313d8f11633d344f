"""What llmgw promises under faults, on a production-like set-up (tests/e2e/production.py).

One set-up is shared by the module: web, worker, beat and an agent as separate processes, on a
private Redis and a proxied PostgreSQL, serving the tiny llama.cpp model under continuous load.
The tests run in order, each leaving the system healthy for the next:

1. any one process can be killed (kill -9) at any moment: web, the worker's Celery child, beat;
2. Redis goes away for a while and comes back empty;
3. PostgreSQL goes away for a while (connections refused and reset) and comes back;
4. hostile input on every surface, with every process up.

Each asserts the promise as the documentation states it, never on timings (waits are bounded
with generous limits), and prints its figures: requests sent and failed, usage rows missing,
engine restarts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import descendants
from tests.e2e.production import MODEL, NODE, Answer, Production, chat, missing_reason, summary, wait_for

pytestmark = pytest.mark.e2e

REASON = missing_reason()
if REASON is not None:
    pytest.skip(REASON, allow_module_level=True)

OUTAGE_S = 60.0  # the promise: Redis or PostgreSQL away for a minute
# With the worker writing usage, the web process checks what it handed over once it is 60 s old,
# every 30 s: a batch lost with the broker is written within about 90 s.
CONFIRM_S = 150.0
FIGURES: list[dict[str, Any]] = []


@pytest.fixture(scope="module")
def prod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Production]:
    with Production(tmp_path_factory.mktemp("faults")) as running:
        yield running
        print("\n=== figures of the fault tests")
        for row in FIGURES:
            print("  " + ", ".join(f"{k}={v}" for k, v in row.items()))


def record(fault: str, answers: list[Answer], *, missing: int, engine_restarts: int, **extra: Any) -> None:
    row = {
        "fault": fault,
        "sent": len(answers),
        "answered_2xx": sum(a.ok for a in answers),
        "failed": sum(not a.ok for a in answers),
        "usage_missing": missing,
        "engine_restarts": engine_restarts,
        **extra,
    }
    FIGURES.append(row)
    print(
        f"\n[{fault}] "
        + ", ".join(f"{k}={v}" for k, v in row.items() if k != "fault")
        + f"\n[{fault}] {summary(answers)}"
    )


def engine_pid(prod: Production) -> int:
    """The one engine serving tiny: the replica's shard pid, and the one llama-server process."""
    shards = prod.shard_pids()
    assert len(shards) == 1 and shards[0], f"expected one running shard of {MODEL}, got pids {shards}"
    assert prod.engine_pids() == [shards[0]], f"engine processes {prod.engine_pids()}, shard pid {shards[0]}"
    return int(shards[0])


def restarts(before: int, prod: Production) -> int:
    """How many times the engine was started again since `before` (0 or 1: it is one process)."""
    return 0 if prod.engine_pids() == [before] else 1


def assert_healthy(prod: Production) -> None:
    state = prod.all_running()
    assert all(state.values()), f"not running: {state}\n{prod.logs()}"
    assert len(prod.replicas()) == 1 and len(prod.engine_pids()) == 1, (
        f"replicas {prod.replicas()}, engines {prod.engine_pids()}"
    )
    assert chat(prod.url, prod.key).ok


# 1. Any one process can be killed at any moment -------------------------------------------------------


KILLS = 10


def test_killing_the_web_process_ten_times_loses_no_usage_record_of_an_answer(prod: Production) -> None:
    """Every record is in the web process's journal before the answer's last byte goes out, and
    the next web process on the host writes what the killed one had not: kill -9 under load, ten
    times, and every answer a client received has its usage row."""
    engine = engine_pid(prod)
    load = prod.load()
    load.wait_ok(50)
    back_at = 0.0
    for _ in range(KILLS):
        time.sleep(2)  # a few seconds of steady load, so that the kill lands mid-stream
        prod.kill("web")
        prod.start("web")
        back_at = time.time()
        load.wait_ok(20, since=back_at)
    answers = load.stop()
    missing = prod.wait_usage(answers, timeout=120, settle=5)
    record(
        f"kill -9 web x{KILLS}",
        answers,
        missing=len(missing),
        engine_restarts=restarts(engine, prod),
    )
    assert missing == [], (
        f"{len(missing)} answered requests have no usage row, e.g. {[a.request_id for a in missing[:5]]}\n{prod.logs()}"
    )

    # The engine kept running, the agent came back to the new web process, nothing was placed twice.
    assert prod.engine_pids() == [engine] and prod.shard_pids() == [engine]
    prod.wait_node_ready(after=back_at)
    assert len(prod.replicas()) == 1 and len(prod.engine_pids()) == 1
    assert_healthy(prod)


def test_the_workers_celery_child_killed_comes_back_and_the_reconciler_still_acts(prod: Production) -> None:
    engine = engine_pid(prod)
    worker = prod.services["worker"]
    child = prod.celery_child()
    assert child is not None, worker.log()
    load = prod.load()
    load.wait_ok(100)
    os.kill(child, signal.SIGKILL)
    fresh = wait_for(
        lambda: (c := prod.celery_child()) and c != child and c, "a new Celery worker", timeout=60, details=worker.log
    )
    assert worker.running and worker.starts == 1, "llmgw worker itself was not meant to stop"
    assert "starting it again" in worker.log()

    # The reconciler runs in the new child: a second replica is placed and started, then stopped.
    prod.api("POST", f"models/{MODEL}/target", {"min": 2, "max": 2})
    wait_for(
        lambda: len([r for r in prod.replicas() if r["state"] == "ready"]) == 2 and len(prod.engine_pids()) == 2,
        "a second replica of tiny",
        timeout=120,
        details=prod.logs,
    )
    prod.api("POST", f"models/{MODEL}/target", {"min": 1, "max": 1})
    wait_for(
        lambda: len(prod.replicas()) == 1 and len(prod.engine_pids()) == 1,
        "tiny back to one replica",
        timeout=120,
        details=prod.logs,
    )
    answers = load.stop()
    survivor = engine_pid(prod)

    # Whatever the killed child was writing, the web process writes once it sees it missing.
    missing = prod.wait_usage(answers, timeout=CONFIRM_S)
    record(
        "kill -9 worker's Celery child",
        answers,
        missing=len(missing),
        engine_restarts=0 if survivor == engine else 1,
        celery_child=f"{child}->{fresh}",
    )
    assert not missing, f"{len(missing)} answered requests have no usage row: {missing[:5]}\n{prod.logs()}"
    assert_healthy(prod)


def test_beat_killed_and_started_again_schedules_again(prod: Production) -> None:
    beat, worker = prod.services["beat"], prod.services["worker"]
    prod.kill("beat")
    assert prod.processes("beat") == []
    since_beat, since_worker = beat.log_size(), worker.log_size()
    prod.start("beat")
    wait_for(
        lambda: "Sending due task reconcile" in beat.log_since(since_beat),
        "beat to send the reconcile task",
        timeout=60,
        details=beat.log,
    )
    wait_for(
        lambda: "apps.cluster.tasks.reconcile" in worker.log_since(since_worker),
        "the worker to run a task beat sent",
        timeout=60,
        details=worker.log,
    )
    assert prod.processes("beat") == [beat.pid], "exactly one beat"
    record("kill -9 beat", [], missing=0, engine_restarts=0, beat_starts=beat.starts)
    assert_healthy(prod)


# 2. Redis away for a while -----------------------------------------------------------------------------


def test_redis_away_for_a_while(prod: Production) -> None:
    engine = engine_pid(prod)
    before = prod.pids()
    worker = prod.services["worker"]
    watch = prod.watch_node()
    load = prod.load()
    load.wait_ok(100)
    down_at = prod.redis.stop()
    time.sleep(OUTAGE_S)
    during = [a for a in load.snapshot() if a.sent >= down_at]
    since_worker = worker.log_size()
    up_at = prod.redis.start()
    load.wait_ok(100, since=up_at)
    answers = load.stop()
    problems: list[str] = []

    # The gateway kept serving: every request answered 2xx.
    failed = [a for a in answers if not a.ok]
    if not during or failed:
        problems.append(
            f"{len(failed)} of {len(answers)} requests failed ({len(during)} sent during the outage): "
            f"{summary(answers)}; sent at (s after Redis stopped): "
            f"{[round(a.sent - down_at, 3) for a in failed]}"
        )
    # The agent is back on the new Redis within a few heartbeats.
    try:
        prod.wait_node_ready(after=up_at, timeout=4 * prod.heartbeat_s + 30)
    except AssertionError as exc:
        problems.append(str(exc)[:3000])
    # The worker takes tasks from the new Redis without being started again by anyone.
    try:
        wait_for(
            lambda: "succeeded" in worker.log_since(since_worker),
            "the worker to run a task after Redis came back",
            timeout=120,
            details=lambda: worker.log_since(since_worker)[-3000:],
        )
    except AssertionError as exc:
        problems.append(str(exc)[:4000])
    if worker.starts != 1 or not worker.running:
        problems.append(f"llmgw worker was started {worker.starts} times, running: {worker.running}")
    # Usage of every answered request is stored: written by the web process while the broker
    # refused, and the batches the empty Redis lost written once their check is due.
    missing = prod.wait_usage(answers, timeout=CONFIRM_S)
    if missing:
        problems.append(
            f"{len(missing)} of {sum(a.ok for a in answers)} answered requests have no usage row; first {missing[:3]}"
        )
    # The node stayed ready throughout.
    watch.stop()
    not_ready = [(round(moment - down_at, 1), status) for moment, status in watch.not_ready()]
    if not_ready:
        problems.append(
            f"the node was not ready at (s after Redis stopped, status; Redis was back at "
            f"{up_at - down_at:.1f}): {not_ready[:20]}"
        )
    if prod.engine_pids() != [engine]:
        problems.append(f"the engine was started again: {engine} -> {prod.engine_pids()}")
    after = prod.pids()
    record(
        "Redis away",
        answers,
        missing=len(missing),
        engine_restarts=restarts(engine, prod),
        during_outage=len(during),
        during_outage_failed=sum(not a.ok for a in during),
        slowest_s=round(max((a.done - a.sent for a in answers), default=0), 2),
        node_not_ready=not_ready[:6] or "-",
        celery_child=f"{before['celery']}->{after['celery']}",
    )
    assert not problems, "\n".join(problems) + "\n" + prod.logs()
    assert_healthy(prod)


# 3. PostgreSQL away for a while --------------------------------------------------------------------------


def test_postgresql_away_for_a_while(prod: Production) -> None:
    engine = engine_pid(prod)
    before = prod.pids()
    starts = {name: s.starts for name, s in prod.services.items()}
    load = prod.load()
    load.wait_ok(100)
    cut_at = prod.postgres.cut()
    time.sleep(OUTAGE_S)
    during = [a for a in load.snapshot() if a.sent >= cut_at]
    restored_at = prod.postgres.restore()
    load.wait_ok(100, since=restored_at)
    answers = load.stop()
    problems: list[str] = []

    # The gateway kept serving from its tables in memory.
    failed = [a for a in answers if not a.ok]
    if not during or failed:
        problems.append(
            f"{len(failed)} of {len(answers)} requests failed ({len(during)} sent during the outage): "
            f"{summary(answers)}; sent at (s after the cut): {[round(a.sent - cut_at, 3) for a in failed]}"
        )
    # Heartbeats are written again.
    try:
        prod.wait_node_ready(after=restored_at, timeout=4 * prod.heartbeat_s + 30)
    except AssertionError as exc:
        problems.append(str(exc)[:3000])
    # Usage kept in memory is written once PostgreSQL is back.
    missing = prod.wait_usage(answers, timeout=CONFIRM_S)
    if missing:
        problems.append(
            f"{len(missing)} of {sum(a.ok for a in answers)} answered requests have no usage row; first {missing[:3]}"
        )
    # No process needed a restart.
    after = prod.pids()
    if after != before or {name: s.starts for name, s in prod.services.items()} != starts:
        problems.append(f"processes were started again: {before} -> {after}")
    record(
        "PostgreSQL away",
        answers,
        missing=len(missing),
        engine_restarts=restarts(engine, prod),
        during_outage=len(during),
        during_outage_failed=sum(not a.ok for a in during),
        slowest_s=round(max((a.done - a.sent for a in answers), default=0), 2),
        restarted=[name for name in before if before[name] != after[name]] or "-",
    )
    assert not problems, "\n".join(problems) + "\n" + prod.logs()
    assert_healthy(prod)


# 4. Hostile input on every surface --------------------------------------------------------------------


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - our own loopback URL
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, {"raw": text[:300].decode(errors="replace")}


def _deep(depth: int) -> bytes:
    return ('{"model": "tiny", "max_tokens": 4, "messages": ' + "[" * depth + "]" * depth + "}").encode()


def _huge_content_length(port: int) -> str:
    """POST /healthz declaring 10^12 bytes of body, sending none: the answer's status line."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n"
        )
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n", 1)[0].decode(errors="replace")


def resident_bytes(pid: int) -> int:
    """Resident memory of a process and everything below it."""
    total = 0
    for member in {pid} | descendants(pid):
        try:
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def test_hostile_input_on_every_surface_is_refused_and_other_clients_go_on(prod: Production) -> None:
    from websockets.sync.client import connect

    engine = engine_pid(prod)
    before = prod.pids()
    web_pid = prod.services["web"].pid
    assert web_pid is not None
    memory_before = resident_bytes(web_pid)
    load = prod.load()
    load.wait_ok(50)
    bearer = {"Authorization": f"Bearer {prod.key}"}
    refusals: dict[str, list[str]] = {}

    # A NaN in a heartbeat, on a raw websocket with a valid node credential of its own.
    token = prod.api("POST", "nodes/enrollments", {"name": "probe"})["token"]
    status, enrolled = _post(prod.url + "/api/v1/agent/enroll", json.dumps({"token": token}).encode(), {})
    assert status == 200, enrolled
    with connect(
        prod.url.replace("http://", "ws://") + "/ws/agent/",
        proxy=None,
        open_timeout=15,
        additional_headers={"Authorization": f"Bearer {enrolled['credential']}"},
    ) as ws:
        for _ in range(3):
            ws.send('{"v": 1, "type": "heartbeat", "sample": {"cpu_percent": NaN}}')
            reply = json.loads(ws.recv(timeout=15))
            assert reply["type"] == "error" and reply["code"] == "invalid" and "NaN" in reply["message"], reply
            refusals.setdefault("websocket NaN heartbeat", []).append(reply["code"])

    # 2,000-deep JSON to the gateway (both protocols) and to the REST API.
    for _ in range(3):
        status, body = _post(prod.url + "/v1/chat/completions", _deep(2000), bearer)
        assert status == 400 and body.get("error", {}).get("message"), (status, body)
        refusals.setdefault("/v1/chat/completions 2000-deep", []).append(str(status))
        status, body = _post(prod.url + "/v1/messages", _deep(2000), {"x-api-key": prod.key})
        assert status == 400 and body.get("type") == "error" and body["error"].get("message"), (status, body)
        refusals.setdefault("/v1/messages 2000-deep", []).append(str(status))
        status, body = _post(
            prod.url + "/api/v1/models/apply", b'{"models": ' + b"[" * 2000 + b"]" * 2000 + b"}", bearer
        )
        assert status == 400 and isinstance(body.get("detail"), str) and body["detail"], (status, body)
        refusals.setdefault("/api/v1/models/apply 2000-deep", []).append(str(status))

    # A body declared far over the limit, to an endpoint that takes none.
    port = int(prod.url.rsplit(":", 1)[1])
    for _ in range(3):
        line = _huge_content_length(port)
        assert line.startswith("HTTP/1.1 413"), line
        refusals.setdefault("/healthz Content-Length 10^12", []).append(line[9:12])

    # 10,000 messages in one chat completion.
    many = json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}] * 10_000}
    ).encode()
    for _ in range(3):
        status, body = _post(prod.url + "/v1/chat/completions", many, bearer)
        assert status == 400 and body.get("error", {}).get("code") == "too_many_messages", (status, body)
        refusals.setdefault("/v1/chat/completions 10,000 messages", []).append(str(status))

    # Every process is up, nothing was started again, and the others' requests went on.
    normal = chat(prod.url, prod.key)
    answers = load.stop()
    missing = prod.wait_usage(answers, timeout=CONFIRM_S)
    print("\n[hostile input] refusals: " + "; ".join(f"{k}: {','.join(v)}" for k, v in refusals.items()))
    grown = resident_bytes(web_pid) - memory_before
    record(
        "hostile input",
        answers,
        missing=len(missing),
        engine_restarts=restarts(engine, prod),
        web_memory_mib=f"{memory_before / 2**20:.0f}->{(memory_before + grown) / 2**20:.0f}",
    )
    # Each refused body was bounded before it was held: the web process grew by far less than one
    # of them would have cost whole (10,000 messages parsed, 2,000-deep JSON, a 10^12-byte claim).
    assert grown < 128 * 2**20, f"the web process grew by {grown / 2**20:.0f} MiB under hostile input"
    assert normal.ok, normal
    shown = wait_for(lambda: prod.request(normal.request_id), "the usage record of a normal request", timeout=60)
    assert shown["model"] == MODEL and shown["status"] == 200, shown
    assert not missing, f"{len(missing)} answered requests have no usage row: {missing[:3]}"
    assert not [a for a in answers if not a.ok], summary(answers)
    assert prod.pids() == before, f"{before} -> {prod.pids()}\n{prod.logs()}"
    node = prod.node_row(NODE)
    assert node is not None and node[0] == "ready", node
    assert_healthy(prod)
