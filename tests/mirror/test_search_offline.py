"""A search of the Hub that cannot succeed fails at once, with one message and no retries: offline
(nothing listens), and a Hub that answers 503 (which huggingface_hub's list_models would have
asked five times more over some 23 seconds, logging a warning each time)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from apps.mirror import hub as hub_api
from apps.mirror.hub import MirrorError
from tests.localhttp import LocalHTTP

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(client: Any) -> Iterator[Any]:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    client.force_login(make_user("ops@example.com", role=StaffRole.OPERATOR))
    yield client


def _loud(caplog: Any) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_offline_search_fails_once_with_one_message(settings: Any, operator: Any, caplog: Any) -> None:
    settings.HF_ENDPOINT = "http://127.0.0.1:9"  # nothing listens
    caplog.set_level(logging.DEBUG)
    with pytest.raises(MirrorError, match=r"the Hub at http://127.0.0.1:9 did not answer: .*refused"):
        hub_api.search("tiny")
    with pytest.raises(MirrorError, match="did not answer"):
        hub_api.adapters_for("acme/tiny")
    page = operator.get("/mirror/explore", {"q": "tiny"}).content.decode()
    assert page.count("the Hub at http://127.0.0.1:9 did not answer") == 1
    assert _loud(caplog) == []


def test_a_hub_that_is_unavailable_is_asked_once(settings: Any, caplog: Any) -> None:
    asked: list[str] = []

    def unavailable(handler: Any, head: bool) -> None:
        asked.append(handler.path)
        body = b'{"error": "maintenance"}'
        handler.send_response(503)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    server = LocalHTTP(unavailable)
    server.start()
    try:
        settings.HF_ENDPOINT = server.base
        caplog.set_level(logging.DEBUG)
        with pytest.raises(MirrorError, match="did not answer: .*503 Service Unavailable"):
            hub_api.search("tiny")
    finally:
        server.stop()
    assert len(asked) == 1 and asked[0].startswith("/api/models?search=tiny&limit=20")
    assert _loud(caplog) == []


def test_a_search_reads_the_pages_it_needs_and_takes_only_well_formed_entries(hub: Any) -> None:
    found = hub_api.search("")
    assert len(found) == len(hub.repos) > hub.page_size  # followed the Hub's Link header
    assert all(isinstance(f["id"], str) and isinstance(f["tags"], list) for f in found)
    assert len(hub_api.search("", limit=1)) == 1
