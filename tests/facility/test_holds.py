"""Where nodes are (llmgw.io/ labels, the stored ones over the agent's) and holds on a rack, through
`llmgw ctl label`, `ctl nodes --domain`, `ctl facility hold/release` against a live server, and the
placement that follows them."""

from __future__ import annotations

from typing import Any

import pytest

from apps.accounts.models import AuditEvent
from apps.cluster.inventory import build_inventory, replica_request
from apps.cluster.models import Node
from apps.cluster.placement import explain, place
from apps.facility import services
from apps.facility.locations import location, parse_domain
from llmgw.cli import main
from tests.builders import make_model, make_node

RACK = "llmgw.io/rack"


def test_a_location_is_each_level_the_labels_name_and_unknown_otherwise() -> None:
    assert location({RACK: "r12", "llmgw.io/pdu": "r12-a", "zone": "z1"}) == {
        "site": None,
        "room": None,
        "row": None,
        "rack": "r12",
        "pdu": "r12-a",
    }
    assert parse_domain(" Rack = r12 ") == ("rack", "r12")
    for bad in ("r12", "shelf=r1", "rack=", "=r1"):
        with pytest.raises(ValueError, match="LEVEL=NAME"):
            parse_domain(bad)


@pytest.mark.django_db
def test_the_stored_label_wins_over_the_agents() -> None:
    node = make_node("gpu1", gpus=8)
    Node.objects.filter(pk=node.pk).update(
        hardware={**node.hardware, "labels": {RACK: "r1", "llmgw.io/pdu": "p1"}}, labels={RACK: "r2"}
    )
    node.refresh_from_db()
    assert services.node_location(node)["rack"] == "r2" and services.node_location(node)["pdu"] == "p1"
    snapshot = next(iter(build_inventory().nodes.values()))
    assert snapshot.extra["facility"] == {"location": services.node_location(node), "held": []}


@pytest.mark.django_db
def test_nothing_new_is_placed_in_a_held_rack_and_explain_says_which_hold() -> None:
    a = make_node("a1", gpus=8, labels={RACK: "r12"})
    make_node("b1", gpus=4, labels={RACK: "r13"})
    model = make_model("m", gpus=4)
    row = services.hold("rack", "r12", reason="PDU swap", actor=None)
    with pytest.raises(services.HoldError, match="rack=r12 is already held"):
        services.hold("rack", "r12", reason="again", actor=None)
    inventory = build_inventory()
    request = replica_request(model)
    result = place(inventory, request)
    assert result.placement is not None and [s.node_name for s in result.placement.shards] == ["b1"]
    verdicts = {v.node_name: v for e in explain(inventory, request) for v in e.nodes}
    assert verdicts["a1"].reasons[0].message == "node a1 is in rack=r12, which is held: PDU swap"
    assert verdicts["b1"].notes["rack"] == "r13"
    # Released: a1, the emptier-fitting node by binpack... any node may take it again.
    services.release("rack", "r12", actor=None)
    with pytest.raises(services.HoldError, match="rack=r12 is not held"):
        services.release("rack", "r12", actor=None)
    freed = {v.node_name: v for e in explain(build_inventory(), request) for v in e.nodes}
    assert freed["a1"].reasons == []
    actions = list(AuditEvent.objects.filter(target_id=str(row.pk)).values_list("action", flat=True))
    assert sorted(actions) == ["facility.hold", "facility.release"]
    assert a.pk


@pytest.fixture
def ctl(live_server: Any, key_for: Any, monkeypatch: Any, tmp_path: Any) -> Any:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    monkeypatch.setenv("HOME", str(tmp_path))
    secret = key_for(make_user("olga@example.com", role=StaffRole.OPERATOR))

    def run(*args: str, capsys: Any) -> tuple[int, str]:
        status = main(["ctl", "--server", live_server.url, "--key", secret, *args])
        captured = capsys.readouterr()
        return status, captured.out + captured.err

    return run


@pytest.mark.django_db(transaction=True)
def test_label_nodes_list_by_domain_hold_and_release_from_the_cli(ctl: Any, capsys: Any) -> None:
    make_node("gpu1", gpus=8)
    make_node("gpu2", gpus=8)
    make_node("cpu1")
    status, out = ctl("label", "gpu1", "llmgw.io/site=dc1", "llmgw.io/rack=r12", "llmgw.io/pdu=r12-a", capsys=capsys)
    assert status == 0 and "location: dc1/r12 pdu r12-a" in out, out
    assert ctl("label", "gpu2", "llmgw.io/rack=r13", capsys=capsys)[0] == 0
    status, out = ctl("nodes", "--domain", "rack=r12", capsys=capsys)
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split()[7] == "LOCATION"
    assert [line.split()[0] for line in lines[1:]] == ["gpu1"]
    assert "dc1/r12 pdu r12-a" in lines[1]

    status, out = ctl("facility", "hold", "rack=r12", "--reason", "PDU swap", capsys=capsys)
    assert status == 0 and "rack=r12 held" in out
    status, out = ctl("facility", "hold", "rack=r12", capsys=capsys)
    assert status != 0 and "rack=r12 is already held" in out
    status, out = ctl("facility", capsys=capsys)
    assert status == 0
    rows = {line.split()[0]: line for line in out.splitlines()[1:] if "=" in line.split()[0]}
    assert "held: PDU swap" in rows["rack=r12"] and rows["rack=r13"].split()[-1] == "-"
    assert "no location: cpu1" in out
    with pytest.raises(SystemExit) as refused:
        ctl("facility", "hold", "shelf=3", capsys=capsys)
    assert refused.value.code == 2 and "LEVEL=NAME with LEVEL one of" in capsys.readouterr().err

    # A kept label dropped: the node no longer names that rack.
    assert ctl("label", "gpu2", "llmgw.io/rack-", capsys=capsys)[0] == 0
    assert Node.objects.get(name="gpu2").labels == {}
    status, out = ctl("facility", "release", "rack=r12", capsys=capsys)
    assert status == 0 and "rack=r12 released" in out
    assert services.active_holds() == []
    assert AuditEvent.objects.filter(action="node.labels").count() == 3
    status, out = ctl("facility", "hold", "rack=r12", "--drain", "--reason", "swap", capsys=capsys)
    assert status == 0 and "its replicas are moved out" in out
    assert "draining: swap" in ctl("facility", capsys=capsys)[1]
    assert [h.drain for h in services.active_holds()] == [True]
    status, out = ctl(
        "facility", "budget", "rack=r12", "--feed", "A=17300", "--feed", "B=17300", "--redundant", capsys=capsys
    )
    assert status == 0 and "rack=r12: cap 17.3 kW (one feed of an A/B pair)" in out, out
    line = next(line for line in ctl("facility", capsys=capsys)[1].splitlines() if line.startswith("rack=r12"))
    assert line.split()[3:6] == ["1.0", "kW", "17.3"]  # gpu1's eight cards at 120.5 W; cap one feed


@pytest.mark.django_db
def test_the_node_page_sets_the_location_and_the_nodes_page_shows_it(client: Any) -> None:
    from apps.accounts.choices import StaffRole
    from tests.conftest import make_user

    node = make_node("gpu1", gpus=8)
    Node.objects.filter(pk=node.pk).update(hardware={**node.hardware, "labels": {RACK: "r1", "llmgw.io/site": "dc1"}})
    client.force_login(make_user("olga@example.com", role=StaffRole.OPERATOR))
    page = client.get("/nodes/gpu1/").content.decode()
    assert 'name="rack" maxlength="100" value="r1"' in page and "The agent says r1" in page
    answer = client.post("/nodes/gpu1/location", {"site": "dc1", "rack": "r12", "pdu": "r12-a"})
    assert answer.status_code == 302 and answer["Location"].endswith("/nodes/gpu1/#location")
    assert Node.objects.get(pk=node.pk).labels == {"llmgw.io/site": "dc1", RACK: "r12", "llmgw.io/pdu": "r12-a"}
    listing = client.get("/nodes/").content.decode()
    assert "dc1/r12 · PDU r12-a" in listing
    # Emptied: the kept rack goes and the agent's shows again.
    client.post("/nodes/gpu1/location", {"site": "dc1", "rack": "", "pdu": "r12-a"})
    assert services.node_location(Node.objects.get(pk=node.pk))["rack"] == "r1"
    assert AuditEvent.objects.filter(action="node.labels").count() == 2
