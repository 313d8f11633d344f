"""llmgw as production runs it, for real, in a test: separate processes on PostgreSQL and Redis.

    with Production(tmp_path) as prod:          # or production(tmp) in a module-scoped fixture
        load = prod.load()                      # clients sending gateway requests until stopped
        prod.kill("web"); prod.start("web")     # kill -9 a process, start it again
        prod.redis.stop(); prod.redis.start()   # Redis goes away, and comes back empty
        prod.postgres.cut(); prod.postgres.restore()
        answers = load.stop()
        prod.missing_usage(answers)             # request ids answered 2xx that have no usage row

What runs, each in its own process group with its output in `<tmp>/logs/<name>.log`:

- a Redis of its own (`redis-server --save "" --appendonly no`), so a test can stop it and start
  it again empty, as a Redis without persistence comes back;
- a fresh database on the suite's PostgreSQL, reached through a TCP proxy in a thread of the
  test, so a test can cut PostgreSQL off (new connections refused, open ones reset) and bring it
  back, as a PostgreSQL restart or a network partition would;
- `llmgw manage migrate`, then `llmgw web`, `llmgw worker --concurrency 2` and `llmgw beat`, all
  with LLMGW_DATABASE_URL at the proxy and LLMGW_REDIS_URL at the private Redis;
- an administrator and an API key, and one `llmgw agent` on fixture hardware (tests.fleet) whose
  agent.yaml names the real llama-server;
- a `tiny` model (the random-weight GGUF of tests.ggufgen: parallel 2, context 512, 1 GB, one
  core) applied and waited on until the gateway serves it.

The test process reads usage rows and node rows straight from PostgreSQL (not through the
proxy), so it can look while the processes cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.helpers import REPO, alive, drop_pg_database, free_port, llmgw_env, pg_database_url

__all__ = [
    "Answer",
    "LoadGenerator",
    "NodeWatch",
    "PgProxy",
    "Production",
    "RedisServer",
    "Service",
    "missing_reason",
    "production",
]

MODEL = "tiny"
NODE = "cpu1"
USAGE_TABLE = "quotas_usagerecord"
NODE_TABLE = "cluster_node"

SETUP = """
from apps.accounts.models import User
from apps.accounts.services import create_api_key
from apps.cluster.enrolment import create_enrollment
admin = User.objects.create_superuser("ops@example.com", "correct horse battery", name="Operator")
key = create_api_key(admin, name="faults", actor=admin)
enrollment = create_enrollment({node!r}, actor=admin)
print("KEY=" + key.secret)
print("TOKEN=" + enrollment.secret)
"""


def missing_reason() -> str | None:
    """Why this set-up cannot run here, or None when it can."""
    if os.environ.get("LLMGW_TEST_BACKEND") != "postgres":
        return "the production set-up runs on PostgreSQL (LLMGW_TEST_BACKEND=postgres)"
    if not os.environ.get("LLMGW_DATABASE_URL", "").startswith("postgres"):
        return "LLMGW_DATABASE_URL does not name a PostgreSQL server"
    if shutil.which("redis-server") is None:
        return "no redis-server on PATH"
    from tests.enginebin import llama_server_path
    from tests.enginebin import missing_reason as no_engine

    if llama_server_path() is None:
        return no_engine()
    from tests.fleet import fixtures_available

    if not fixtures_available():
        return "no captured hardware fixtures (../shared/fixtures)"
    return None


def wait_for[T](
    check: Callable[[], T | None],
    what: str,
    timeout: float = 60.0,
    every: float = 0.3,
    details: Callable[[], str] | None = None,
) -> T:
    """The first truthy value of check(), or AssertionError after `timeout` seconds (with details())."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except Exception as exc:  # a check that cannot look yet (a process starting) looks again
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(every)
    raise AssertionError(
        f"timed out after {timeout:g} s waiting for {what}; last: {last!r}" + (f"\n{details()}" if details else "")
    )


def _cmdline(pid: int) -> list[str]:
    try:
        return [
            part.decode(errors="replace") for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part
        ]
    except OSError:
        return []


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def processes_with(argument: str) -> list[int]:
    """Live processes whose command line holds `argument` as one of its words."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and argument in _cmdline(int(entry)) and alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


# Processes -------------------------------------------------------------------------------------


@dataclass
class Service:
    """One llmgw process, started in its own process group with its output appended to a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    def start(self) -> Service:
        assert not self.running, f"{self.name} is already running (pid {self.pid})"
        with self.log_path.open("ab") as handle:
            handle.write(f"\n===== start {self.starts + 1} at {time.time():.3f}\n".encode())
            handle.flush()
            self.process = subprocess.Popen(  # noqa: S603 - our own command line
                self.argv,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.starts += 1
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> float:
        """kill -9 this process (not its group); when it happened (time.time())."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        moment = time.time()
        self.process.wait(timeout=30)
        return moment

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the group, SIGKILL after `grace` seconds: nothing of it is left behind."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def log(self, tail: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as handle:
                handle.seek(offset)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""


class RedisServer:
    """A redis-server of the test's own, without persistence: stopped and started again, it is empty."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = root / "redis.log"
        root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 30.0) -> float:
        """Start it and wait until it answers; when it answered (time.time())."""
        assert self.process is None or self.process.poll() is not None, "Redis is already running"
        self.process = subprocess.Popen(  # noqa: S603 - a fixed command line
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.root),
                "--logfile",
                str(self.log_path),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_for(self.ping, "redis-server to answer", timeout=timeout, every=0.05)
        return time.time()

    def stop(self) -> float:
        """Stop it (SIGTERM: with nothing to save, it just goes); when it was gone (time.time())."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return time.time()

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def keys(self) -> int:
        """How many keys it holds (DBSIZE), -1 when it does not answer."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"DBSIZE\r\n")
                answer = sock.recv(64)
        except OSError:
            return -1
        return int(answer[1:].strip()) if answer.startswith(b":") else -1


class PgProxy:
    """A TCP proxy in front of PostgreSQL, on an asyncio loop in a thread of its own.

    `cut()` stops listening (new connections are refused) and resets every open connection, both
    ways; `restore()` listens again on the same port.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = free_port()
        self.cuts = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pg-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()

    def _call(self, coroutine: Any, timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout)

    def start(self) -> PgProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    @property
    def listening(self) -> bool:
        return self._server is not None

    def cut(self) -> float:
        """Refuse new connections and reset the open ones; when (time.time())."""
        self._call(self._cut())
        self.cuts += 1
        return time.time()

    def restore(self) -> float:
        self._call(self._listen())
        return time.time()

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._call(self._cut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._open):
            writer.transport.abort()
        self._open.clear()
        await asyncio.sleep(0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._server is None:
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._open.update({writer, upstream_writer})
        try:
            await asyncio.gather(self._pipe(reader, upstream_writer), self._pipe(upstream_reader, writer))
        finally:
            self._open.discard(writer)
            self._open.discard(upstream_writer)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                if writer.can_write_eof():
                    writer.write_eof()
            writer.close()


# Gateway clients ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One gateway request as its client saw it; times are time.time()."""

    sent: float
    done: float
    status: int  # 0: no HTTP answer (connection refused or reset)
    request_id: str
    stream: bool
    error: str = ""

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and not self.error


def chat(
    url: str, key: str, *, stream: bool = False, text: str = "hello", max_tokens: int = 4, timeout: float = 60.0
) -> Answer:
    """One chat completion through the gateway, read to its end."""
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    sent = time.time()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - our own loopback URL
            request_id = response.headers.get("x-llmgw-request-id", "")
            data = response.read()
            error = ""
            if stream and b"[DONE]" not in data:
                error = "the stream ended without [DONE]: " + data[-200:].decode(errors="replace")
            elif not stream and not json.loads(data).get("choices"):
                error = "an answer without choices: " + data[:200].decode(errors="replace")
            return Answer(sent, time.time(), response.status, request_id, stream, error)
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        return Answer(
            sent, time.time(), exc.code, exc.headers.get("x-llmgw-request-id", ""), stream, detail or str(exc.reason)
        )
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Answer(sent, time.time(), 0, "", stream, f"{type(exc).__name__}: {exc}")


class LoadGenerator:
    """Clients in threads sending gateway requests one after another until stopped, each `pause`
    seconds after the last answer; every third is a stream."""

    def __init__(self, url: str, key: str, clients: int = 2, pause: float = 0.0) -> None:
        self.url, self.key, self.clients, self.pause = url, key, clients, pause
        self.answers: list[Answer] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> LoadGenerator:
        for index in range(self.clients):
            thread = threading.Thread(target=self._client, args=(index,), name=f"load-{index}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def _client(self, index: int) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            answer = chat(self.url, self.key, stream=count % 3 == 0, text=f"client {index} says hello {count}")
            with self._lock:
                self.answers.append(answer)
            if not answer.ok:
                self._stop.wait(0.1)  # a server that is down is not hammered
            elif self.pause:
                self._stop.wait(self.pause)

    def stop(self) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)
        return self.snapshot()

    def snapshot(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def ok_count(self, since: float = 0.0) -> int:
        return sum(1 for a in self.snapshot() if a.ok and a.sent >= since)

    def wait_ok(self, count: int, *, since: float = 0.0, timeout: float = 60.0) -> int:
        """Wait until `count` requests sent after `since` were answered 2xx."""
        return wait_for(
            lambda: (n := self.ok_count(since)) >= count and n,
            f"{count} answered requests",
            timeout=timeout,
            details=lambda: summary(self.snapshot()),
        )


def summary(answers: Iterable[Answer]) -> str:
    """Counts by status, and the first few failures."""
    answers = list(answers)
    counts: dict[str, int] = {}
    for answer in answers:
        if answer.status == 0:
            label = "no answer"
        elif answer.ok or not 200 <= answer.status < 300:
            label = str(answer.status)
        else:
            label = f"{answer.status} broken"
        counts[label] = counts.get(label, 0) + 1
    failures = [f"{a.status} {a.error[:160]}" for a in answers if not a.ok][:5]
    return f"{len(answers)} requests: {counts}" + (f"; first failures: {failures}" if failures else "")


# Node rows ----------------------------------------------------------------------------------------


class NodeWatch:
    """Reads a node's status from PostgreSQL every half second in a thread; keeps every status seen."""

    def __init__(self, read: Callable[[], tuple[str, datetime | None] | None]) -> None:
        self._read = read
        self.seen: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                row = self._read()
                if row is not None:
                    self.seen.append((time.time(), row[0]))
            self._stop.wait(0.5)

    def stop(self) -> list[tuple[float, str]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return list(self.seen)

    def not_ready(self) -> list[tuple[float, str]]:
        return [(moment, status) for moment, status in self.seen if status != "ready"]


# The whole set-up -----------------------------------------------------------------------------------


@dataclass
class Production:
    """Web, worker, beat and an agent as separate processes on their own PostgreSQL path and Redis."""

    tmp: Path
    heartbeat_s: int = 10
    missed_heartbeats: int = 3
    url: str = ""
    key: str = ""
    database: str = ""  # the fresh database, reached directly (the test's own reads)
    proxied_database: str = ""  # the same database through the proxy (what the processes use)
    weights: Path | None = None
    _redis: RedisServer | None = None
    _postgres: PgProxy | None = None
    services: dict[str, Service] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def redis(self) -> RedisServer:
        assert self._redis is not None, "not started"
        return self._redis

    @property
    def postgres(self) -> PgProxy:
        assert self._postgres is not None, "not started"
        return self._postgres

    # Life cycle ---------------------------------------------------------------------------------

    def __enter__(self) -> Production:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        from tests.enginebin import llama_server_path
        from tests.fleet import HOSTS, build_host
        from tests.ggufgen import make_tiny_gguf

        llama = llama_server_path()
        assert llama is not None, "no llama-server"
        logs = self.tmp / "logs"
        logs.mkdir(parents=True, exist_ok=True)

        self._redis = RedisServer(self.tmp / "redis")
        self._redis.start()
        database = pg_database_url()
        assert database is not None, "the suite is not on PostgreSQL"
        self.database = database
        parts = urllib.parse.urlsplit(database)
        self._postgres = PgProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
        netloc = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
        self.proxied_database = parts._replace(netloc=f"{netloc}127.0.0.1:{self.postgres.port}").geturl()

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.env = llmgw_env(
            self.tmp / "data",
            port,
            LLMGW_DATABASE_URL=self.proxied_database,
            LLMGW_REDIS_URL=self.redis.url,
            LLMGW_REDIS_PREFIX=f"llmgw-faults-{uuid.uuid4().hex[:8]}",
            LLMGW_LOG_LEVEL="info",
            LLMGW_AGENT_HEARTBEAT_SECONDS=str(self.heartbeat_s),
            LLMGW_AGENT_MISSED_HEARTBEATS=str(self.missed_heartbeats),
        )
        self.manage("migrate", "-v0", timeout=300)
        made = self.manage("shell", "-c", SETUP.format(node=NODE), timeout=120)
        values = dict(line.split("=", 1) for line in made.splitlines() if line.startswith(("KEY=", "TOKEN=")))
        self.key = values["KEY"]

        python = [sys.executable, "-m", "llmgw"]
        # The web process logs warnings (a line per request would cost the 2 cores it shares);
        # worker and beat log what they run.
        web_env = {**self.env, "LLMGW_LOG_LEVEL": "warning"}
        self.services["web"] = Service("web", [*python, "web"], web_env, logs / "web.log")
        self.services["worker"] = Service(
            "worker", [*python, "worker", "--concurrency", "2"], self.env, logs / "worker.log"
        )
        self.services["beat"] = Service("beat", [*python, "beat"], self.env, logs / "beat.log")
        for name in ("web", "worker", "beat"):
            self.services[name].start()
        self.wait_web()

        root = self.tmp / "hosts" / NODE
        root.mkdir(parents=True, exist_ok=True)
        tools = build_host(HOSTS["cpu"], root)
        config = {
            "server": self.url,
            "token": values["TOKEN"],
            "state_dir": str(root / "state"),
            "root": str(root),
            "tools": tools,
            "heartbeat_interval": self.heartbeat_s,
            "hostname": NODE,
            "model_dirs": [],
            "labels": {},
            "engines": {"llama.cpp": str(llama)},
        }
        (root / "agent.yaml").write_text(yaml.safe_dump(config))
        agent_env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "DJANGO_", "PROMETHEUS_"))}
        agent_env["PYTHONUNBUFFERED"] = "1"
        self.services["agent"] = Service(
            "agent", [*python, "agent", "--config", str(root / "agent.yaml")], agent_env, logs / "agent.log"
        ).start()
        wait_for(
            lambda: (row := self.node_row()) is not None and row[0] == "ready",
            f"node {NODE} to be ready",
            timeout=120,
            details=self.logs,
        )

        self.weights = make_tiny_gguf(self.tmp / "tiny.gguf")
        self.api(
            "POST",
            "models/apply",
            {
                "models": [
                    {
                        "name": MODEL,
                        "source": str(self.weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 2,
                                "context_size": 512,
                            }
                        ],
                    }
                ]
            },
        )
        self.wait_served()

    def close(self) -> None:
        agent = self.services.get("agent")
        if agent is not None:
            agent.stop(grace=5)
        self.kill_engines()
        for name in ("web", "worker", "beat"):
            if name in self.services:
                self.services[name].stop()
        if self._redis is not None:
            self._redis.stop()
        if self._postgres is not None:
            self._postgres.close()
        if self.database:
            with contextlib.suppress(Exception):
                drop_pg_database(self.database)

    # Processes ----------------------------------------------------------------------------------

    def manage(self, *args: str, timeout: float = 120) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", *args],
            env=self.env,
            cwd=REPO,  # noqa: S603
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, f"llmgw manage {args[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        return done.stdout

    def kill(self, name: str) -> float:
        """kill -9 one of web, worker, beat, agent; when (time.time())."""
        return self.services[name].kill()

    def start(self, name: str) -> Service:
        service = self.services[name].start()
        if name == "web":
            self.wait_web()
        return service

    def pids(self) -> dict[str, int | None]:
        """The pid of each process now (None for one that is not running), engines and Celery child included."""
        found: dict[str, int | None] = {name: s.pid if s.running else None for name, s in self.services.items()}
        found["celery"] = self.celery_child()
        engines = self.engine_pids()
        found["engine"] = engines[0] if len(engines) == 1 else None
        return found

    def processes(self, word: str) -> list[int]:
        """Live processes of this set-up (found by the Redis prefix in their environment) with `word` as an argument."""
        marker = f"LLMGW_REDIS_PREFIX={self.env['LLMGW_REDIS_PREFIX']}".encode()
        found = []
        for pid in processes_with(word):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if marker in environ:
                found.append(pid)
        return found

    def celery_child(self) -> int | None:
        """The Celery worker `llmgw worker` supervises (its `--no-restart` child), or None."""
        worker = self.services["worker"]
        if not worker.running:
            return None
        children = [pid for pid in processes_with("--no-restart") if _ppid(pid) == worker.pid]
        return children[0] if children else None

    def engine_pids(self) -> list[int]:
        """The llama-server processes serving the tiny model's weights."""
        if self.weights is None:
            return []
        return processes_with(str(self.weights))

    def kill_engines(self) -> None:
        for pid in self.engine_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def logs(self, tail: int = 4000) -> str:
        parts = [
            f"--- {name} (pid {s.pid if s.process else '-'}, "
            f"{'running' if s.running else 'exited ' + str(s.process.returncode if s.process else '-')})\n"
            f"{s.log(tail)}"
            for name, s in self.services.items()
        ]
        return "\n".join(parts)

    def all_running(self) -> dict[str, bool]:
        state = {name: s.running for name, s in self.services.items()}
        state["redis"] = self._redis is not None and self._redis.ping()
        state["engine"] = len(self.engine_pids()) >= 1
        return state

    # Waiting ------------------------------------------------------------------------------------

    def wait_web(self, timeout: float = 120) -> None:
        web = self.services["web"]

        def ready() -> bool:
            assert web.running, f"llmgw web exited:\n{web.log()}"
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as response:  # noqa: S310
                    return response.status == 200
            except (OSError, http.client.HTTPException):
                return False

        wait_for(ready, "llmgw web to be ready", timeout=timeout, details=self.logs)

    def served(self) -> bool:
        request = urllib.request.Request(self.url + "/v1/models", headers={"Authorization": f"Bearer {self.key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:  # noqa: S310
                data = json.load(response)["data"]
        except (OSError, http.client.HTTPException, ValueError):
            return False
        return any(m["id"] == MODEL and m["llmgw"]["ready_replicas"] for m in data)

    def wait_served(self, timeout: float = 120) -> None:
        wait_for(
            lambda: self.served() and chat(self.url, self.key).ok,
            "the gateway to serve tiny",
            timeout=timeout,
            details=self.logs,
        )

    # Reading ------------------------------------------------------------------------------------

    def api(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.url}/api/v1/{path}",
            data=data,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310
            return json.load(response)

    def model(self) -> dict[str, Any]:
        answer: dict[str, Any] = self.api("GET", f"models/{MODEL}")
        return answer

    def request(self, request_id: str) -> dict[str, Any] | None:
        """One request's usage record as the API shows it (`/api/v1/requests/<id>`), None while there is none."""
        try:
            answer: dict[str, Any] = self.api("GET", f"requests/{request_id}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
        return answer

    def replicas(self) -> list[dict[str, Any]]:
        """The tiny model's replicas that are not being stopped."""
        return [r for r in self.model()["replicas"] if r["state"] not in ("stopping", "stopped", "failed")]

    def shard_pids(self) -> list[int | None]:
        return [shard.get("pid") for replica in self.replicas() for shard in replica["shards"]]

    def _sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.database, connect_timeout=10) as conn:
            return conn.execute(query, params).fetchall()

    def node_row(self, name: str = NODE) -> tuple[str, datetime | None] | None:
        """The node's status and last heartbeat, read from PostgreSQL directly."""
        rows = self._sql(f"SELECT status, last_seen_at FROM {NODE_TABLE} WHERE name = %s", name)  # noqa: S608
        return (rows[0][0], rows[0][1]) if rows else None

    def wait_node_ready(self, *, after: float, timeout: float = 90) -> tuple[str, datetime]:
        """Wait until the node is ready with a heartbeat later than `after` (time.time())."""

        def fresh() -> tuple[str, datetime] | None:
            row = self.node_row()
            if row and row[0] == "ready" and row[1] is not None and row[1].timestamp() > after:
                return row[0], row[1]
            return None

        return wait_for(
            fresh,
            f"node {NODE} ready with a heartbeat after {after:.1f}",
            timeout=timeout,
            details=lambda: f"node: {self.node_row()}\n{self.logs()}",
        )

    def watch_node(self) -> NodeWatch:
        return NodeWatch(self.node_row).start()

    def stored_usage(self, request_ids: Iterable[str]) -> set[str]:
        """Which of these request ids have a usage row."""
        ids = sorted({i for i in request_ids if i})
        stored: set[str] = set()
        for start in range(0, len(ids), 2000):
            rows = self._sql(
                f"SELECT request_id FROM {USAGE_TABLE} WHERE request_id = ANY(%s)",  # noqa: S608
                ids[start : start + 2000],
            )
            stored.update(row[0] for row in rows)
        return stored

    def usage_count(self) -> int:
        return int(self._sql(f"SELECT count(*) FROM {USAGE_TABLE}")[0][0])  # noqa: S608

    def missing_usage(self, answers: Iterable[Answer]) -> list[Answer]:
        """The answers given 2xx whose request has no usage row (yet)."""
        answered = [a for a in answers if a.ok]
        stored = self.stored_usage(a.request_id for a in answered)
        return [a for a in answered if a.request_id not in stored]

    def wait_usage(
        self, answers: list[Answer], *, timeout: float, allowed: int = 0, settle: float = 0.0
    ) -> list[Answer]:
        """Wait until at most `allowed` of the 2xx answers lack a usage row; what is still missing.

        With `settle`, keep looking that long once the bound is met, so records that arrive late
        are not counted as lost. Never raises: the caller asserts on what comes back.
        """
        deadline = time.monotonic() + timeout
        missing = self.missing_usage(answers)
        while len(missing) > allowed and time.monotonic() < deadline:
            time.sleep(1.0)
            missing = self.missing_usage(answers)
        settle_until = min(deadline, time.monotonic() + settle)
        while missing and time.monotonic() < settle_until:
            time.sleep(1.0)
            missing = self.missing_usage(answers)
        return missing

    def load(self, clients: int = 2, pause: float = 0.04) -> LoadGenerator:
        """Clients sending requests until stopped. Back to back (`pause` 0), two clients on the tiny
        model sent ~60 a second and kept a core busy for the fault tests' five minutes (web, engine,
        PostgreSQL and Redis together: ~190 CPU seconds); 40 ms apart, each client still has a
        request in flight nearly half the time (one took ~32 ms), so a kill still lands mid-request."""
        return LoadGenerator(self.url, self.key, clients, pause).start()


@contextlib.contextmanager
def production(tmp: Path, **options: Any) -> Iterator[Production]:
    """The set-up as a context manager (for a module-scoped fixture)."""
    with Production(tmp, **options) as running:
        yield running
