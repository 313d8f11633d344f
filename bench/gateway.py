"""The /v1 gateway against the same load sent straight to the upstream, through nginx and through LiteLLM.

    .venv/bin/python bench/gateway.py [--pg] [--litellm | --no-litellm] [--quick]

One run, on loopback, every process on its own:

- a mock OpenAI-compatible upstream (bench/mock_upstream.py: raw asyncio, httptools, uvloop),
  which counts, per port, the requests it holds at once (GET /__stats, POST /__stats/reset),
- nginx (Debian's package, installed with apt-get when missing; skipped with the reason when it
  cannot be), in the foreground as the bench's child: one worker process, a plain keep-alive
  reverse proxy to the mock (HTTP/1.1 upstream, 64 idle connections, proxy_buffering off, no
  access log), the floor of what one proxy hop adds,
- `llmgw web` (one worker) in a temporary data dir on SQLite with no Redis, so the
  in-process limiter, usage writer and slot counts are used; with --pg, a second llmgw on
  PostgreSQL and Redis as well (heartbeats.py's local servers), then `llmgw web --workers 2` on
  the same database and Redis (several web processes need Redis to share replica slots),
- LiteLLM's proxy (`litellm[proxy]==1.108.0`, in its own venv at /tmp/llmgw-bench-litellm,
  reused when present; no database, telemetry off), unless --no-litellm or it fails,
- the load generator (an aiohttp client, this file with --loadgen) in a process of its own,
  which reads each target's CPU time (utime+stime of the process and its children, from
  /proc) right before each measured phase and after it, once the target is idle again (so
  work it deferred, such as llmgw's batched usage writes, counts toward the phase).

Each target gets the same load: 2,000 requests one at a time and 2,000 at 32 in flight,
non-streamed and streamed (16 content chunks, a usage chunk and [DONE]); then 500 streams at
32 in flight whose chunks the mock sends 1 ms apart (each chunk reaches the gateway on its
own, the worst case for per-chunk cost); and last, 2,000 streams open at once through llmgw,
each held ~5 s by the mock with a chunk every 0.5 s.

llmgw's models for that load are external providers pointing at the mock: their requests take
no replica slot. Each llmgw configuration then runs the same phases (but the 2,000 open
streams) on two replica models, `mock-replica` and `mock-replica-paced` (chunks 1 ms apart): a
ready replica on a ready node whose engine is one of the mock's ports, with 8 parallel slots,
and LLMGW_GATEWAY_QUEUE_MAX=256, so 32 clients on 8 slots wait in the queue and none is refused.
Every such request takes a slot and gives it back: in the process on SQLite; with Redis, one Lua
script call to take it, a ZREM and a PUBLISH to give it back, shared by every web process. With
no worker running, nothing reconciles the replicas away.

Small differences at c=1 drown in what else a shared machine does between two phases, so each
llmgw configuration also sends 2,000 rounds of one request to each of direct, nginx (kept running
for this), llmgw's external model and its replica model in turn, the order rotating every round,
non-streamed and streamed: what nginx adds, what llmgw adds as a multiple of it, and what the
slot adds are read from those rounds.

Prints what the gateway adds over the direct path, what nginx adds and llmgw's figure as a
multiple of it, throughput, the gateway's CPU per request, the llmgw/LiteLLM ratios and the
task's targets next to them; then, for the replica path, what the slot costs next to the
external path, one web process next to two, the answers other than 200, and the most requests
the replica's port held at once against its 8 slots (OK, or EXCEEDED). No assertions: a script.

Targets, for each llmgw configuration: latency added over direct at c=1, non-streamed, p50 at most
0.5 ms and p99 at most 2 ms, and the same for streams' first content; gateway CPU at most 1 ms per
non-streamed request and 2 ms per 16-chunk stream (the paced one too); throughput at least 10x
LiteLLM's, non-streamed and streamed (not measured without LiteLLM); the 2,000 open streams with no
error; on the replica path, at most 8 requests held at once and no answer other than 200. The load
average is printed at the start and the end, and each target as met, missed or not measured
(bench/report.py). The quickest run: --quick --no-litellm (nginx is installed with apt-get when
missing, as above).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import math
import os
import re
import resource
import shutil
import signal
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
PYTHON = sys.executable
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402

LITELLM_VENV = Path("/tmp/llmgw-bench-litellm")
LITELLM_VERSION = "1.108.0"
LITELLM_INSTALL_TIMEOUT = 600
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS = "redis://127.0.0.1:6379/13"

PROMPT = [{"role": "user", "content": "Say hello in a few words."}]
C1_REQUESTS, C1_WARMUP = 2000, 50  # enough that p99 is not the second-worst sample
C32_REQUESTS, C32_WARMUP = 2000, 200
PACED_REQUESTS = 500
ROTATION_ROUNDS = 2000  # c=1 rounds of direct, nginx and llmgw in turn, per llmgw configuration
OPEN_STREAMS = 2000
# The replica models: their engine is the mock (its replica ports), SLOTS requests at once each.
REPLICA_MODEL, REPLICA_PACED_MODEL = "mock-replica", "mock-replica-paced"
SLOTS = 8
QUEUE_MAX = 256  # LLMGW_GATEWAY_QUEUE_MAX: 32 clients on 8 slots wait, none is refused
NGINX_INSTALL_TIMEOUT = 300

TARGETS = {
    "added_p50_ms": 0.5,
    "added_p99_ms": 2.0,
    "cpu_ms_request": 1.0,
    "cpu_ms_stream": 2.0,
    "ratio": 10.0,
}


# Processes -------------------------------------------------------------------------------------


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it


def _die_with_parent() -> None:
    """In the child, before exec: its own process group, and SIGTERM when the bench dies."""
    os.setsid()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Children:
    """Every process the bench starts, stopped (with its process group) however the bench ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(argv, preexec_fn=_die_with_parent, **kwargs)  # noqa: PLW1509 - no threads here
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[Any] | None) -> None:
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its group left behind
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree_cpu(root: int) -> float:
    """CPU seconds (user+system) of a process, its live descendants and their reaped children."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat(int(entry))
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    wanted = {root}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in wanted and pid not in wanted:
                wanted.add(pid)
                grew = True
    return sum(ticks.get(pid, 0) for pid in wanted) / os.sysconf("SC_CLK_TCK")


def wait_http(
    url: str,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
    check: Any = None,
    proc: subprocess.Popen[Any] | None = None,
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            request = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(request, timeout=2) as response:  # noqa: S310 - loopback
                body = response.read()
                if check is None or check(body):
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# Load generator (its own process) ---------------------------------------------------------------

CONTENT = re.compile(rb'"content":\s*"[^"]')


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


async def one_request(
    session: Any, url: str, body: bytes, headers: dict[str, str], stream: bool, state: dict[str, Any] | None = None
) -> tuple[float, float | None, str, int]:
    """(seconds to the last byte, seconds to the first content chunk, error or "", HTTP status)."""
    start = time.perf_counter()
    first = None
    error = ""
    async with session.post(url, data=body, headers=headers) as response:
        if not stream:
            data = await response.read()
            if response.status != 200 or b'"usage"' not in data:
                error = f"{response.status} {data[:160]!r}"
        else:
            last = b""
            counted = False
            async for chunk in response.content.iter_any():
                if first is None and CONTENT.search(last[-40:] + chunk):
                    first = time.perf_counter() - start
                    if state is not None:
                        state["open"] += 1
                        state["peak"] = max(state["peak"], state["open"])
                        counted = True
                if b'"error"' in chunk and not error:
                    error = f"error event: {chunk[:200]!r}"
                last = (last + chunk)[-200:]
            if counted and state is not None:
                state["open"] -= 1
            if response.status != 200:
                error = f"{response.status} {last[:160]!r}"
            elif not error and b"[DONE]" not in last:
                error = f"stream ended without [DONE]: {last[-120:]!r}"
            elif not error and first is None:
                error = "stream without content"
        status = response.status
    return time.perf_counter() - start, first, error, status


async def settled_cpu(pids: list[int], limit: float = 15.0) -> float:
    """The targets' CPU once they are quiet again: work a target deferred (a usage writer's batches,
    a logging queue) is part of what the phase cost."""
    last = sum(tree_cpu(pid) for pid in pids)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        now = sum(tree_cpu(pid) for pid in pids)
        if now - last < 0.015:  # under ~1 tick in half a second: idle
            return now
        last = now
    return last


async def run_phase(spec: dict[str, Any], phase: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    stream = bool(phase["stream"])
    body = json.dumps(
        {"model": phase["model"], "messages": PROMPT, "max_tokens": 16, **({"stream": True} if stream else {})}
    ).encode()
    headers = {"Content-Type": "application/json", **spec["headers"]}
    concurrency = int(phase["concurrency"])
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=0, keepalive_timeout=120, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    latencies: list[float] = []
    firsts: list[float] = []
    errors: list[str] = []
    statuses: dict[str, int] = {}  # answers other than 200, by status
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:

        async def batch(count: int, record: bool) -> None:
            left = count

            async def worker() -> None:
                nonlocal left
                while left > 0:
                    left -= 1
                    try:
                        total, first, error, status = await one_request(session, spec["url"], body, headers, stream)
                    except Exception as exc:  # noqa: BLE001 - count every failure, go on
                        total, first, error, status = 0.0, None, f"{type(exc).__name__}: {exc}", 0
                    if not record:
                        continue
                    if status != 200:
                        what = str(status) if status else "no answer"
                        statuses[what] = statuses.get(what, 0) + 1
                    if error:
                        errors.append(error)
                    else:
                        latencies.append(total)
                        if first is not None:
                            firsts.append(first)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await batch(int(phase["warmup"]), False)
        cpu0 = await settled_cpu(spec["pids"])
        t0 = time.perf_counter()
        await batch(int(phase["requests"]), True)
        elapsed = time.perf_counter() - t0
        cpu1 = await settled_cpu(spec["pids"])
    done = len(latencies)
    return {
        "name": phase["name"],
        "requests": phase["requests"],
        "ok": done,
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "statuses": statuses,
        "elapsed_s": elapsed,
        "rps": done / elapsed if elapsed else 0.0,
        "p50_ms": quantile(latencies, 0.5) * 1000,
        "p99_ms": quantile(latencies, 0.99) * 1000,
        "first_p50_ms": quantile(firsts, 0.5) * 1000,
        "first_p99_ms": quantile(firsts, 0.99) * 1000,
        "cpu_ms_per_request": (cpu1 - cpu0) * 1000 / max(phase["requests"], 1),
    }


async def run_open_streams(spec: dict[str, Any], phase: dict[str, Any]) -> dict[str, Any]:
    import aiohttp

    body = json.dumps({"model": phase["model"], "messages": PROMPT, "max_tokens": 16, "stream": True}).encode()
    headers = {"Content-Type": "application/json", **spec["headers"]}
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=120)
    state = {"open": 0, "peak": 0}
    errors: list[str] = []
    durations: list[float] = []
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120), auto_decompress=False
    ) as session:

        async def one() -> None:
            try:
                total, _first, error, _status = await one_request(session, spec["url"], body, headers, True, state)
            except Exception as exc:  # noqa: BLE001 - count every failure
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            if error:
                errors.append(error)
            else:
                durations.append(total)

        cpu0 = await settled_cpu(spec["pids"])
        t0 = time.perf_counter()
        tasks = []
        for i in range(int(phase["requests"])):
            tasks.append(asyncio.create_task(one()))
            if i % 250 == 249:
                await asyncio.sleep(0.05)  # connect in bursts of 250, not 2,000 SYNs at once
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        cpu1 = await settled_cpu(spec["pids"])
    return {
        "name": phase["name"],
        "requests": phase["requests"],
        "ok": len(durations),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:3],
        "peak_open": state["peak"],
        "elapsed_s": elapsed,
        "p50_s": quantile(durations, 0.5),
        "max_s": max(durations) if durations else float("nan"),
        "cpu_ms_per_request": (cpu1 - cpu0) * 1000 / max(phase["requests"], 1),
    }


async def run_rotation(phase: dict[str, Any]) -> dict[str, Any]:
    """One request at a time to each of several targets in turn (the order rotating every round), so
    that what each adds over the first is measured in the same moments, whatever else the machine does."""
    import aiohttp

    stream = bool(phase["stream"])
    targets = phase["rotation"]
    timeout = aiohttp.ClientTimeout(total=120)
    sessions = [
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1, keepalive_timeout=120), timeout=timeout, auto_decompress=False
        )
        for _ in targets
    ]
    bodies = [
        json.dumps(
            {"model": t["model"], "messages": PROMPT, "max_tokens": 16, **({"stream": True} if stream else {})}
        ).encode()
        for t in targets
    ]
    headers = [{"Content-Type": "application/json", **t["headers"]} for t in targets]
    seen: list[dict[str, Any]] = [{"latencies": [], "firsts": [], "errors": []} for _ in targets]
    try:
        for i in range(int(phase["warmup"]) + int(phase["requests"])):
            for j in range(len(targets)):
                k = (i + j) % len(targets)
                try:
                    total, first, error, _status = await one_request(
                        sessions[k], targets[k]["url"], bodies[k], headers[k], stream
                    )
                except Exception as exc:  # noqa: BLE001 - count every failure, go on
                    total, first, error = 0.0, None, f"{type(exc).__name__}: {exc}"
                if i < int(phase["warmup"]):
                    continue
                if error:
                    seen[k]["errors"].append(error)
                    continue
                seen[k]["latencies"].append(total)
                if first is not None:
                    seen[k]["firsts"].append(first)
    finally:
        for session in sessions:
            await session.close()
    return {
        "name": phase["name"],
        "rounds": phase["requests"],
        "targets": {
            t["label"]: {
                "ok": len(x["latencies"]),
                "errors": len(x["errors"]),
                "error_samples": sorted(set(x["errors"]))[:3],
                "p50_ms": quantile(x["latencies"], 0.5) * 1000,
                "p99_ms": quantile(x["latencies"], 0.99) * 1000,
                "first_p50_ms": quantile(x["firsts"], 0.5) * 1000,
                "first_p99_ms": quantile(x["firsts"], 0.99) * 1000,
            }
            for t, x in zip(targets, seen, strict=True)
        },
    }


async def loadgen_main(spec: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for phase in spec["phases"]:
        if phase.get("open_streams"):
            results.append(await run_open_streams(spec, phase))
        elif phase.get("rotation"):
            results.append(await run_rotation(phase))
        else:
            results.append(await run_phase(spec, phase))
    return results


def loadgen() -> None:
    raise_nofile()
    spec = json.loads(sys.stdin.read())
    try:
        import uvloop

        results = uvloop.run(loadgen_main(spec))
    except ImportError:
        results = asyncio.run(loadgen_main(spec))
    print(json.dumps(results))


def drive(
    children: Children, url: str, headers: dict[str, str], pids: list[int], phases: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Run phases in a load-generator process of its own; results by phase name."""
    spec = {"url": url, "headers": headers, "pids": pids, "phases": phases}
    proc = children.start(
        [PYTHON, __file__, "--loadgen"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    out, _ = proc.communicate(json.dumps(spec))
    children.procs.remove(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed ({proc.returncode})")
    return {r["name"]: r for r in json.loads(out)}


def rotation_phases(targets: list[dict[str, Any]], quick: bool) -> list[dict[str, Any]]:
    """c=1 to each target in turn, non-streamed and streamed: "hop" and "hops"."""
    rounds = ROTATION_ROUNDS // (4 if quick else 1)
    return [
        {"name": name, "rotation": targets, "stream": stream, "requests": rounds, "warmup": C1_WARMUP}
        for name, stream in (("hop", False), ("hops", True))
    ]


def rotation_targets(
    mock_ports: dict[str, int], hop_url: str, url: str, headers: dict[str, str]
) -> list[dict[str, Any]]:
    """direct, nginx (when it runs), and one llmgw's external and replica models, taken in turn."""
    auth = {"Authorization": "Bearer sk-mock-dummy"}
    targets = [
        {
            "label": "direct",
            "url": f"http://127.0.0.1:{mock_ports['fast']}/v1/chat/completions",
            "headers": auth,
            "model": "mock",
        }
    ]
    if hop_url:
        targets.append({"label": "nginx", "url": hop_url, "headers": auth, "model": "mock"})
    targets += [
        {"label": "external", "url": url, "headers": headers, "model": "mock"},
        {"label": "replica", "url": url, "headers": headers, "model": REPLICA_MODEL},
    ]
    return targets


def standard_phases(model: str, paced_model: str, quick: bool) -> list[dict[str, Any]]:
    scale = 4 if quick else 1
    return [
        {
            "name": "c1",
            "model": model,
            "stream": False,
            "concurrency": 1,
            "requests": C1_REQUESTS // scale,
            "warmup": C1_WARMUP,
        },
        {
            "name": "c1s",
            "model": model,
            "stream": True,
            "concurrency": 1,
            "requests": C1_REQUESTS // scale,
            "warmup": C1_WARMUP,
        },
        {
            "name": "c32",
            "model": model,
            "stream": False,
            "concurrency": 32,
            "requests": C32_REQUESTS // scale,
            "warmup": C32_WARMUP,
        },
        {
            "name": "c32s",
            "model": model,
            "stream": True,
            "concurrency": 32,
            "requests": C32_REQUESTS // scale,
            "warmup": C32_WARMUP,
        },
        {
            "name": "paced",
            "model": paced_model,
            "stream": True,
            "concurrency": 32,
            "requests": PACED_REQUESTS // scale,
            "warmup": 64,
        },
    ]


# Targets ----------------------------------------------------------------------------------------

SETUP = """
import sys, json
import django
django.setup()
from apps.accounts.models import User
from apps.accounts.services import create_api_key
from apps.catalog.models import Model, Profile
from apps.catalog.services import apply_models
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.cluster.models import Node, Replica, Shard
from apps.quotas.models import RateLimit
fast, slow, paced, key_file, replica_ports, slots = sys.argv[1:7]
user = User.objects.create_user("bench@example.com", None, name="Bench")
new = create_api_key(user, name="bench", actor=None)
# Generous limits, so every request goes through the limiter as a limited key's would.
RateLimit.objects.create(api_key=new.key, requests_per_minute=10**9, tokens_per_minute=10**12,
                         tokens_per_day=10**12, monthly_token_budget=10**13)
spec = {"models": [
    {"name": name, "external": {"url": url, "model": "mock", "api_key_file": key_file}, "replicas": 0}
    for name, url in (("mock", fast), ("mock-slow", slow), ("mock-paced", paced))]}
apply_models(spec, actor=None)
# Replicas whose engine is the mock: ready, on a ready node; with no worker running, nothing
# reconciles them away. Their requests take and give back a slot of `slots`.
node = Node.objects.create(name="bench", status=NodeStatus.READY, address="127.0.0.1")
for pair in replica_ports.split(","):
    name, port = pair.split("=")
    model = Model.objects.create(name=name, min_replicas=1, max_replicas=1, source=f"/models/{name}.gguf")
    profile = Profile.objects.create(model=model, name="cpu", engine="llama.cpp", accelerator="cpu",
                                     memory_bytes=1024**3, cpu_cores=1, parallel=int(slots))
    replica = Replica.objects.create(model=model, profile=profile, state=ReplicaState.READY)
    Shard.objects.create(replica=replica, node=node, rank=0, port=int(port), secret="s")
print(new.secret)
"""
MODELS = ("mock", "mock-slow", "mock-paced", REPLICA_MODEL, REPLICA_PACED_MODEL)


def prepare_llmgw(
    tmp: Path, mock_ports: dict[str, int], env_extra: dict[str, str], label: str
) -> tuple[dict[str, str], str, Path]:
    """Migrate a fresh database and create the bench's key and models: (environment, API key, data dir)."""
    data = tmp / label
    data.mkdir()
    key_file = data / "upstream.key"
    key_file.write_text("sk-mock-dummy\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "PROMETHEUS_"))}
    env.update(
        {
            "LLMGW_DATA_DIR": str(data),
            "LLMGW_LOG_LEVEL": "warning",
            "DJANGO_SETTINGS_MODULE": "llmgw.settings",
            "LLMGW_GATEWAY_QUEUE_MAX": str(QUEUE_MAX),
            **env_extra,
        }
    )
    subprocess.run([PYTHON, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, check=True, cwd=REPO)
    urls = [f"http://127.0.0.1:{mock_ports[m]}/v1" for m in ("fast", "slow", "paced")]
    replicas = f"{REPLICA_MODEL}={mock_ports['replica']},{REPLICA_PACED_MODEL}={mock_ports['replica_paced']}"
    secret = (
        subprocess.run(
            [PYTHON, "-c", SETUP, *urls, str(key_file), replicas, str(SLOTS)],
            env=env,
            check=True,
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    print(f"  {label}: API key {secret}")
    return env, secret, data


def start_web(
    children: Children, env: dict[str, str], secret: str, data: Path, workers: int = 1
) -> tuple[subprocess.Popen[Any], int]:
    port = free_port()
    log = data / f"web-{workers}.log"
    with log.open("w") as handle:
        web = children.start(
            [PYTHON, "-m", "llmgw", "web", "--listen", f"127.0.0.1:{port}", "--workers", str(workers)],
            env=env,
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )

    def lists_all(body: bytes) -> bool:
        ids = {m.get("id") for m in json.loads(body).get("data", [])}
        return set(MODELS) <= ids

    if not wait_http(
        f"http://127.0.0.1:{port}/v1/models",
        headers={"Authorization": f"Bearer {secret}"},
        timeout=90,
        check=lists_all,
        proc=web,
    ):
        raise RuntimeError(f"llmgw web did not come up or list the models:\n{tail(log)}")
    if workers > 1:
        wait_quiet(web.pid)  # the first to answer is up; the others are once the tree stops importing
    return web, port


def wait_quiet(pid: int, limit: float = 60.0) -> None:
    """Until a process tree uses under ~1 CPU tick in half a second (or `limit` passes)."""
    last = tree_cpu(pid)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = tree_cpu(pid)
        if now - last < 0.015:
            return
        last = now


def mock_stats(port: int, reset: bool = False) -> dict[str, int]:
    """What one of the mock's ports held: in_flight, max_in_flight, requests (reset: start counting again)."""
    url = f"http://127.0.0.1:{port}/__stats" + ("/reset" if reset else "")
    request = urllib.request.Request(url, data=b"" if reset else None, method="POST" if reset else "GET")
    with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310 - loopback
        return json.loads(response.read())


def drive_replica(
    children: Children,
    url: str,
    headers: dict[str, str],
    web: subprocess.Popen[Any],
    mock_ports: dict[str, int],
    quick: bool,
) -> dict[str, Any]:
    """The standard phases on the replica models, and the most requests their ports held at once."""
    for which in ("replica", "replica_paced"):
        mock_stats(mock_ports[which], reset=True)
    results = drive(children, url, headers, [web.pid], standard_phases(REPLICA_MODEL, REPLICA_PACED_MODEL, quick))
    stats = {which: mock_stats(mock_ports[which]) for which in ("replica", "replica_paced")}
    return {
        "results": results,
        "held": {w: s["max_in_flight"] for w, s in stats.items()},
        "reached": {w: s["requests"] for w, s in stats.items()},
    }


# nginx: the floor of one proxy hop --------------------------------------------------------------


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.access(p, os.X_OK)), None
    )


def ensure_nginx() -> tuple[str | None, str]:
    """(nginx's path, "") when it is installed or could be installed now; else (None, why not)."""
    found = find_nginx()
    if found:
        return found, ""
    if shutil.which("apt-get") is None:
        return None, "nginx is not installed and there is no apt-get here to install it"
    if os.geteuid() != 0:
        return None, "nginx is not installed, and installing it (apt-get install -y nginx) needs root"
    print("  nginx is missing: apt-get install -y nginx ...", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    why = ""
    for steps in (
        [["apt-get", "install", "-y", "-q", "nginx"]],
        [["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "nginx"]],
    ):
        for argv in steps:
            try:
                done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=NGINX_INSTALL_TIMEOUT)
            except subprocess.TimeoutExpired:
                why = f"`{' '.join(argv)}` took more than {NGINX_INSTALL_TIMEOUT} s"
                break
            if done.returncode != 0:
                lines = [line for line in done.stderr.splitlines() if line.strip()]
                why = f"`{' '.join(argv)}` failed: {lines[-1] if lines else done.returncode}"
                break
        else:
            found = find_nginx()
            if found:
                return found, ""
            why = "apt-get installed nginx but no nginx binary is on PATH or in /usr/sbin"
    return None, why


def nginx_config(folder: Path, listen: dict[str, int], mock_ports: dict[str, int]) -> str:
    """A plain keep-alive reverse proxy: one listening port per mock port it fronts."""
    upstreams = "".join(
        f"""
    upstream mock_{name} {{
        server 127.0.0.1:{mock_ports[name]};
        keepalive 64;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://mock_{name};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}"""
        for name, port in listen.items()
    )
    return f"""worker_processes 1;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{
    worker_connections 8192;
}}
http {{
    access_log off;
    client_body_temp_path {folder}/client_body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    keepalive_timeout 120s;
    keepalive_requests 1000000;{upstreams}
}}
"""


def start_nginx(
    children: Children, nginx: str, tmp: Path, mock_ports: dict[str, int]
) -> tuple[subprocess.Popen[Any], dict[str, int], str]:
    """nginx in the foreground, a child of the bench: (process, its port for each mock port, its version)."""
    folder = tmp / "nginx"
    folder.mkdir()
    listen = {"fast": free_port(), "paced": free_port()}
    config = folder / "nginx.conf"
    config.write_text(nginx_config(folder, listen, mock_ports))
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip().rsplit("/", 1)[-1]
    log = folder / "nginx.log"
    with log.open("w") as handle:
        proc = children.start(
            [nginx, "-p", str(folder), "-e", str(folder / "error.log"), "-c", str(config), "-g", "daemon off;"],
            cwd=folder,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    # the mock answers /__stats: through nginx, that proves the whole hop
    if not wait_http(f"http://127.0.0.1:{listen['fast']}/__stats", timeout=30, proc=proc):
        raise RuntimeError(f"nginx did not start:\n{tail(log)}\n{tail(folder / 'error.log')}")
    return proc, listen, version


LITELLM_CONFIG = """\
model_list:
  - model_name: mock
    litellm_params:
      model: openai/mock
      api_base: http://127.0.0.1:{fast}/v1
      api_key: sk-mock-dummy
  - model_name: mock-paced
    litellm_params:
      model: openai/mock
      api_base: http://127.0.0.1:{paced}/v1
      api_key: sk-mock-dummy
litellm_settings:
  telemetry: false
general_settings:
  master_key: {master}
"""

# Same as llmgw's: no access log lines (llmgw web runs at LLMGW_LOG_LEVEL=warning).
UVICORN_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"default": {"format": "%(levelname)s %(name)s %(message)s"}},
    "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "default", "stream": "ext://sys.stderr"}},
    "loggers": {
        "uvicorn": {"handlers": ["default"], "level": "WARNING"},
        "uvicorn.error": {"level": "WARNING"},
        "uvicorn.access": {"handlers": ["default"], "level": "WARNING", "propagate": False},
    },
}


def ensure_litellm() -> str | None:
    """None when LiteLLM is ready in its venv, else why not."""
    python = LITELLM_VENV / "bin" / "python"
    probe = "import importlib.metadata as m; print(m.version('litellm'))"
    if python.exists():
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
        if found.stdout.strip() == LITELLM_VERSION and (LITELLM_VENV / "bin" / "litellm").exists():
            return None
    print(
        f"  installing litellm[proxy]=={LITELLM_VERSION} into {LITELLM_VENV} (up to "
        f"{LITELLM_INSTALL_TIMEOUT // 60} min) ...",
        flush=True,
    )
    deadline = time.monotonic() + LITELLM_INSTALL_TIMEOUT
    try:
        if not python.exists():
            subprocess.run(
                [PYTHON, "-m", "venv", str(LITELLM_VENV)], check=True, capture_output=True, text=True, timeout=120
            )
        done = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
            capture_output=True,
            text=True,
            timeout=max(30.0, deadline - time.monotonic()),
        )
    except subprocess.TimeoutExpired:
        return f"the install took more than {LITELLM_INSTALL_TIMEOUT // 60} minutes"
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"could not create the venv: {exc}"
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        return f"pip install failed: {lines[-1] if lines else done.returncode}"
    return None


def start_litellm(children: Children, tmp: Path, mock_ports: dict[str, int]) -> tuple[subprocess.Popen[Any], str, int]:
    master = "sk-bench-" + uuid.uuid4().hex
    folder = tmp / "litellm"
    folder.mkdir()
    config = folder / "config.yaml"
    config.write_text(LITELLM_CONFIG.format(fast=mock_ports["fast"], paced=mock_ports["paced"], master=master))
    log_config = folder / "log.json"
    log_config.write_text(json.dumps(UVICORN_LOG_CONFIG))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LLMGW_", "DATABASE_URL", "LITELLM_", "PROMETHEUS_", "REDIS_"))
    }
    env.update(
        {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_TELEMETRY": "False",
            "LITELLM_LOG": "ERROR",
            "DISABLE_SCHEMA_UPDATE": "True",
            "NO_DOCS": "True",
            "HOME": str(folder),
        }
    )
    port = free_port()
    log = folder / "litellm.log"
    with log.open("w") as handle:
        proc = children.start(
            [
                str(LITELLM_VENV / "bin" / "litellm"),
                "--config",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
                "--log_config",
                str(log_config),
            ],
            env=env,
            cwd=folder,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
    if not wait_http(f"http://127.0.0.1:{port}/health/liveliness", timeout=180, proc=proc):
        raise RuntimeError(f"LiteLLM did not start:\n{tail(log)}")
    return proc, master, port


# Report -----------------------------------------------------------------------------------------


def fmt(value: float, digits: int = 2) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


ROWS = [
    ("c=1 non-streamed latency p50 (ms)", "c1", "p50_ms", 3),
    ("c=1 non-streamed latency p99 (ms)", "c1", "p99_ms", 3),
    ("c=1 stream first content p50 (ms)", "c1s", "first_p50_ms", 3),
    ("c=1 stream first content p99 (ms)", "c1s", "first_p99_ms", 3),
    ("c=1 stream last byte p50 (ms)", "c1s", "p50_ms", 3),
    ("c=32 non-streamed req/s", "c32", "rps", 0),
    ("c=32 streams/s (16 chunks)", "c32s", "rps", 0),
    ("c=32 non-streamed p50 (ms)", "c32", "p50_ms", 2),
    ("c=32 non-streamed p99 (ms)", "c32", "p99_ms", 2),
    ("c=32 stream first content p50 (ms)", "c32s", "first_p50_ms", 2),
    ("CPU ms / non-streamed req (c=32)", "c32", "cpu_ms_per_request", 3),
    ("CPU ms / 16-chunk stream (c=32)", "c32s", "cpu_ms_per_request", 3),
    ("CPU ms / non-streamed req (c=1)", "c1", "cpu_ms_per_request", 3),
    ("CPU ms / 16-chunk stream (c=1)", "c1s", "cpu_ms_per_request", 3),
    ("paced streams/s (1 ms apart, c=32)", "paced", "rps", 0),
    ("CPU ms / paced 16-chunk stream", "paced", "cpu_ms_per_request", 3),
]
WIDTH = 14


def table(results: dict[str, dict[str, dict[str, Any]]], extra: tuple[tuple[str, dict[str, str]], ...] = ()) -> None:
    names = list(results)
    print(f"{'':38}" + "".join(f"{n:>{WIDTH}}" for n in names))
    for label, phase, field, digits in ROWS:
        print(f"{label:38}" + "".join(f"{fmt(results[n][phase][field], digits):>{WIDTH}}" for n in names))
    errors = {n: sum(r["errors"] for r in results[n].values()) for n in names}
    print(f"{'errors (all phases)':38}" + "".join(f"{errors[n]:>{WIDTH}}" for n in names))
    for label, cells in extra:
        print(f"{label:38}" + "".join(f"{cells.get(n, '—'):>{WIDTH}}" for n in names))
    for n in names:
        for r in results[n].values():
            for sample in r["error_samples"]:
                print(f"  {n} {r['name']}: {sample}")


def added(ours: dict[str, dict[str, Any]], base: dict[str, dict[str, Any]], phase: str, field: str) -> float:
    return float(ours[phase][field] - base[phase][field])


def times(ours: float, theirs: float) -> str:
    """ours as a multiple of theirs; "n/a" where either is not measurably above zero."""
    if math.isnan(ours) or math.isnan(theirs) or theirs < 0.001 or ours < 0.001:
        return "n/a"
    return f"{ours / theirs:.1f}x"


def non_200(results: dict[str, dict[str, Any]]) -> tuple[int, str]:
    """How many answers were not 200 in a set of phases, and which, by status."""
    counts: dict[str, int] = {}
    for r in results.values():
        for status, count in r.get("statuses", {}).items():
            counts[status] = counts.get(status, 0) + count
    total = sum(counts.values())
    return total, ", ".join(f"{count} x {status}" for status, count in sorted(counts.items()))


def held_line(entry: dict[str, Any]) -> str:
    held = entry["held"]
    most = max(held.values())
    total, which = non_200(entry["results"])
    return (
        f"  most requests the replica held at once: {most} of its {SLOTS} slots "
        f"({'OK' if most <= SLOTS else 'EXCEEDED'}; 16-chunk streams {held['replica']}, paced streams "
        f"{held['replica_paced']}); non-200 answers: {total}{f' ({which})' if which else ''}; "
        f"{sum(entry['reached'].values())} requests reached the replicas"
    )


def over(rot: dict[str, Any], target: str, field: str) -> float:
    """What a target of a rotation took over direct, in the same rounds."""
    return float(rot["targets"][target][field] - rot["targets"]["direct"][field])


HOP_PHASES = (("hop", "non-streamed", ""), ("hops", "streams' first content", "first_"))


def hop_lines(rot: dict[str, dict[str, Any]]) -> list[str]:
    """llmgw's external path next to one nginx hop, both against direct in the same c=1 rounds."""
    lines = []
    for phase, what, f in HOP_PHASES:
        r = rot[phase]
        ext50, ext99 = over(r, "external", f + "p50_ms"), over(r, "external", f + "p99_ms")
        head = f"  c=1, {r['rounds']} rounds in turn with direct"
        if "nginx" in r["targets"]:
            n50, n99 = over(r, "nginx", f + "p50_ms"), over(r, "nginx", f + "p99_ms")
            multiples = times(ext50, n50), times(ext99, n99)
            lines.append(
                f"{head} and nginx, {what}: llmgw adds p50 {ext50:+.3f} ms, p99 {ext99:+.3f} ms; one nginx "
                f"hop p50 {n50:+.3f} ms, p99 {n99:+.3f} ms: llmgw adds {multiples[0]} (p50) and "
                f"{multiples[1]} (p99) what one nginx hop adds"
                + (" (n/a: one of the two is not measurably above zero)" if "n/a" in multiples else "")
            )
        else:
            lines.append(f"{head}, {what}: llmgw adds p50 {ext50:+.3f} ms, p99 {ext99:+.3f} ms (no nginx in this run)")
    for sample in (x for t in rot["hop"]["targets"].values() for x in t["error_samples"]):
        lines.append(f"  error: {sample}")
    return lines


def report(
    results: dict[str, dict[str, dict[str, Any]]],
    replica: dict[str, dict[str, Any]],
    hops: dict[str, dict[str, dict[str, Any]]],
    open_streams: dict[str, Any] | None,
    litellm_note: str,
    nginx_note: str,
    verdicts: Report,
) -> None:
    names = list(results)
    print()
    print("=" * 100)
    print(
        f"Gateway bench: {os.cpu_count()} CPUs, loopback; load generator, mock upstream and each target in "
        "separate processes"
    )
    print("=" * 100)
    table(results)
    print("(direct: the CPU column is the mock upstream's own; others: the gateway process tree's.)")
    for note in (nginx_note, litellm_note):
        if note:
            print(note)

    direct = results["direct"]
    hop = results.get("nginx")
    print()
    print("-" * 100)
    if hop is not None:
        print("[nginx] one reverse-proxy hop, the floor for any gateway in between")
        print(
            f"  latency added over direct, c=1, non-streamed: p50 {added(hop, direct, 'c1', 'p50_ms'):+.3f} ms, "
            f"p99 {added(hop, direct, 'c1', 'p99_ms'):+.3f} ms"
        )
        print(
            f"  first-byte time added for streams, c=1: p50 {added(hop, direct, 'c1s', 'first_p50_ms'):+.3f} ms, "
            f"p99 {added(hop, direct, 'c1s', 'first_p99_ms'):+.3f} ms"
        )
        print(
            f"  requests/s at c=32: non-streamed {hop['c32']['rps']:.0f} (direct {direct['c32']['rps']:.0f}), "
            f"streams {hop['c32s']['rps']:.0f} (direct {direct['c32s']['rps']:.0f})"
        )
        print(
            f"  nginx CPU per non-streamed request: {hop['c32']['cpu_ms_per_request']:.3f} ms; per 16-chunk "
            f"stream {hop['c32s']['cpu_ms_per_request']:.3f} ms, {hop['paced']['cpu_ms_per_request']:.3f} ms "
            "paced"
        )
        for phase, what, f in HOP_PHASES:
            during = [
                f"{over(rot[phase], 'nginx', f + 'p50_ms'):+.3f} / "
                f"{over(rot[phase], 'nginx', f + 'p99_ms'):+.3f} ms (with {name})"
                for name, rot in hops.items()
                if "nginx" in rot[phase]["targets"]
            ]
            if during:
                print(f"  in turn with direct, c=1, {what}, p50 / p99 added: " + ", ".join(during))
    for name in [n for n in names if n.startswith("llmgw")]:
        ours = results[name]
        add50 = ours["c1"]["p50_ms"] - direct["c1"]["p50_ms"]
        add99 = ours["c1"]["p99_ms"] - direct["c1"]["p99_ms"]
        f50 = ours["c1s"]["first_p50_ms"] - direct["c1s"]["first_p50_ms"]
        f99 = ours["c1s"]["first_p99_ms"] - direct["c1s"]["first_p99_ms"]
        cpu_req = ours["c32"]["cpu_ms_per_request"]
        cpu_stream = ours["c32s"]["cpu_ms_per_request"]
        cpu_paced = ours["paced"]["cpu_ms_per_request"]
        print(f"[{name}]")
        print(f"  latency added over direct, c=1, non-streamed: p50 {add50:+.3f} ms, p99 {add99:+.3f} ms")
        verdicts.target(f"{name} added p50", measured=add50, limit=TARGETS["added_p50_ms"], unit=" ms")
        verdicts.target(f"{name} added p99", measured=add99, limit=TARGETS["added_p99_ms"], unit=" ms")
        print(f"  first-byte time added for streams, c=1: p50 {f50:+.3f} ms, p99 {f99:+.3f} ms (held to the same)")
        verdicts.target(f"{name} stream first byte added p50", measured=f50, limit=TARGETS["added_p50_ms"], unit=" ms")
        verdicts.target(f"{name} stream first byte added p99", measured=f99, limit=TARGETS["added_p99_ms"], unit=" ms")
        rot = hops.get(name)
        if rot is not None:
            for line in hop_lines(rot):
                print(line)
        if hop is not None:
            print(
                f"  CPU per request at c=32: {times(cpu_req, hop['c32']['cpu_ms_per_request'])} nginx's, per "
                f"stream {times(cpu_stream, hop['c32s']['cpu_ms_per_request'])}"
            )
        print(
            f"  requests/s at c=32: non-streamed {ours['c32']['rps']:.0f} (direct {direct['c32']['rps']:.0f}), "
            f"streams {ours['c32s']['rps']:.0f} (direct {direct['c32s']['rps']:.0f})"
        )
        print(f"  gateway CPU per non-streamed request: {cpu_req:.3f} ms")
        verdicts.target(f"{name} CPU per request", measured=cpu_req, limit=TARGETS["cpu_ms_request"], unit=" ms")
        print(
            f"  gateway CPU per 16-chunk stream: {cpu_stream:.3f} ms as the mock sends it, {cpu_paced:.3f} ms "
            "with every chunk arriving on its own (the target is for the larger)"
        )
        worst_stream = max(cpu_stream, cpu_paced)
        verdicts.target(f"{name} CPU per stream", measured=worst_stream, limit=TARGETS["cpu_ms_stream"], unit=" ms")
        if "LiteLLM" in results:
            lite = results["LiteLLM"]
            for phase, what in (("c32", "non-streamed"), ("c32s", "streamed")):
                tput = ours[phase]["rps"] / max(lite[phase]["rps"], 1e-9)
                cpu = ours[phase]["cpu_ms_per_request"] / max(lite[phase]["cpu_ms_per_request"], 1e-9)
                print(
                    f"  llmgw/LiteLLM, {what}: throughput {tput:.1f}x; CPU per request {cpu:.3f}x "
                    f"(LiteLLM uses {1 / max(cpu, 1e-9):.1f}x the CPU)"
                )
                verdicts.target(
                    f"{name}/LiteLLM {what} throughput", measured=tput, limit=TARGETS["ratio"], unit="x", higher=True
                )
            paced = ours["paced"]["cpu_ms_per_request"] / max(lite["paced"]["cpu_ms_per_request"], 1e-9)
            print(
                f"  llmgw/LiteLLM, paced streams: throughput "
                f"{ours['paced']['rps'] / max(lite['paced']['rps'], 1e-9):.1f}x; CPU per stream {paced:.3f}x"
            )
        else:
            for what in ("non-streamed", "streamed"):
                verdicts.not_measured(f"{name}/LiteLLM {what} throughput", litellm_note or "no LiteLLM in this run")
    if open_streams is not None:
        r = open_streams
        print(
            f"[llmgw] {r['requests']} concurrent streams (~5 s each, a chunk every 0.5 s): {r['ok']} finished "
            f"without error, {r['errors']} errors, peak {r['peak_open']} open at once, all done in "
            f"{r['elapsed_s']:.1f} s (stream p50 {r['p50_s']:.2f} s, max {r['max_s']:.2f} s), "
            f"gateway CPU {r['cpu_ms_per_request']:.2f} ms per stream"
        )
        failed = r["requests"] - r["ok"] + r["errors"]
        verdicts.target(f"{OPEN_STREAMS} open streams failed", measured=failed, limit=0)
        for sample in r["error_samples"]:
            print(f"  {sample}")
    else:
        verdicts.not_measured(f"{OPEN_STREAMS} open streams failed", "not run")
    print("-" * 100)
    if replica:
        report_replica(results, replica, hops, verdicts)


def report_replica(
    results: dict[str, dict[str, dict[str, Any]]],
    replica: dict[str, dict[str, Any]],
    hops: dict[str, dict[str, dict[str, Any]]],
    verdicts: Report,
) -> None:
    direct = results["direct"]
    print()
    print(
        f"Replica path: {REPLICA_MODEL} and {REPLICA_PACED_MODEL} (paced), replicas whose engine is the mock, "
        f"{SLOTS} slots each; the same phases, {QUEUE_MAX} may wait"
    )
    print(f"(paced streams last ~17 ms at the mock: {SLOTS} slots carry at most ~{SLOTS * 1000 // 17} a second)")
    print("=" * 100)
    cells = {}
    for name, entry in replica.items():
        most = max(entry["held"].values())
        cells[name] = f"{most} {'OK' if most <= SLOTS else 'EXCEEDED'}"
    table(
        {name: entry["results"] for name, entry in replica.items()},
        (
            (f"most held at once (of {SLOTS} slots)", cells),
            ("non-200 answers", {name: str(non_200(entry["results"])[0]) for name, entry in replica.items()}),
        ),
    )
    print("-" * 100)
    for name, entry in replica.items():
        ours = entry["results"]
        workers = name.endswith(" x2")
        base_name = name.removesuffix(" x2") if workers else name
        if workers:
            base, what = replica[base_name]["results"], "1 worker"
            print(f"[{name}] `llmgw web --workers 2` on the replica path, next to one worker ({base_name})")
        else:
            base, what = results[name], "external"
            counted = (
                "in the process"
                if name == "llmgw"
                else "in Redis: a Lua script takes one, a ZREM and a PUBLISH give it back"
            )
            print(f"[{name}] the replica path (slots counted {counted}) next to the external path (no slot)")
        a50, a99 = added(ours, direct, "c1", "p50_ms"), added(ours, direct, "c1", "p99_ms")
        b50, b99 = added(base, direct, "c1", "p50_ms"), added(base, direct, "c1", "p99_ms")
        f50, f99 = added(ours, direct, "c1s", "first_p50_ms"), added(ours, direct, "c1s", "first_p99_ms")
        g50, g99 = added(base, direct, "c1s", "first_p50_ms"), added(base, direct, "c1s", "first_p99_ms")
        delta = "" if workers else "the slot adds "
        print(
            f"  latency added over direct, c=1, non-streamed: p50 {a50:+.3f} ms ({what} {b50:+.3f}: {delta}"
            f"{a50 - b50:+.3f} ms), p99 {a99:+.3f} ms ({what} {b99:+.3f}: {delta}{a99 - b99:+.3f} ms)"
        )
        print(
            f"  first-byte time added for streams, c=1: p50 {f50:+.3f} ms ({what} {g50:+.3f}: {f50 - g50:+.3f}), "
            f"p99 {f99:+.3f} ms ({what} {g99:+.3f}: {f99 - g99:+.3f})"
        )
        print(
            "  requests/s at c=32: "
            + ", ".join(
                f"{label} {ours[phase]['rps']:.0f} ({what} {base[phase]['rps']:.0f}: "
                f"{ours[phase]['rps'] / max(base[phase]['rps'], 1e-9):.2f}x)"
                for phase, label in (("c32", "non-streamed"), ("c32s", "streams"), ("paced", "paced streams"))
            )
        )
        print(
            f"  c=32 latency: non-streamed p50 {ours['c32']['p50_ms']:.2f} ms, p99 {ours['c32']['p99_ms']:.2f} ms "
            f"({what} {base['c32']['p50_ms']:.2f} / {base['c32']['p99_ms']:.2f} ms)"
        )
        print(
            "  gateway CPU per request at c=32: "
            + ", ".join(
                f"{label} {ours[phase]['cpu_ms_per_request']:.3f} ms ({what} {base[phase]['cpu_ms_per_request']:.3f}: "
                f"{delta}{ours[phase]['cpu_ms_per_request'] - base[phase]['cpu_ms_per_request']:+.3f} ms)"
                for phase, label in (("c32", "non-streamed"), ("c32s", "per stream"))
            )
        )
        rot = hops.get(name)
        if rot is not None:
            for phase, what, f in HOP_PHASES:
                r = rot[phase]
                rep50, rep99 = over(r, "replica", f + "p50_ms"), over(r, "replica", f + "p99_ms")
                if workers and base_name in hops:
                    one = hops[base_name][phase]
                    o50, o99 = over(one, "replica", f + "p50_ms"), over(one, "replica", f + "p99_ms")
                    print(
                        f"  c=1, {r['rounds']} rounds in turn with direct, {what}: replica path p50 {rep50:+.3f} ms, "
                        f"p99 {rep99:+.3f} ms (1 worker, in its own rounds: {o50:+.3f} / {o99:+.3f} ms)"
                    )
                else:
                    e50, e99 = over(r, "external", f + "p50_ms"), over(r, "external", f + "p99_ms")
                    print(
                        f"  c=1, {r['rounds']} rounds in turn with direct and the external path, {what}: replica "
                        f"path p50 {rep50:+.3f} ms, p99 {rep99:+.3f} ms (external {e50:+.3f} / {e99:+.3f} ms: "
                        f"{delta}{rep50 - e50:+.3f} / {rep99 - e99:+.3f} ms)"
                    )
        print(held_line(entry))
        verdicts.target(f"{name} replica most held", measured=max(entry["held"].values()), limit=SLOTS)
        verdicts.target(f"{name} replica non-200 answers", measured=non_200(entry["results"])[0], limit=0)
    print("-" * 100)


# Main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pg", action="store_true", help="also run llmgw on PostgreSQL + Redis")
    lite = parser.add_mutually_exclusive_group()
    lite.add_argument(
        "--litellm",
        dest="litellm",
        action="store_true",
        default=True,
        help="compare with LiteLLM (the default; skipped with the reason when it fails)",
    )
    lite.add_argument("--no-litellm", dest="litellm", action="store_false")
    parser.add_argument("--quick", action="store_true", help="a quarter of the requests (a smoke run)")
    args = parser.parse_args()
    if args.loadgen:
        loadgen()
        return
    with Report(__doc__) as verdicts:
        run(args, verdicts)


def run(args: argparse.Namespace, verdicts: Report) -> None:
    """Every target under the same load, then the report (see the module's docstring)."""
    raise_nofile()
    # Ctrl-C and SIGTERM both end the run through the cleanup below (even where the shell that
    # started the bench in the background left SIGINT ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    children = Children()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-gw-"))
    database = ""
    results: dict[str, dict[str, dict[str, Any]]] = {}
    replica: dict[str, dict[str, Any]] = {}
    hops: dict[str, dict[str, dict[str, Any]]] = {}
    open_streams = None
    litellm_note = ""
    nginx_note = ""
    started = time.monotonic()
    try:
        litellm_reason = ensure_litellm() if args.litellm else "not asked for (--no-litellm)"

        mock_ports = {
            "fast": free_port(),
            "slow": free_port(),
            "paced": free_port(),
            "replica": free_port(),
            "replica_paced": free_port(),
        }
        mock = children.start(
            [
                PYTHON,
                str(REPO / "bench" / "mock_upstream.py"),
                "--fast",
                str(mock_ports["fast"]),
                "--slow",
                str(mock_ports["slow"]),
                "--paced",
                str(mock_ports["paced"]),
                "--replica",
                str(mock_ports["replica"]),
                "--replica-paced",
                str(mock_ports["replica_paced"]),
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        assert mock.stdout is not None
        if mock.stdout.readline().strip() != "ready":
            raise RuntimeError("the mock upstream did not start")
        phases = standard_phases("mock", "mock", args.quick)

        print("direct to the mock upstream ...", flush=True)
        direct_phases = [dict(p, model="mock") for p in phases]
        results["direct"] = drive(
            children,
            f"http://127.0.0.1:{mock_ports['fast']}/v1/chat/completions",
            {"Authorization": "Bearer sk-mock-dummy"},
            [mock.pid],
            direct_phases[:-1],
        )
        results["direct"].update(
            drive(
                children,
                f"http://127.0.0.1:{mock_ports['paced']}/v1/chat/completions",
                {"Authorization": "Bearer sk-mock-dummy"},
                [mock.pid],
                direct_phases[-1:],
            )
        )

        hop_url = ""  # nginx's, while it runs: the rotations of each llmgw configuration include it
        nginx_proc = None
        nginx, why = ensure_nginx()
        if nginx is None:
            nginx_note = f"nginx: skipped ({why})"
            print(nginx_note)
        else:
            print("nginx (one keep-alive proxy hop to the mock) ...", flush=True)
            try:
                nginx_proc, listen, version = start_nginx(children, nginx, tmp, mock_ports)
                auth = {"Authorization": "Bearer sk-mock-dummy"}
                results["nginx"] = drive(
                    children,
                    f"http://127.0.0.1:{listen['fast']}/v1/chat/completions",
                    auth,
                    [nginx_proc.pid],
                    direct_phases[:-1],
                )
                results["nginx"].update(
                    drive(
                        children,
                        f"http://127.0.0.1:{listen['paced']}/v1/chat/completions",
                        auth,
                        [nginx_proc.pid],
                        direct_phases[-1:],
                    )
                )
                hop_url = f"http://127.0.0.1:{listen['fast']}/v1/chat/completions"
                nginx_note = (
                    f"nginx {version}: 1 worker process, keep-alive upstream (64 idle connections), "
                    "proxy_buffering off, no access log"
                )
            except Exception as exc:  # noqa: BLE001 - optional
                nginx_note = f"nginx: skipped ({exc})"
                print(nginx_note)
                children.stop(nginx_proc)
                nginx_proc = None

        configs: list[tuple[str, dict[str, str]]] = [("llmgw", {})]
        if args.pg:
            try:
                import psycopg

                database = f"llmgw_bench_{uuid.uuid4().hex[:8]}"
                with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3) as conn:
                    conn.execute(f'CREATE DATABASE "{database}"')
                import redis

                redis.Redis.from_url(REDIS, socket_connect_timeout=3).ping()
                configs.append(
                    (
                        "llmgw-pg",
                        {
                            "LLMGW_DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}",
                            "LLMGW_REDIS_URL": REDIS,
                            "LLMGW_REDIS_PREFIX": f"bench-{uuid.uuid4().hex[:6]}",
                        },
                    )
                )
            except Exception as exc:  # noqa: BLE001 - optional
                print(f"llmgw on PostgreSQL+Redis: skipped ({type(exc).__name__}: {exc})")
        for label, extra in configs:
            print(f"{label} ({'PostgreSQL + Redis' if extra else 'SQLite, no Redis'}) ...", flush=True)
            env, secret, data = prepare_llmgw(tmp, mock_ports, extra, label)
            web, port = start_web(children, env, secret, data)
            headers = {"Authorization": f"Bearer {secret}"}
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            results[label] = drive(children, url, headers, [web.pid], standard_phases("mock", "mock-paced", args.quick))
            if label == "llmgw":
                print(f"  {OPEN_STREAMS} concurrent open streams through llmgw ...", flush=True)
                open_streams = drive(
                    children,
                    url,
                    headers,
                    [web.pid],
                    [{"name": "open", "open_streams": True, "model": "mock-slow", "requests": OPEN_STREAMS}],
                )["open"]
            print(f"  {label}: the replica models ({SLOTS} slots each) ...", flush=True)
            replica[label] = drive_replica(children, url, headers, web, mock_ports, args.quick)
            print(f"  {label}: c=1 in turn with direct{', nginx' if hop_url else ''} ...", flush=True)
            hops[label] = drive(
                children,
                url,
                headers,
                [],
                rotation_phases(rotation_targets(mock_ports, hop_url, url, headers), args.quick),
            )
            children.stop(web)
            if extra:  # several web processes need Redis
                print(
                    f"{label} x2 (`llmgw web --workers 2`, the same database and Redis): the replica models ...",
                    flush=True,
                )
                web, port = start_web(children, env, secret, data, workers=2)
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                replica[f"{label} x2"] = drive_replica(children, url, headers, web, mock_ports, args.quick)
                hops[f"{label} x2"] = drive(
                    children,
                    url,
                    headers,
                    [],
                    rotation_phases(rotation_targets(mock_ports, hop_url, url, headers), args.quick),
                )
                children.stop(web)
        children.stop(nginx_proc)

        if litellm_reason is None:
            print("LiteLLM proxy ...", flush=True)
            try:
                proc, master, port = start_litellm(children, tmp, mock_ports)
                results["LiteLLM"] = drive(
                    children,
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    {"Authorization": f"Bearer {master}"},
                    [proc.pid],
                    standard_phases("mock", "mock-paced", args.quick),
                )
                children.stop(proc)
                litellm_note = f"LiteLLM {LITELLM_VERSION}: proxy, 1 worker, no database, telemetry off"
            except Exception as exc:  # noqa: BLE001 - optional
                litellm_note = f"LiteLLM: skipped ({exc})"
                print(litellm_note)
        else:
            litellm_note = f"LiteLLM: skipped ({litellm_reason})"
            print(litellm_note)

        report(results, replica, hops, open_streams, litellm_note, nginx_note, verdicts)
        print(f"(bench took {time.monotonic() - started:.0f} s)")
    except KeyboardInterrupt:
        print("\ninterrupted; cleaning up", file=sys.stderr)
        sys.exit(130)
    finally:
        children.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)
        if database:
            with contextlib.suppress(Exception):
                import psycopg

                with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


if __name__ == "__main__":
    main()
