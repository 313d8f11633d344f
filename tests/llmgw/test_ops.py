from __future__ import annotations

import asyncio
import os

import pytest
from django.test import Client

from tests.conftest import BACKEND

pytestmark = pytest.mark.django_db


def test_healthz_answers_without_signing_in(client: Client) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_readyz_reports_each_service(client: Client) -> None:
    response = client.get("/readyz")
    assert response.status_code == 200, response.content
    body = response.json()
    nobody = {"acting": None, "since": None, "renewed_at": None}
    assert body == {"ready": True, "database": "ok", "broker": "ok", "channel_layer": "ok", "scheduler": nobody}


def test_readyz_names_the_acting_scheduler(client: Client) -> None:
    from apps.schedule import lease

    assert lease.hold("sched-host:4242:abc123")
    scheduler = client.get("/readyz").json()["scheduler"]
    assert scheduler["acting"] == "sched-host:4242" and scheduler["since"] and scheduler["renewed_at"]


def test_readyz_reports_a_missing_broker_as_json_not_a_traceback(client: Client, settings) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = client.get("/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["ready"] is False
    assert body["database"] == "ok"
    assert body["broker"].startswith("ConnectionError") or "Error" in body["broker"]


def test_metrics_are_prometheus_text(client: Client) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    assert b'llmgw_build_info{version="' in response.content


def test_metrics_sum_several_processes_when_multiprocess(client: Client, tmp_path, monkeypatch) -> None:
    from prometheus_client import values

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    # Two "processes" write their own counter files; /metrics adds them up.
    from prometheus_client import CollectorRegistry, Counter

    for pid in (101, 102):
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda pid=pid: pid))
        counter = Counter("llmgw_test_hits", "test", registry=CollectorRegistry())
        counter.inc(3)
    response = client.get("/metrics")
    assert b"llmgw_test_hits_total 6.0" in response.content


def test_the_suite_runs_on_the_backend_it_was_asked_for() -> None:
    """scripts/test runs the suite twice; make sure each run really uses its services."""
    from channels.layers import get_channel_layer
    from django.conf import settings
    from django.db import connection

    if BACKEND == "postgres":
        assert connection.vendor == "postgresql"
        assert settings.REDIS_URL.startswith("redis://")
        from channels_redis.core import RedisChannelLayer

        assert isinstance(get_channel_layer(), RedisChannelLayer)
        assert settings.CELERY_BROKER_URL.startswith("redis://")
    elif BACKEND == "sqlite":
        assert connection.vendor == "sqlite"
        assert type(get_channel_layer()).__name__ == "InMemoryChannelLayer"
        assert settings.CELERY_BROKER_URL == "filesystem://"
    else:
        pytest.skip("LLMGW_TEST_BACKEND not set: run through scripts/test")
    assert os.environ.get("LLMGW_TEST_BACKEND") == BACKEND


def test_the_overview_tells_staff_which_scheduler_acts_or_that_none_does(client: Client) -> None:
    from apps.accounts.choices import StaffRole
    from apps.schedule import lease
    from tests.conftest import make_user

    client.force_login(make_user("viewer@example.com", role=StaffRole.VIEWER))
    page = client.get("/").content.decode()
    assert "No scheduler is acting" in page
    assert lease.hold("sched-host:4242:abc123")
    page = client.get("/").content.decode()
    assert "<code>sched-host:4242</code> (host:pid), acting since" in page
    client.force_login(make_user("member@example.com"))
    assert "data-scheduler" not in client.get("/").content.decode()


async def asgi_get(path: str, *, method: str = "GET", headers: list[tuple[bytes, bytes]] | None = None) -> dict:
    """One request through the web process's ASGI application, as uvicorn hands it over."""
    from llmgw.asgi import application

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), *(headers or [])],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    sent: list[dict] = []
    bodies = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict:
        if bodies:
            return bodies.pop()
        await asyncio.Event().wait()  # the client stays connected until the answer is sent
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await application(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": start["status"], "headers": dict(start["headers"]), "body": body}


async def test_healthz_is_answered_by_the_event_loop_itself_with_the_views_answer() -> None:
    """A liveness probe says the process's loop answers: it is answered there, not by a Django view
    run in a thread started for it, with the view's body and headers."""
    from django.core.signals import request_started

    reached_django: list[object] = []

    def started(**kwargs: object) -> None:
        reached_django.append(kwargs)

    request_started.connect(started)
    try:
        answer = await asgi_get("/healthz")
        head = await asgi_get("/healthz", method="HEAD")
    finally:
        request_started.disconnect(started)
    assert answer["status"] == 200 and answer["body"] == b'{"status": "ok"}'
    assert answer["headers"][b"content-type"] == b"application/json"
    assert b"no-store" in answer["headers"][b"cache-control"]
    assert head["status"] == 200 and head["body"] == b""
    assert reached_django == []


@pytest.mark.django_db(transaction=True)
async def test_healthz_with_a_body_or_another_method_is_still_djangos() -> None:
    """What the view refuses (another method) and what the body bound refuses (a body) stay theirs."""
    post = await asgi_get("/healthz", method="POST")
    assert post["status"] == 403 and b"CSRF" in post["body"]  # Django's CSRF check answers first
    declared = await asgi_get("/healthz", headers=[(b"content-length", b"5000000000")])
    assert declared["status"] == 413
