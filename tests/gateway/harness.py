"""The /v1 gateway run for real, with nothing from the database: the harness of the gateway tests.

The gateway runs under uvicorn, on a free port, in the test's event loop, with its tables set in
memory instead of loaded from the database, a fake usage writer that keeps the records it is given,
and a fake limiter. The fixtures `engine` (a scriptable mock engine) and `gw` (the gateway in front
of it, serving model "m" from one replica) are registered in tests/gateway/conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import types
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import uvicorn

from apps.gateway import asgi, routes
from apps.gateway.tables import KeyEntry, ModelRoute, Tables, Upstream, key_hash
from apps.quotas.limiter import Headroom, Refusal
from tests.gateway.mock_engine import MockEngine

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

KEY = "llmgw_edge_test_key"
OTHER_KEY = "llmgw_edge_other_key"
WAIT = 5.0  # a bound on waiting for an event that should come at once; never reached when all is well
HELLO = [{"role": "user", "content": "Say hello"}]


# Fakes --------------------------------------------------------------------------------------------


class UsageLog:
    """Stands in for apps.quotas.usage.UsageWriter: keeps every record the gateway emits."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._changed = asyncio.Event()

    def emit(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self._changed.set()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def wait(self, count: int = 1) -> dict[str, Any]:
        """The `count`th record, once it has been emitted (records come after the answer is sent)."""
        async with asyncio.timeout(WAIT):
            while len(self.records) < count:
                self._changed.clear()
                await self._changed.wait()
        return self.records[count - 1]


@dataclass
class FakeLimiter:
    refusal: Refusal | Headroom | None = None
    admitted: list[list[Any]] = field(default_factory=list)
    recorded: list[int] = field(default_factory=list)
    tokens_recorded: asyncio.Event = field(default_factory=asyncio.Event)

    async def admit(self, limits: list[Any], now: float) -> Refusal | Headroom | None:
        self.admitted.append(limits)
        return self.refusal

    async def record_tokens(self, limits: list[Any], tokens: int, now: float) -> None:
        self.recorded.append(tokens)
        self.tokens_recorded.set()

    async def close(self) -> None:
        pass


# The gateway under test ------------------------------------------------------------------------


def entry(key_id: int = 1, **kwargs: Any) -> KeyEntry:
    values: dict[str, Any] = {
        "key_id": key_id,
        "user_id": 10,
        "project_id": 20,
        "team_id": 30,
        "org_id": 40,
        "allowed_models": None,
        "expires_at": None,
    }
    values.update(kwargs)
    return KeyEntry(**values)


def endpoint(url: str, id: str = "1", *, model: str = "m", slots: int = 2, **kwargs: Any) -> Upstream:
    values: dict[str, Any] = {"secret": "s", "hardware": "cpu", "node": "n1", "upstream_model": model}
    values.update(kwargs)
    return Upstream(id=id, url=url, capacity=slots, model=model, **values)


def route(name: str, upstreams: list[Upstream], **kwargs: Any) -> ModelRoute:
    values: dict[str, Any] = {"fallbacks": [], "min_replicas": 1, "hardware": ["cpu"]}
    values.update(kwargs)
    return ModelRoute(name=name, upstreams=upstreams, **values)


def held(upstream: Upstream) -> int:
    """Requests holding a slot of the upstream in the gateway under test."""
    return upstream.inflight.held if upstream.inflight is not None else 0


def failed_until(upstream: Upstream) -> float:
    return upstream.inflight.failed_until if upstream.inflight is not None else 0.0


@dataclass
class Answer:
    status: int
    headers: Any
    text: str

    @property
    def json(self) -> Any:
        return json.loads(self.text)


@dataclass
class Gateway:
    app: asgi.GatewayApp
    url: str
    usage: UsageLog
    limiter: FakeLimiter
    client: aiohttp.ClientSession
    # What "the database" holds when a test has moved it past the gateway's tables, and how many
    # times the gateway asked for the table version.
    database: dict[str, Tables] = field(default_factory=dict)
    version_checks: list[int] = field(default_factory=list)

    @property
    def endpoint(self) -> Upstream:
        """The one replica of model "m" the gateway starts with."""
        return self.app.tables.models["m"].upstreams[0]

    def set_models(self, *routes: ModelRoute) -> None:
        tables = Tables(
            keys=self.app.tables.keys, models={r.name: r for r in routes}, version=self.app.tables.version + 1
        )
        self.app.keeper.bind(tables)
        self.app.tables = tables

    def set_key(self, raw: str, key: KeyEntry) -> None:
        self.app.tables.keys[key_hash(raw)] = key

    async def post(
        self,
        path: str,
        body: Any = None,
        *,
        data: bytes | None = None,
        key: str | None = KEY,
        headers: dict[str, str] | None = None,
    ) -> Answer:
        sent = dict(headers or {})
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        if data is None:
            data = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
        async with self.client.post(self.url + path, data=data, headers=sent) as response:
            return Answer(response.status, response.headers, await response.text())

    async def chat(self, *, key: str | None = KEY, **body: Any) -> Answer:
        return await self.post("/v1/chat/completions", {"model": "m", "messages": HELLO, **body}, key=key)

    async def get(self, path: str, *, key: str | None = KEY) -> Answer:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        async with self.client.get(self.url + path, headers=headers) as response:
            return Answer(response.status, response.headers, await response.text())

    def openai(self, key: str = KEY) -> Any:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def anthropic(self, key: str = KEY) -> Any:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=key, max_retries=0)


async def engine_fixture() -> AsyncIterator[MockEngine]:
    mock = await MockEngine().start()
    yield mock
    if mock.gate is not None:
        mock.gate.set()  # let a held request go, so nothing is left running
    await mock.stop()


async def gateway_fixture(
    engine: MockEngine, monkeypatch: pytest.MonkeyPatch, *, store: bool = False, key: KeyEntry | None = None
) -> AsyncIterator[Gateway]:
    """The gateway in front of `engine`. Responses API answers are stored only with `store` (the
    test then has a database, and `key`'s user and organisation in it); else they say store: false."""
    tables = Tables(keys={key_hash(KEY): key or entry()}, models={"m": route("m", [endpoint(engine.url)])}, version=1)
    usage = UsageLog()
    limiter = FakeLimiter()

    # GatewayApp._start runs as in production, except that nothing comes from the database: the
    # tables are ours, the usage writer and limiter are fakes, and the refresh loop never reloads.
    database: dict[str, Tables] = {}
    version_checks: list[int] = []
    monkeypatch.setattr(routes, "load_tables", lambda: database.get("tables", tables))
    fake_limiter = types.ModuleType("apps.quotas.limiter")
    fake_limiter.make_limiter = lambda: limiter  # type: ignore[attr-defined]
    fake_usage = types.ModuleType("apps.quotas.usage")
    fake_usage.UsageWriter = lambda **_options: usage  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "apps.quotas.limiter", fake_limiter)
    monkeypatch.setitem(sys.modules, "apps.quotas.usage", fake_usage)
    from django.conf import settings as django_settings

    monkeypatch.setattr(django_settings, "USAGE_WRITER", "web")  # the fake log stands in for the writer
    monkeypatch.setattr(django_settings, "RESPONSES_STORE", store)
    # With Redis, slots are shared through it: each test's gateway counts under its own prefix.
    monkeypatch.setattr(django_settings, "REDIS_PREFIX", f"llmgw-test-{uuid.uuid4().hex[:8]}")

    app = asgi.GatewayApp()

    def current_version() -> int:
        version = database["tables"].version if "tables" in database else app.tables.version
        version_checks.append(version)
        return version

    monkeypatch.setattr(routes, "current_version", current_version)

    async def never_refresh() -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(app, "_refresh_loop", never_refresh)
    await app.ensure_started()
    assert app.tables is tables and app.usage is usage and app.limiter is limiter

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(WAIT):
        while not server.started:
            assert not serving.done(), "uvicorn did not start"
            await asyncio.sleep(0.005)
    client = aiohttp.ClientSession()
    try:
        yield Gateway(app, f"http://127.0.0.1:{port}", usage, limiter, client, database, version_checks)
    finally:
        await client.close()
        server.should_exit = True
        await serving
        await app.shutdown()
        sock.close()


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) for each server-sent event of a stream's text."""
    events: list[tuple[str | None, str]] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name: str | None = None
        data: list[str] = []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        events.append((name, "\n".join(data)))
    return events


async def until(condition: Any) -> None:
    """Wait (bounded) for a condition on the gateway's state that no event announces."""
    async with asyncio.timeout(WAIT):
        while not condition():
            await asyncio.sleep(0.001)


def receive_once(body: dict[str, Any]) -> Any:
    """An ASGI `receive` that gives `body` whole, then waits as a client that stays would."""
    raw = json.dumps(body).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        raise AssertionError("unreachable")

    return receive
