"""The batches' test harness: the gateway, the batches' API and a batch runner, for real, in front of a
mock engine, on the test's database.

`world` (registered in tests/batches/conftest.py) serves, under uvicorn on a free port as llmgw/asgi.py
serves them, /v1/files, /v1/batches, /v1/messages/batches (apps.batches.http) and the gateway, whose
key table is read from the database (two organisations, each a project and a key: `a` and `b`) and
whose one model "m" is a mock engine (tests/gateway/mock_engine.py) with two slots. Usage records are
written to the database by the real writer; limits are counted in process. The runner takes a pass
every 50 ms and moves batches on every 200 ms, so tests wait little; nothing here waits on a clock
except bounded waits for an event that should come.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from asgiref.sync import sync_to_async

from apps.batches.http import BatchesApp, handles
from apps.batches.runner import BatchRunner
from apps.gateway import asgi, routes
from apps.gateway.tables import ModelRoute
from apps.gateway.tables import load_tables as real_load_tables
from tests.gateway.harness import endpoint, route
from tests.gateway.mock_engine import MockEngine

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

WAIT = 20.0  # a bound on waiting for a batch to end; never reached when all is well


async def db[T](func: Any, *args: Any, **kwargs: Any) -> Any:
    """func in an executor thread, whose connection then goes back to the pool (as the app's own)."""

    def run() -> Any:
        from django.db import close_old_connections

        try:
            return func(*args, **kwargs)
        finally:
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()


@dataclass
class Tenant:
    """One organisation's person, project and API key (its secret)."""

    user: Any
    org: Any
    project: Any
    key: Any
    secret: str


def make_tenant(name: str, *, allowed_models: list[str] | None = None) -> Tenant:
    from apps.accounts import services
    from tests.conftest import make_user

    user = make_user(f"{name}@example.com", name=name.title())
    org = services.create_organization(name=f"Org {name}", actor=None)
    team = services.create_team(org, name="Team", actor=None)
    project = services.create_project(team, name="Project", actor=None)
    made = services.create_api_key(user, name=name, project=project, actor=user, allowed_models=allowed_models)
    return Tenant(user, org, project, made.key, made.secret)


def make_batch(tenant: Tenant, batch_id: str, *, status: str = "in_progress", **extra: Any) -> Any:
    """A chat completions batch owned by `tenant`, its window open: 10 lines, 4 succeeded and 1
    failed unless `extra` says otherwise."""
    from django.utils import timezone

    from apps.batches.models import Batch
    from apps.batches.services import WINDOW

    return Batch.objects.create(
        id=batch_id,
        organization=tenant.org,
        project=tenant.project,
        user=tenant.user,
        api_key=tenant.key,
        endpoint="/v1/chat/completions",
        model="m",
        status=status,
        expires_at=timezone.now() + WINDOW,
        **{"total": 10, "succeeded": 4, "failed": 1, **extra},
    )


@dataclass
class World:
    url: str
    app: asgi.GatewayApp
    runner: BatchRunner
    engine: MockEngine
    model: ModelRoute
    a: Tenant
    b: Tenant

    def openai(self, tenant: Tenant | None = None) -> Any:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=(tenant or self.a).secret, max_retries=0)

    def anthropic(self, tenant: Tenant | None = None) -> Any:
        return anthropic.AsyncAnthropic(base_url=self.url, api_key=(tenant or self.a).secret, max_retries=0)

    async def upload(self, lines: list[Any], tenant: Tenant | None = None, *, raw: bytes | None = None) -> Any:
        data = raw if raw is not None else b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        return await self.openai(tenant).files.create(file=("input.jsonl", data), purpose="batch")

    async def ended(self, batch_id: str, tenant: Tenant | None = None, *, timeout: float = WAIT) -> Any:
        """The OpenAI batch once it has a final status."""
        client = self.openai(tenant)
        async with asyncio.timeout(timeout):
            while True:
                batch = await client.batches.retrieve(batch_id)
                if batch.status in ("completed", "failed", "expired", "cancelled"):
                    return batch
                await asyncio.sleep(0.05)

    async def usage(self, batch_id: str, count: int) -> list[dict[str, Any]]:
        """The usage records of a batch's lines, once `count` are written (the writer writes every 0.5 s)."""
        from apps.quotas.models import UsageRecord

        def read() -> list[dict[str, Any]]:
            return list(UsageRecord.objects.filter(batch=batch_id).order_by("created_at").values())

        async with asyncio.timeout(WAIT):
            while len(found := await db(read)) < count:
                await asyncio.sleep(0.1)
        return found

    async def message_batch_ended(self, batch_id: str, tenant: Tenant | None = None) -> Any:
        client = self.anthropic(tenant)
        async with asyncio.timeout(WAIT):
            while True:
                batch = await client.messages.batches.retrieve(batch_id)
                if batch.processing_status == "ended":
                    return batch
                await asyncio.sleep(0.05)


def chat_line(custom_id: str, text: str = "hello", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": text}], **body},
    }


def echo(body: dict[str, Any]) -> str:
    """The mock engine's answer: what it was asked, so each line's answer is its own."""
    messages = body.get("messages") or []
    return f"echo: {messages[-1]['content']}" if messages else "echo"


async def world_fixture(engine: MockEngine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[World]:
    from django.conf import settings

    monkeypatch.setattr(settings, "BATCH_STORAGE_DIR", tmp_path / "batches")
    monkeypatch.setattr(settings, "DATA_DIR", tmp_path)
    monkeypatch.setattr(settings, "USAGE_WRITER", "web")
    monkeypatch.setattr(settings, "BATCH_LINE_ATTEMPTS", 3)
    monkeypatch.setattr(settings, "REDIS_PREFIX", f"llmgw-batches-test-{tmp_path.name[-8:]}")
    engine.replies["m"] = echo
    model = route("m", [endpoint(engine.url, slots=2)])

    def load_tables() -> Any:
        tables = real_load_tables()
        tables.models = {"m": model}
        return tables

    monkeypatch.setattr(routes, "load_tables", load_tables)
    a = await db(make_tenant, "ada")
    b = await db(make_tenant, "bert")

    app = asgi.GatewayApp()
    await app.ensure_started()
    runner = BatchRunner(app, tick_s=0.05, advance_s=0.2, retry_s=0.05)
    runner.start()
    batches = BatchesApp(app)

    async def serve(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and handles(scope["path"]):
            await batches(scope, receive, send)
        else:
            await app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(serve, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(5):
        while not server.started:
            await asyncio.sleep(0.005)
    try:
        yield World(f"http://127.0.0.1:{sock.getsockname()[1]}", app, runner, engine, model, a, b)
    finally:
        if engine.gate is not None:
            engine.gate.set()
        server.should_exit = True
        await serving
        await runner.stop()
        await app.shutdown()
        sock.close()
