from __future__ import annotations

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
