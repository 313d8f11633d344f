"""The audit log: written by every service, read on the Audit page and at /api/v1/audit, changed by nobody."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts import audit
from apps.accounts.choices import StaffRole
from apps.accounts.models import AuditEvent, User
from apps.cluster.choices import NodeStatus
from apps.cluster.models import Node
from tests.conftest import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def oscar(db: Any) -> User:
    """An operator."""
    return make_user("oscar@example.com", role=StaffRole.OPERATOR, name="Oscar")


@pytest.fixture
def events(alice: User, oscar: User) -> dict[str, AuditEvent]:
    """Four events: two by Oscar on nodes, one by Alice on a key, one by the system, a day apart each."""
    n1 = Node.objects.create(name="n1", status=NodeStatus.READY)
    n2 = Node.objects.create(name="n2", status=NodeStatus.READY)
    made = {
        "cordon": audit.record(
            oscar, "node.cordon", n1, changes={"cordoned": [False, True], "reason": ["", "fan"]}, address="10.0.0.7"
        ),
        "uncordon": audit.record(oscar, "node.uncordon", n2, changes={"cordoned": [True, False]}),
        "key": audit.record(alice, "api_key.create", alice, owner=alice.email),
        "register": audit.record(None, "node.register", n2),
    }
    now = timezone.now()
    for days, event in enumerate(made.values()):
        AuditEvent.objects.filter(pk=event.pk).update(created_at=now - timedelta(days=3 - days))
    return made


def rows(content: bytes) -> list[str]:
    return re.findall(r'<tr data-event="(\d+)">', content.decode())


def api_ids(client: Client, query: str = "") -> list[int]:
    response = client.get(f"/api/v1/audit{query}")
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


# Filters --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("", ["register", "key", "uncordon", "cordon"]),
        ("?actor=OSCAR", ["uncordon", "cordon"]),
        ("?actor=system", ["register"]),
        ("?action=node.cordon", ["cordon"]),
        ("?target_type=cluster.node", ["register", "uncordon", "cordon"]),
        ("?target_type=cluster.node&target=n2", ["register", "uncordon"]),
        ("?target=alice@", ["key"]),
        ("?actor=oscar&action=node.uncordon", ["uncordon"]),
    ],
)
def test_the_filters_narrow_the_page_and_the_api(client: Client, viola, events, query, expected) -> None:
    client.force_login(viola)
    want = [events[name].pk for name in expected]
    assert api_ids(client, query) == want
    page = client.get(f"/audit/{query}")
    assert page.status_code == 200
    assert rows(page.content) == [str(pk) for pk in want]


def test_the_time_range_is_since_inclusive_until_exclusive(client: Client, viola, events) -> None:
    client.force_login(viola)
    since = AuditEvent.objects.get(pk=events["uncordon"].pk).created_at
    until = AuditEvent.objects.get(pk=events["register"].pk).created_at
    query = f"?since={since.isoformat()}&until={until.isoformat()}".replace("+", "%2B")
    assert api_ids(client, query) == [events["key"].pk, events["uncordon"].pk]
    assert rows(client.get(f"/audit/{query}").content) == [str(events["key"].pk), str(events["uncordon"].pk)]


def test_a_target_can_be_found_by_its_id(client: Client, viola, events) -> None:
    client.force_login(viola)
    node = Node.objects.get(name="n1")
    assert api_ids(client, f"?target_type=cluster.node&target={node.pk}") == [events["cordon"].pk]


def test_the_action_filter_offers_the_actions_the_log_holds(client: Client, viola, events) -> None:
    client.force_login(viola)
    page = client.get("/audit/").content.decode()
    select = re.search(r'<select name="action".*?</select>', page, re.S)
    assert select is not None
    assert re.findall(r'<option value="([^"]+)"', select.group(0)) == [
        "api_key.create",
        "node.cordon",
        "node.register",
        "node.uncordon",
    ]


def test_a_backwards_range_is_refused(client: Client, viola, events) -> None:
    client.force_login(viola)
    now = timezone.now()
    query = f"?since={now.date().isoformat()}T10:00&until={now.date().isoformat()}T09:00"
    response = client.get(f"/api/v1/audit{query}")
    assert response.status_code == 400
    assert "since" in response.json()["errors"]
    page = client.get(f"/audit/{query}")
    assert page.status_code == 200
    assert rows(page.content) == []
    assert b"The start must be before the end." in page.content


def test_the_page_shows_50_at_a_time_and_keeps_the_filters(client: Client, viola, oscar) -> None:
    for number in range(120):
        audit.record(oscar, "node.cordon", None, changes={"n": number})
    client.force_login(viola)
    first = client.get("/audit/?actor=oscar")
    assert len(rows(first.content)) == 50
    assert b"Page 1 of 3 (120 events)" in first.content
    assert b'href="?actor=oscar&amp;page=2"' in first.content
    last = client.get("/audit/?actor=oscar&page=3")
    assert len(rows(last.content)) == 20


# What one event shows --------------------------------------------------------------------------------


def test_an_operators_cordon_through_the_api_is_in_the_log(client: Client, oscar, viola) -> None:
    node = Node.objects.create(name="gpu7", status=NodeStatus.READY)
    client.force_login(oscar)
    response = client.post(
        "/api/v1/nodes/gpu7/cordon", {"reason": "fan noise"}, content_type="application/json", REMOTE_ADDR="192.0.2.10"
    )
    assert response.status_code == 200
    client.force_login(viola)
    [event] = client.get("/api/v1/audit?action=node.cordon").json()["results"]
    assert event["actor"] == "oscar@example.com"
    assert event["actor_id"] == oscar.pk
    assert (event["target_type"], event["target_id"], event["target"]) == ("cluster.node", str(node.pk), "gpu7")
    assert event["changes"]["cordoned"] == [False, True]
    assert event["changes"]["reason"] == ["", "fan noise"]
    assert event["address"] == "192.0.2.10"
    page = client.get("/audit/?action=node.cordon").content.decode()
    line = re.search(r'<tr data-event="\d+">(.*?)</tr>', page, re.S)
    assert line is not None
    assert "oscar@example.com" in line.group(1)
    assert "192.0.2.10" in line.group(1)
    assert 'title="cordoned: false → true; reason: &quot;&quot; → fan noise"' in line.group(1)


def test_long_changes_are_clipped_with_the_whole_on_hover(client: Client, viola, oscar) -> None:
    audit.record(oscar, "model.update", None, changes={"fallbacks": [["a"], ["a", "b" * 300]], "note": None})
    client.force_login(viola)
    page = client.get("/audit/").content.decode()
    cell = re.search(r'<td class="clip cursor-help" data-col="changes" title="([^"]*)">', page)
    assert cell is not None
    assert cell.group(1).startswith("fallbacks: [&quot;a&quot;] → [&quot;a&quot;, &quot;bbb")
    assert cell.group(1).endswith("note: -")


def test_change_lines_read_diffs_and_plain_values() -> None:
    assert audit.change_lines({"min_replicas": [0, 2], "reason": "fan", "owner": None, "on": [True, False]}) == [
        "min_replicas: 0 → 2",
        "on: true → false",
        "owner: -",
        "reason: fan",
    ]  # by field, on any database
    assert audit.change_lines({}) == []


# Who may read it, and that nobody may change it ---------------------------------------------------


def test_a_viewer_sees_the_page_but_no_form_that_changes_anything(client: Client, viola, events) -> None:
    client.force_login(viola)
    page = client.get("/audit/").content.decode()
    forms = re.findall(r"<form\b[^>]*>", page)
    posting = [form for form in forms if 'method="post"' in form.lower()]
    assert all('action="/logout/"' in form for form in posting), posting
    assert any('method="get"' in form and 'role="search"' in form for form in forms)
    assert 'href="/audit/"' in page  # the nav


def test_people_without_a_staff_role_are_refused(client: Client, bob, events) -> None:
    assert client.get("/audit/").status_code == 302
    assert client.get("/api/v1/audit").status_code in (401, 403)
    client.force_login(bob)
    assert client.get("/audit/").status_code == 403
    assert client.get("/api/v1/audit").status_code == 403
    assert client.get(f"/api/v1/audit/{events['key'].pk}").status_code == 403
    assert b'href="/audit/"' not in client.get("/").content


@pytest.mark.parametrize("method", ["put", "patch", "delete", "post"])
def test_nobody_changes_or_deletes_an_event_through_the_api(client: Client, alice, viola, events, method: str) -> None:
    event = events["cordon"]
    for user in (alice, viola):
        client.force_login(user)
        for url in (f"/api/v1/audit/{event.pk}", "/api/v1/audit"):
            response = getattr(client, method)(url, {"action": "x"}, content_type="application/json")
            assert response.status_code in (403, 405), (user, method, url)
    assert AuditEvent.objects.get(pk=event.pk).action == "node.cordon"
    assert AuditEvent.objects.count() == 4


def test_the_django_admin_shows_events_read_only(client: Client, alice, events) -> None:
    client.force_login(alice)
    event = events["cordon"]
    assert client.get(f"/django-admin/accounts/auditevent/{event.pk}/change/").status_code == 200
    assert client.post(f"/django-admin/accounts/auditevent/{event.pk}/change/", {"action": "x"}).status_code == 403
    assert client.post(f"/django-admin/accounts/auditevent/{event.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.get("/django-admin/accounts/auditevent/add/").status_code == 403
    assert AuditEvent.objects.get(pk=event.pk).action == "node.cordon"
