"""The facility page (/facility/): the tree of sites, rooms, rows and racks from the nodes' labels, the
models in each rack, the holds on it (its own and those above it), and holding and releasing there."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from apps.accounts.choices import StaffRole
from apps.accounts.models import AuditEvent
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.facility import services
from apps.facility.models import Hold
from apps.facility.selectors import facility_page
from tests.builders import make_model, make_node, make_replica
from tests.conftest import make_user

pytestmark = pytest.mark.django_db


def at(
    site: str | None = None, room: str | None = None, row: str | None = None, rack: str | None = None, **more: str
) -> dict[str, str]:
    """The llmgw.io/ labels naming a place."""
    levels = {"site": site, "room": room, "row": row, "rack": rack, **more}
    return {f"llmgw.io/{level}": value for level, value in levels.items() if value}


def racks(page: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each rack of the tree by its path (site/room/row/rack, "-" for a level not said)."""
    return {
        rack["path"]: rack
        for site in page["sites"]
        for room in site["rooms"]
        for row in room["rows"]
        for rack in row["racks"]
    }


@pytest.fixture
def operator(client: Client) -> Client:
    client.force_login(make_user("olga@example.com", role=StaffRole.OPERATOR))
    return client


@pytest.fixture
def floor() -> None:
    """Two sites; in dc1 a row with two racks and a rack that names no row; in dc2 one rack; a node
    naming no rack (only its site) and one naming nothing."""
    make_node("a1", gpus=8, labels=at("dc1", "hall1", "row1", "r1", pdu="p1"))
    make_node("a2", gpus=4, labels=at("dc1", "hall1", "row1", "r1", pdu="p1"))
    make_node("b1", gpus=2, gpu_class="L40S", labels=at("dc1", "hall1", "row1", "r2", pdu="p2"))
    make_node("c1", labels=at("dc1", "hall1", rack="r3"))
    make_node("d1", gpus=1, labels=at("dc2", "hall9", "row7", "r9"), cordoned=True, cordon_reason="fan")
    make_node("e1", labels=at("dc2"))
    make_node("loose")
    make_node("gone", labels=at("dc1", "hall1", "row1", "r1"), status=NodeStatus.REVOKED)


def test_the_tree_groups_nodes_by_site_room_row_and_rack(floor: None) -> None:
    page = facility_page()
    assert page["placed"] and page["nodes"] == 7 and page["racks"] == 4
    assert [site["label"] for site in page["sites"]] == ["dc1", "dc2"]
    dc1 = page["sites"][0]
    assert [room["label"] for room in dc1["rooms"]] == ["hall1"]
    # The rack that names no row stands under row "-", after the named rows.
    assert [row["label"] for row in dc1["rooms"][0]["rows"]] == ["row1", "-"]
    assert dc1["rooms"][0]["rows"][1]["name"] is None
    found = racks(page)
    assert list(found) == ["dc1/hall1/row1/r1", "dc1/hall1/row1/r2", "dc1/hall1/-/r3", "dc2/hall9/row7/r9"]
    r1 = found["dc1/hall1/row1/r1"]
    assert [n["name"] for n in r1["nodes"]] == ["a1", "a2"]  # name order; the revoked node is left out
    assert r1["nodes"][0]["gpus"] == 8 and r1["nodes"][0]["gpu_classes"] == [{"name": "H100-80GB", "count": 8}]
    assert r1["nodes"][0]["pdu"] == "p1" and r1["nodes"][0]["state"] == "ready"
    assert found["dc1/hall1/row1/r2"]["nodes"][0]["gpu_classes"] == [{"name": "L40S", "count": 2}]
    d1 = found["dc2/hall9/row7/r9"]["nodes"][0]
    assert d1["cordoned"] and d1["state"] == "cordoned" and d1["cordon_reason"] == "fan"
    assert [n["name"] for n in page["without_rack"]] == ["e1", "loose"]
    assert [(p["name"], p["nodes"]) for p in page["pdus"]] == [("p1", ["a1", "a2"]), ("p2", ["b1"])]


def test_a_rack_lists_the_models_whose_claiming_replicas_run_on_its_nodes(floor: None) -> None:
    from apps.cluster.models import Node

    a1, a2, b1 = (Node.objects.get(name=name) for name in ("a1", "a2", "b1"))
    big = make_model("big", gpus=4)
    small = make_model("small", gpus=1)
    make_replica(big, a1, also_on=[a2])  # one replica, a shard on each node of r1
    make_replica(big, b1, state=ReplicaState.STARTING)
    make_replica(small, a1, state=ReplicaState.FAILED)  # a failed replica still holds its cards
    make_replica(small, a2, state=ReplicaState.PENDING)  # not claiming: left out
    found = racks(facility_page())
    assert found["dc1/hall1/row1/r1"]["models"] == [{"name": "big", "shards": 2}, {"name": "small", "shards": 1}]
    assert found["dc1/hall1/row1/r2"]["models"] == [{"name": "big", "shards": 1}]
    assert found["dc1/hall1/-/r3"]["models"] == []


def test_a_row_hold_holds_its_racks_and_says_so(floor: None, operator: Client) -> None:
    services.hold("row", "row1", reason="cooling work", actor=None)
    services.hold("rack", "r9", reason="PDU swap", actor=None)
    services.hold("pdu", "p2", reason="breaker", actor=None)
    page = facility_page()
    found = racks(page)
    for path in ("dc1/hall1/row1/r1", "dc1/hall1/row1/r2"):
        rack = found[path]
        assert rack["held"]
        assert [(item["hold"].domain, item["inherited"]) for item in rack["holds"]] == [("row=row1", True)]
        assert {n["state"] for n in rack["nodes"]} == {"held"}
    assert not found["dc1/hall1/-/r3"]["held"]
    assert [(i["hold"].domain, i["inherited"]) for i in found["dc2/hall9/row7/r9"]["holds"]] == [("rack=r9", False)]
    assert found["dc1/hall1/row1/r2"]["nodes"][0]["held_by"] == ["row=row1", "pdu=p2"]
    # The cordoned node in the held rack shows cordoned: the more particular of the two.
    assert found["dc2/hall9/row7/r9"]["nodes"][0]["state"] == "cordoned"
    assert {h["domain"]: h["nodes"] for h in page["holds"]} == {"pdu=p2": 1, "rack=r9": 1, "row=row1": 3}
    assert page["pdus"][1]["hold"].domain == "pdu=p2"

    html = operator.get("/facility/").content.decode()
    assert 'data-rack="r1" data-path="dc1/hall1/row1/r1" data-held="1"' in html
    assert 'data-rack="r3" data-path="dc1/hall1/-/r3" data-held="0"' in html
    assert "held with row=row1" in html and "Held (row=row1): cooling work" in html
    assert 'class="rack-slot rack-slot-held" data-node="a1" data-state="held"' in html
    assert 'class="rack-slot rack-slot-cordoned" data-node="d1"' in html


def test_the_page_draws_each_rack_and_refreshes_itself(floor: None, operator: Client) -> None:
    response = operator.get("/facility/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'hx-get="/facility/" hx-trigger="every 10s"' in html
    assert html.count('class="rack-elevation"') == 4
    assert html.count('class="rack-slot rack-slot-ready"') == 4  # a1, a2, b1, c1; d1 is cordoned
    assert 'href="/nodes/a1/"' in html and 'data-section="without-rack"' in html
    assert 'data-section="empty"' not in html
    fragment = operator.get("/facility/", HTTP_HX_REQUEST="true").content.decode()
    assert fragment.lstrip().startswith('<div id="facility-live"') and "<html" not in fragment


def test_with_no_location_the_page_says_how_to_give_one(operator: Client) -> None:
    make_node("gpu1", gpus=8)
    html = operator.get("/facility/").content.decode()
    assert 'data-section="empty"' in html and "No node says where it is yet." in html
    assert "llmgw ctl label NODE llmgw.io/rack=r12" in html and "Location fields" in html
    assert 'class="rack-elevation"' not in html


def test_hold_and_release_from_the_page_are_audited(floor: None, operator: Client) -> None:
    page = operator.get("/facility/").content.decode()
    assert 'action="/facility/hold"' in page
    response = operator.post("/facility/hold", {"level": "rack", "name": "r1", "reason": "PDU swap"}, follow=True)
    assert response.redirect_chain == [("/facility/", 302)]
    html = response.content.decode()
    assert "rack=r1 is held" in html and 'data-hold="rack=r1"' in html and 'data-action="release"' in html
    row = Hold.objects.get(released_at__isnull=True)
    assert (row.domain, row.reason, getattr(row.created_by, "email", None)) == (
        "rack=r1",
        "PDU swap",
        "olga@example.com",
    )
    event = AuditEvent.objects.get(action="facility.hold")
    assert (event.target_id, event.actor_label, event.address) == (str(row.pk), "olga@example.com", "127.0.0.1")

    again = operator.post("/facility/hold", {"level": "rack", "name": "r1"}, follow=True)
    assert "rack=r1 is already held" in again.content.decode()
    assert (
        "no such level shelf"
        in operator.post("/facility/hold", {"level": "shelf", "name": "3"}, follow=True).content.decode()
    )
    assert "Name the domain to hold" in operator.post("/facility/hold", {"level": "rack"}, follow=True).content.decode()
    assert Hold.objects.count() == 1

    response = operator.post("/facility/release", {"level": "rack", "name": "r1"}, follow=True)
    assert response.redirect_chain == [("/facility/", 302)] and "rack=r1 is released" in response.content.decode()
    row.refresh_from_db()
    assert row.released_at is not None and row.released_by is not None
    assert AuditEvent.objects.filter(action="facility.release", target_id=str(row.pk)).count() == 1
    missing = operator.post("/facility/release", {"level": "rack", "name": "r1"}, follow=True)
    assert "rack=r1 is not held" in missing.content.decode()
    # Held with drain from the page: the hold says so.
    operator.post("/facility/hold", {"level": "rack", "name": "r1", "reason": "swap", "drain": "on"})
    assert Hold.objects.get(released_at__isnull=True).drain is True


def test_a_viewer_sees_no_forms_and_may_not_hold(floor: None, client: Client) -> None:
    services.hold("rack", "r1", reason="PDU swap", actor=None)
    client.force_login(make_user("vera@example.com", role=StaffRole.VIEWER))
    html = client.get("/facility/").content.decode()
    assert 'data-hold="rack=r1"' in html and "PDU swap" in html
    assert 'action="/facility/hold"' not in html and 'action="/facility/release"' not in html
    assert client.post("/facility/hold", {"level": "rack", "name": "r2"}).status_code == 403
    assert client.post("/facility/release", {"level": "rack", "name": "r1"}).status_code == 403
    assert [h.domain for h in services.active_holds()] == ["rack=r1"]
    assert AuditEvent.objects.filter(action__startswith="facility.").count() == 1


def _queries(client: Client) -> int:
    with CaptureQueriesContext(connection) as page:
        assert client.get("/facility/").status_code == 200
    return len(page.captured_queries)


def test_the_queries_do_not_grow_with_the_nodes(operator: Client) -> None:
    model = make_model("big", gpus=1)

    def add(first: int, count: int) -> None:
        for i in range(first, first + count):
            node = make_node(
                f"n{i:03}", gpus=2, labels=at(f"dc{i % 2}", "hall", f"row{i % 3}", f"r{i % 5}", pdu=f"p{i}")
            )
            make_replica(model, node)

    add(0, 3)
    services.hold("row", "row1", reason="", actor=None)
    few = _queries(operator)
    add(3, 27)
    assert _queries(operator) == few
    with CaptureQueriesContext(connection) as selector:
        facility_page()
    assert len(selector.captured_queries) == 5  # nodes, their GPUs, the claiming shards, the holds, budgets
    from apps.facility import power

    power.apply_budgets([{"domain": "row=row1", "watts": 50000}], source="api", replace=False)
    with CaptureQueriesContext(connection) as capped:
        facility_page()
    assert len(capped.captured_queries) == 7  # and the capped nodes' samples, the shards that draw on them
    add(30, 10)
    with CaptureQueriesContext(connection) as more:
        facility_page()
    assert len(more.captured_queries) == 7


def test_power_caps_are_set_shown_as_a_bar_and_removed_from_the_page(operator: Client) -> None:
    from apps.facility.models import Budget

    gpus = [{"index": i, "gpu_class": "H100-80GB", "power_draw_w": 600.0} for i in range(8)]
    make_node("p1", gpus=8, labels=at("dc1", "hall", "row1", "r12", pdu="r12-a"), sample={"gpus": gpus})
    silent = [{"index": i, "gpu_class": "H100-80GB"} for i in range(8)]  # no card says its draw
    make_node("p2", gpus=8, labels=at("dc1", "hall", "row1", "r12", pdu="r12-b"), sample={"gpus": silent})
    answer = operator.post(
        "/facility/budget", {"level": "rack", "name": "r12", "feed_a": "6000", "feed_b": "6000", "redundant": "on"}
    )
    assert answer.status_code == 302
    row = Budget.objects.get(level="rack", name="r12")
    assert (row.cap_watts, row.redundant, row.source) == (6000, True, "console")  # one feed, not both
    event = AuditEvent.objects.get(action="facility.budget")
    assert event.changes == {"cap_watts": [None, 6000]}
    page = operator.get("/facility/").content.decode()
    assert 'data-budget="rack=r12"' in page and 'data-section="rack-power"' in page
    [budget] = facility_page()["budgets"]
    assert (budget["drawn_watts"], budget["draw_unknown"], budget["nodes"]) == (4800.0, 1, 2)
    assert budget["share"] == 80.0 and not budget["over"]
    assert "4.8 kW of 6.0 kW" in page and "(+1 node unknown)" in page
    bad = operator.post("/facility/budget", {"level": "rack", "name": "r13", "watts": "lots"}, follow=True)
    assert "Expected whole watts from 1 to 10000000; got “lots”." in bad.content.decode()
    assert not Budget.objects.filter(name="r13").exists()
    operator.post("/facility/budget", {"level": "rack", "name": "r12", "watts": "4000"})
    assert facility_page()["budgets"][0]["over"]  # 4.8 kW drawn of a 4 kW cap
    assert "over its cap" in operator.get("/facility/").content.decode()
    operator.post("/facility/budget/remove", {"domain": "rack=r12"})
    assert not Budget.objects.exists()
    assert AuditEvent.objects.filter(action="facility.budget_removed").count() == 1
