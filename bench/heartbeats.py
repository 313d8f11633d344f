"""Agent heartbeats against a real `llmgw web` on loopback.

    .venv/bin/python bench/heartbeats.py [--agents 2000] [--interval 10] [--duration 40]
                                         [--web-processes 2] [--storm] [--join-rate 200]

N lightweight simulated agents (one asyncio process, realistic registrations and
heartbeats: a quarter 8-GPU nodes, the rest CPU nodes, dialling for the first time at
--join-rate a second, as a fleet is installed, and dialling again after the agent's own backoff
when a dial fails) each hold a websocket to llmgw
web and heartbeat every interval. The same load is sent, in the same run, to a bare
uvicorn websocket server that only reads each message, as the baseline of what the
transport itself costs on this machine.

Prints heartbeats/s handled, the server's own p50/p99 time per heartbeat (from the
llmgw_agent_message_seconds histogram), PostgreSQL row writes per heartbeat (from
pg_stat_user_tables, counted between two moments when the agents pause their beats until every
write has landed and PostgreSQL has published its counts), the web process's CPU per heartbeat,
and the ratios to the baseline. The time to join is counted from the first dial.
Target: 10,000 agents at 10 s on at most two web processes (--web-processes 2) with p99 under
50 ms, web CPU per heartbeat at most 3 times the bare transport's, and at most one write per
heartbeat.

--storm then restarts llmgw web under the connected fleet, as an upgrade does: every agent is
dropped and dials again after the agent's own backoff (exponential, full jitter) until it is registered.
Prints how long until every agent was registered again, whether each node's channel layer group
holds its live connection and nothing else (read from Redis while the agents are still
connected), and the errors and tracebacks the web processes logged (target: none).

The load average is printed at the start and the end, and each target as met, missed or not
measured: the rate and the p99 are for 10,000 agents at 10 s on at most two web processes (a
smaller run prints them but does not measure those targets), the storm's without --storm. Needs
PostgreSQL and Redis on localhost. A quick check: --agents 200 --duration 20 --join-rate 100.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/13"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def process_tree_cpu(pid: int) -> float:
    total = 0.0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if int(entry) == pid or ppid == pid:
                total += cpu_seconds(int(entry))
    return total


def gpu(index: int) -> dict[str, object]:
    return {
        "index": index,
        "uuid": f"GPU-{uuid.uuid4()}",
        "name": "NVIDIA H100 80GB HBM3",
        "gpu_class": "H100-80GB",
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "memory_total_mib": 81559,
        "memory_used_mib": random.randint(0, 81559),
        "utilization_gpu_pct": random.randint(0, 100),
        "utilization_memory_pct": random.randint(0, 100),
        "sm_clock_mhz": 1980,
        "temperature_gpu_c": 45,
        "temperature_memory_c": 52,
        "power_draw_w": 312.5,
        "power_limit_w": 700.0,
        "throttle_reasons": [],
        "ecc_uncorrected_volatile": 0,
        "remapped_rows_pending": False,
        "remapped_rows_failure": False,
        "pcie_replay_count": 0,
        "mig_mode": "Disabled",
        "processes": [],
        "foreign_processes": 0,
        "fabric": {"state": "Completed", "status": "Success", "clique_id": 0, "cluster_uuid": None},
    }


def sample(gpus: int) -> dict[str, object]:
    return {
        "taken_at": time.time(),
        "cpus": 128,
        "cpu_utilization_pct": 23.4,
        "load": [4.1, 3.9, 3.7],
        "memory_total_bytes": 2 * 1024**4,
        "memory_available_bytes": 1024**4,
        "memory_used_bytes": 1024**4,
        "cpu_package_temp_c": 61.0,
        "inlet_temp_c": 24.0,
        "cpu_package_power_w": 210.3,
        "gpus": [gpu(i) for i in range(gpus)],
        "storage": [
            {
                "mount_point": "/models",
                "fstype": "ext4",
                "shared": False,
                "total_bytes": 7 * 1024**4,
                "free_bytes": 3 * 1024**4,
                "directories": ["/models"],
                "weights": ["qwen2.5-7b"],
            }
        ],
        "warnings": [],
    }


def messages(gpus: int) -> tuple[str, str]:
    from agent import protocol

    hardware = {
        "hostname": "n",
        "cpu_model": "Intel Xeon Platinum 8480+",
        "cpus": 128,
        "sockets": 2,
        "has_avx2": True,
        "has_avx512": True,
        "os": "Ubuntu 22.04",
        "kernel": "5.15",
        "arch": "x86_64",
        "memory_total_bytes": 2 * 1024**4,
        "driver_version": "565.57.01",
        "cuda_version": "12.7",
        "gpus": [gpu(i) for i in range(gpus)],
    }
    register = protocol.encode(
        "register",
        {"agent_version": "bench", "features": ["heartbeat.v1"], "hardware": hardware, "sample": sample(gpus)},
    )
    heartbeat = protocol.encode("heartbeat", {"sample": sample(gpus)})
    return register, heartbeat


async def dial(url: str, credential: str, i: int) -> Any:
    """One agent's connection, registered: the socket, or an exception when it could not."""
    from websockets.asyncio.client import connect

    register, _heartbeat = MESSAGES[8 if i % 4 == 0 else 0]
    ws = await connect(
        url,
        additional_headers={"Authorization": f"Bearer {credential}"},
        proxy=None,
        open_timeout=15,  # as the agent's own
        max_size=2**20,
        ping_interval=None,
        compression=None,
    )
    try:
        await ws.send(register)
        while True:  # the registered answer; a desired state may come first on a busy server
            try:
                answer = await asyncio.wait_for(ws.recv(), 300)  # the agent waits as long as it takes
            except TimeoutError:
                raise NotRegistered from None
            if '"type":"registered"' in answer:
                return ws
    except BaseException:
        await ws.close()
        raise


class NotRegistered(Exception):
    """Connected, but no "registered" answer came."""


FLEET, INTERVAL_S, WEB_PROCESSES, P99_TARGET_MS = 10_000, 10.0, 2, 50.0  # the targets' fleet
JOIN_RATE = 200.0  # agents dialling for the first time per second (--join-rate)
# How long the heartbeats pause before the row writes are counted: the web's write-behind (1 s) and
# PostgreSQL's delay in publishing an idle backend's counts (PGSTAT_IDLE_INTERVAL, 10 s), with a margin.
SETTLE_S = 12.0
WHY: collections.Counter[str] = collections.Counter()  # why dials failed or connections dropped


def _why(exc: BaseException) -> str:
    code = getattr(getattr(exc, "rcvd", None), "code", None)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return type(exc).__name__ + (f" {code}" if code else "") + (f" HTTP {status}" if status else "")


def backoff(attempt: int, interval: float) -> float:
    """How long the agent waits before dialling again (agent/main.py): exponential, at most twice
    the heartbeat interval (and at least 10 s), with full jitter."""
    return random.uniform(0, min(max(10.0, 2 * interval), 2.0 ** min(attempt, 10)))


async def run_agents(
    url: str, credentials: list[str], interval: float, duration: float, window: Any = None
) -> dict[str, float]:
    sent = 0
    failures = 0
    redials = 0
    connected = 0
    registered = 0
    deadline: float | None = None
    quiet = False  # while True, the agents skip their beats (stay connected, keep their rhythm)
    if window:
        await asyncio.to_thread(window, "dial")
    first_dial = time.monotonic()
    joining_until = first_dial + 300

    async def one(i: int, credential: str) -> None:
        nonlocal sent, failures, connected, registered, redials
        _register, heartbeat = MESSAGES[8 if i % 4 == 0 else 0]
        attempt = 0
        while True:  # as the agent: dial again after a backoff until registered
            try:
                ws = await dial(url, credential, i)
                break
            except Exception as exc:
                WHY[_why(exc)] += 1
                attempt += 1
                redials += 1
                if time.monotonic() > joining_until:
                    failures += 1
                    return
                await asyncio.sleep(backoff(attempt, interval))
        connected += 1
        registered += 1
        try:
            due = time.monotonic() + random.uniform(0, interval)
            while True:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if not quiet:  # while quiet the beat is skipped (the counts are read meanwhile), the rhythm kept
                    await ws.send(heartbeat)
                    sent += 1
                due = time.monotonic() + interval
        except Exception as exc:
            WHY[f"dropped: {_why(exc)}"] += 1
            failures += 1
        finally:
            await ws.close()

    tasks = []
    for i, credential in enumerate(credentials):
        tasks.append(asyncio.create_task(one(i, credential)))
        if i % 50 == 49:
            await asyncio.sleep(50 / JOIN_RATE)  # a fleet installed over time, not in one burst
    # Measure heartbeats only: wait until every agent registered (a fleet joining at once is another
    # load), then one interval more so every agent is in its heartbeat rhythm.
    give_up = first_dial + 330 + len(credentials) / JOIN_RATE
    while registered + failures < len(credentials) and time.monotonic() < give_up:
        await asyncio.sleep(0.1)
    joined = time.monotonic() - first_dial
    if window:
        await asyncio.to_thread(window, "joined")
    await asyncio.sleep(interval + 2)
    if window:
        # The row writes are counted between two quiet moments, when every write of the heartbeats
        # handled before has landed and PostgreSQL has published it: a heartbeat's row is written up
        # to FLUSH_SECONDS after it is handled, and an idle backend's counts reach pg_stat up to 10 s
        # after its last transaction, so two counters read at one instant under load disagree by
        # the heartbeats of those seconds, either way.
        quiet = True
        await asyncio.sleep(SETTLE_S)
        await asyncio.to_thread(window, "count-start")
        quiet = False
        await asyncio.sleep(interval)
    deadline = time.monotonic() + duration + interval
    if window:
        await asyncio.to_thread(window, "start")
    measured_from = sent
    t0 = time.monotonic()
    await asyncio.sleep(duration)
    elapsed = time.monotonic() - t0
    measured = sent - measured_from
    if window:
        await asyncio.to_thread(window, "end")
    await asyncio.gather(*tasks, return_exceptions=True)
    if window:
        await asyncio.sleep(SETTLE_S)  # every agent stopped beating at the deadline
        await asyncio.to_thread(window, "count-end")
    return {
        "sent": measured,
        "per_second": measured / elapsed,
        "failures": failures,
        "connected": connected,
        "redials": redials,
        "joined": joined,
    }


async def run_storm(url: str, credentials: list[str], interval: float, restart: Any, check: Any) -> dict[str, Any]:
    """Every agent connected and heartbeating; then `restart()` (the web goes and comes back) and
    each agent dials again until registered. `check()` runs once all are back, still connected."""
    registered_after: dict[int, float] = {}
    restarted_at: float | None = None
    stop = asyncio.Event()
    ready = 0

    async def one(i: int, credential: str) -> None:
        nonlocal ready
        _register, heartbeat = MESSAGES[8 if i % 4 == 0 else 0]
        first = True
        attempt = 0
        while not stop.is_set():
            try:
                ws = await dial(url, credential, i)
            except Exception:
                attempt += 1
                await asyncio.sleep(backoff(attempt, interval))
                continue
            attempt = 0
            if first:
                ready += 1
                first = False
            elif restarted_at is not None and i not in registered_after:
                registered_after[i] = time.monotonic() - restarted_at
            try:
                while not stop.is_set():
                    await ws.send(heartbeat)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), random.uniform(0.5, 1.0) * interval)
            except Exception:
                attempt += 1
                await asyncio.sleep(backoff(attempt, interval))
            finally:
                with contextlib.suppress(Exception):
                    await ws.close()

    tasks = []
    for i, credential in enumerate(credentials):
        tasks.append(asyncio.create_task(one(i, credential)))
        if i % 50 == 49:
            await asyncio.sleep(50 / JOIN_RATE)
    waited = 0.0
    while ready < len(credentials) and waited < 300:
        await asyncio.sleep(0.5)
        waited += 0.5
    await asyncio.sleep(interval)
    restarted_at = time.monotonic()
    await asyncio.to_thread(restart)
    while len(registered_after) < len(credentials) and time.monotonic() - restarted_at < 300:
        await asyncio.sleep(0.2)
    back = max(registered_after.values(), default=float("nan"))
    await asyncio.sleep(interval)  # a heartbeat or two on the new connections, then look
    checked = await asyncio.to_thread(check)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"back": len(registered_after), "seconds": back, "checked": checked}


MESSAGES: dict[int, tuple[str, str]] = {}


def histogram_window(before: str, after: str, name: str, label: str) -> tuple[float, float, float]:
    """p50, p99 and count of the observations made between two scrapes."""
    first, second = _buckets(before, name, label), _buckets(after, name, label)
    delta = [(le, count - dict(first).get(le, 0.0)) for le, count in second]
    total = delta[-1][1] if delta else 0.0
    return _quantile(delta, total, 0.5), _quantile(delta, total, 0.99), total


def _buckets(metrics: str, name: str, label: str) -> list[tuple[float, float]]:
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket{{") and label in line:
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return sorted(buckets)


def _quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    target = q * count
    previous_le, previous_count = 0.0, 0.0
    for le, cumulative in buckets:
        if cumulative >= target and count:
            if le == float("inf"):
                return previous_le
            share = (target - previous_count) / max(cumulative - previous_count, 1e-9)
            return previous_le + (le - previous_le) * share
        previous_le, previous_count = le, cumulative
    return previous_le


ECHO_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"}); return
    if scope["type"] != "websocket":
        return
    await receive()
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        if message.get("text", "").startswith('{"v":1,"type":"register"'):
            await send({"type": "websocket.send", "text": '{"v":1,"type":"registered"}'})
"""


def pg_writes(database: str) -> dict[str, float]:
    """Rows inserted, updated or deleted per table of the database (TOAST chunks of a large JSON
    value are storage detail, not writes the application made)."""
    import psycopg

    with psycopg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{database}", autocommit=True) as conn:
        rows = conn.execute("SELECT relname, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables").fetchall()
    return {name: float(count) for name, count in rows}


def _is_error(line: str) -> bool:
    return "Traceback" in line or " ERROR " in line or "Error:" in line and "Exception" in line or "CRITICAL" in line


def groups_check(env: dict[str, str], database: str) -> dict[str, int]:
    """Each node's channel layer group against the connection its row names: holding exactly that
    one (ok), missing it, or holding others besides (stale)."""
    import psycopg
    import redis

    with psycopg.connect(PG_ADMIN.rsplit("/", 1)[0] + f"/{database}", autocommit=True) as conn:
        rows = conn.execute("SELECT id, connection FROM cluster_node").fetchall()
    client = redis.Redis.from_url(env["LLMGW_REDIS_URL"])
    pipe = client.pipeline(transaction=False)
    for pk, _connection in rows:
        pipe.zrange(f"{env['LLMGW_REDIS_PREFIX']}:group:agent.node.{pk}".encode(), 0, -1)
    counts = {"ok": 0, "missing": 0, "stale": 0}
    for (_pk, connection), members in zip(rows, pipe.execute(), strict=True):
        names = {m.decode() for m in members}
        if connection not in names:
            counts["missing"] += 1
        elif len(names) > 1:
            counts["stale"] += 1
        else:
            counts["ok"] += 1
    return counts


def storm(
    args: argparse.Namespace,
    env: dict[str, str],
    database: str,
    credentials: list[str],
    port: int,
    start_web: Any,
    current: Any,
    web_log: Path,
    report: Report,
) -> None:
    holder: dict[str, Any] = {}

    def restart() -> None:
        process = current() if "web" not in holder else holder["web"]
        process.terminate()
        process.wait(timeout=120)
        holder["web"] = start_web()

    try:
        result = asyncio.run(
            run_storm(
                f"ws://127.0.0.1:{port}/ws/agent/",
                credentials,
                args.interval,
                restart,
                lambda: groups_check(env, database),
            )
        )
    finally:
        if "web" in holder and holder["web"].poll() is None:
            holder["web"].terminate()
            holder["web"].wait(timeout=120)
    checked = result["checked"]
    print(
        f"reconnect storm: {result['back']} of {len(credentials)} agents registered again within "
        f"{result['seconds']:.1f} s of the restart (web start-up included)"
    )
    print(
        f"node groups holding their live connection: {checked['ok']} of {len(credentials)}; "
        f"missing it {checked['missing']}, stale members besides {checked['stale']}"
    )
    report.target("storm: agents not back", measured=len(credentials) - result["back"], limit=0)
    report.target("storm: node groups wrong", measured=checked["missing"] + checked["stale"], limit=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=int, default=2000)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--web-processes", type=int, default=1, help="llmgw web --workers (at most 2 for the target)")
    parser.add_argument("--storm", action="store_true", help="then restart the web under the connected fleet")
    parser.add_argument("--log-level", default="warning", help="the web's log level (its log: web.log, kept)")
    parser.add_argument(
        "--join-rate", type=float, default=200.0, help="agents dialling for the first time per second (the storm: all)"
    )
    args = parser.parse_args()
    global JOIN_RATE
    JOIN_RATE = args.join_rate
    with Report(__doc__) as report:
        run(args, report)


def run(args: argparse.Namespace, report: Report) -> None:

    import psycopg

    for gpus in (0, 8):
        MESSAGES[gpus] = messages(gpus)
    database = f"llmgw_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        {
            "LLMGW_DATA_DIR": str(tmp),
            "LLMGW_DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}",
            "LLMGW_REDIS_URL": REDIS,
            "LLMGW_REDIS_PREFIX": f"bench-{uuid.uuid4().hex[:6]}",
            "LLMGW_LOG_LEVEL": args.log_level,
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
        }
    )
    python = sys.executable
    web = echo = None
    try:
        subprocess.run([python, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, check=True, cwd=REPO)
        make = (
            "import sys,secrets,hashlib\n"
            "import django; django.setup()\n"
            "from apps.cluster.models import Node\n"
            f"n={args.agents}\n"
            "creds=['llmgwn_'+secrets.token_urlsafe(32) for _ in range(n)]\n"
            "Node.objects.bulk_create([Node(name=f'bench-{i:05d}', credential_hash=hashlib.sha256(c.encode())"
            ".hexdigest()) for i,c in enumerate(creds)], batch_size=500)\n"
            "print('\\n'.join(creds))\n"
        )
        credentials = subprocess.run(
            [python, "-c", make], env=env, check=True, cwd=REPO, capture_output=True, text=True
        ).stdout.split()

        # Baseline: the same load to a websocket server that only reads.
        echo_port = free_port()
        (tmp / "echo.py").write_text(ECHO_APP)
        echo = subprocess.Popen(
            [
                python,
                "-m",
                "uvicorn",
                "echo:app",
                "--port",
                str(echo_port),
                "--log-level",
                "warning",
                "--ws-max-size",
                str(2**20),
            ],
            cwd=tmp,
            env=env,
        )
        time.sleep(2)
        cpu0 = process_tree_cpu(echo.pid)
        base = asyncio.run(run_agents(f"ws://127.0.0.1:{echo_port}/", credentials, args.interval, args.duration))
        base_cpu = process_tree_cpu(echo.pid) - cpu0
        echo.terminate()
        echo.wait()

        WHY.clear()
        port = free_port()
        web_log = tmp / "web.log"

        def start_web() -> subprocess.Popen[bytes]:
            command = [python, "-m", "llmgw", "web", "--listen", f"127.0.0.1:{port}"]
            if args.web_processes > 1:
                command += ["--workers", str(args.web_processes)]
            with web_log.open("ab") as log:
                process = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.2)
            return process

        web = start_web()
        marks: dict[str, Any] = {}

        def window(edge: str) -> None:
            # Read the web process's histogram from its metrics folder rather than asking it for
            # /metrics, which would load it (2,000 nodes' samples) in the middle of the measurement.
            from prometheus_client import CollectorRegistry, generate_latest
            from prometheus_client.multiprocess import MultiProcessCollector

            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=str(tmp / "prometheus"))
            metrics = generate_latest(registry).decode()
            marks[edge] = (pg_writes(database), process_tree_cpu(web.pid), metrics)

        result = asyncio.run(
            run_agents(f"ws://127.0.0.1:{port}/ws/agent/", credentials, args.interval, args.duration, window)
        )
        counted = marks["count-start"][0], marks["count-end"][0]
        per_table = {t: counted[1].get(t, 0.0) - counted[0].get(t, 0.0) for t in counted[1]}
        writes = sum(per_table.values())
        web_cpu = marks["end"][1] - marks["start"][1]
        p50, p99, _handled = histogram_window(
            marks["start"][2], marks["end"][2], "llmgw_agent_message_seconds", 'type="heartbeat"'
        )
        total_sent = histogram_window(
            marks["count-start"][2], marks["count-end"][2], "llmgw_agent_message_seconds", 'type="heartbeat"'
        )[2]
        print(
            f"agents: {args.agents} ({result['connected']:.0f} connected, {result['failures']:.0f} failed), "
            f"interval {args.interval:.0f} s, measured {args.duration:.0f} s"
        )
        print(
            f"joining: every agent registered within {result['joined']:.0f} s of the first dial (the join rate "
            f"alone: {args.agents / JOIN_RATE:.0f} s), {result['redials']:.0f} dials tried again after a backoff "
            f"(baseline transport: {base['joined']:.0f} s, {base['redials']:.0f})"
        )
        join_cpu = marks["joined"][1] - marks["dial"][1]
        print(
            f"web CPU while joining: {join_cpu:.1f} s, {join_cpu / args.agents * 1000:.2f} ms per agent (the "
            f"heartbeats of the agents already in included), {join_cpu / max(result['joined'], 1e-9):.2f} cores"
        )
        print(
            f"heartbeats handled: {result['per_second']:.1f}/s; "
            f"baseline transport {base['per_second']:.1f}/s; ratio {result['per_second'] / base['per_second']:.2f}"
        )
        print(f"server time per heartbeat: p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms")
        if args.agents < FLEET or args.interval > INTERVAL_S or args.web_processes > WEB_PROCESSES:
            smaller = (
                f"this run had {args.agents} agents at {args.interval:g} s on {args.web_processes} web processes; "
                f"the target is for {FLEET:,} at {INTERVAL_S:g} s on at most {WEB_PROCESSES}"
            )
            report.not_measured("heartbeats handled", f"{smaller} ({result['per_second']:.1f}/s)")
            report.not_measured("server p99", f"{smaller} ({p99 * 1000:.2f} ms)")
        else:
            wanted = args.agents / args.interval
            report.target("heartbeats handled", measured=result["per_second"], limit=wanted, unit="/s", higher=True)
            report.target("server p99", measured=p99 * 1000, limit=P99_TARGET_MS, unit=" ms")
        per_beat_cpu = web_cpu / max(result["sent"], 1) * 1000
        base_cpu_beat = base_cpu / max(base["sent"], 1) * 1000
        print(
            f"web CPU per heartbeat: {per_beat_cpu:.2f} ms; baseline transport {base_cpu_beat:.2f} ms; "
            f"ratio {per_beat_cpu / max(base_cpu_beat, 1e-9):.1f}"
        )
        report.target("web CPU vs bare transport", measured=per_beat_cpu / max(base_cpu_beat, 1e-9), limit=3, unit="x")
        print(
            f"database row writes per heartbeat: {writes / max(total_sent, 1):.2f} "
            f"({writes:.0f} row writes for {total_sent:.0f} heartbeats, counted between two quiet moments: "
            + ", ".join(f"{t} {n:.0f}" for t, n in sorted(per_table.items(), key=lambda i: -i[1]) if n)
            + ")"
        )
        if total_sent:
            report.target("writes per heartbeat", measured=writes / total_sent, limit=1)
        else:
            report.not_measured("writes per heartbeat", "no heartbeat handled in the window")
        print(f"web processes: {args.web_processes}")
        print(
            "why dials failed or connections dropped: " + (", ".join(f"{k} {n}" for k, n in WHY.most_common()) or "-")
        )
        if args.storm:
            storm(args, env, database, credentials, port, start_web, lambda: web, web_log, report)
        else:
            for name in ("storm: agents not back", "storm: node groups wrong"):
                report.not_measured(name, "run with --storm")
        lines = web_log.read_text(errors="replace").splitlines()
        died = [line for line in lines if "Child process" in line and "died" in line]
        print(f"web processes that died and were started again: {len(died)} (uvicorn's own count; --log-level info)")
        errors = [line for line in lines if _is_error(line)]
        print(f"errors and tracebacks in the web's log: {len(errors)}")
        report.target("errors in the web's log", measured=len(errors), limit=0)
        for line in errors[:10]:
            print("   ", line[:200])
    finally:
        for process in (web, echo):
            if process and process.poll() is None:
                process.terminate()
                process.wait(timeout=20)
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


if __name__ == "__main__":
    main()
