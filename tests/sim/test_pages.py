"""The simulator as people reach it: the console page, the API and the cluster page's what-if
questions on the live fleet, which change nothing of it."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from apps.accounts.choices import StaffRole
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node, Replica
from tests.builders import make_model, make_node
from tests.conftest import make_user
from tests.llmgw.test_csp import check_body, check_strict

pytestmark = pytest.mark.django_db

SCENARIO = """\
duration: 20m
node_types:
  l4: {gpus: {class: L4, count: 4}, cpus: 64, memory: 512GiB}
nodes:
  - {type: l4, count: 4, rack: {size: 2}}
models:
  - {name: chat, min: 3, max: 6, profiles: [{accelerator: L4, gpus: 2}]}
  - {name: huge, min: 1, profiles: [{accelerator: L4, gpus: 8}]}
events:
  - {at: 5m, lose: {rack: r01}}
report: {model: chat}
"""


def signed_in(role: str) -> Client:
    client = Client()
    client.force_login(make_user(f"{role}@example.com", role=role))
    return client


def test_a_scenario_pasted_on_the_page_is_run_and_reported() -> None:
    client = signed_in(StaffRole.VIEWER)  # it only computes: a viewer may ask
    page = client.get("/sim/")
    assert page.status_code == 200 and b"node_types:" in page.content  # an example to start from
    response = client.post("/sim/", {"scenario": SCENARIO})
    body = response.content.decode()
    assert response.status_code == 200 and "data-report" in body
    check_body(response, check_strict(response, "/sim/"), "/sim/")
    # 4 nodes x 4 L4: chat's 3 replicas placed, "huge" (8 cards) fits no node and says why.
    # After rack r01 (two nodes) is lost, chat's three replicas fit on the two left: only huge waits.
    assert "data-end-pending>1<" in body
    pending = body[body.index("data-pending") :]
    assert "huge#" in pending and "needs 8" in pending and "<svg" in body
    assert "lose rack=r01" in body


def test_a_wrong_scenario_says_where_and_keeps_what_was_typed() -> None:
    client = signed_in(StaffRole.OPERATOR)
    wrong = SCENARIO.replace("min: 3", "minimum: 3")
    response = client.post("/sim/", {"scenario": wrong})
    body = response.content.decode()
    assert response.status_code == 200 and "data-problems" in body and "data-report" not in body
    assert "models[0].minimum" in body and "min" in body  # the path, and what was meant
    assert "minimum: 3" in body  # nothing typed is lost


def test_the_api_runs_a_scenario_and_refuses_a_wrong_one_with_the_fields(api: Any, key_for: Any) -> None:
    operator = make_user("op@example.com", role=StaffRole.OPERATOR)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(operator)}")
    report = api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json")
    assert report.status_code == 200, report.content
    data = report.json()
    assert data["scenario"]["gpus"] == 16 and len(data["snapshots"]) == 3
    start, lost, end = data["snapshots"]
    assert lost["event"] == "lose rack=r01" and lost["nodes_ready"] == 2
    assert start["headroom"]["model"] == "chat" and [r["replica"].split("#")[0] for r in end["pending"]] == ["huge"]
    assert data["timing"]["per_step_ms"] is not None
    wrong = api.post("/api/v1/sim", {"scenario": "duration: 1m\nnodes: [{type: nope, count: 1}]\n"}, format="json")
    assert wrong.status_code == 400
    assert wrong.json()["detail"] and any("nodes[0].type" in p for p in wrong.json()["errors"]["scenario"])
    both = api.post("/api/v1/sim", {}, format="json")
    assert both.status_code == 400 and both.json()["detail"]
    viewer = make_user("v@example.com", role=StaffRole.VIEWER)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(viewer)}")
    assert api.post("/api/v1/sim", {"scenario": SCENARIO}, format="json").status_code == 403


@pytest.fixture
def live() -> None:
    for i in range(6):
        make_node(f"gpu{i:02d}", gpus=8, address=f"10.0.0.{i + 1}", labels={"llmgw.io/rack": f"r{i // 3}"})
    make_model("chat", replicas=4, gpus=4)
    from apps.cluster.reconciler import reconcile

    reconcile()


def _state() -> list[Any]:
    replicas = Replica.objects.select_related("model").prefetch_related("shards__node")
    return sorted(
        (r.model.name, r.state, sorted((s.node.name, tuple(s.gpu_indices)) for s in r.shards.all())) for r in replicas
    ) + sorted((n.name, n.status, n.cordoned, n.drain_requested_at) for n in Node.objects.all())


def test_what_if_from_the_cluster_page_answers_on_the_live_fleet_and_changes_nothing(live: None) -> None:
    client = signed_in(StaffRole.OPERATOR)
    cluster = client.get("/cluster/").content.decode()
    for kind in ("node", "rack", "pdu", "model"):
        assert f'data-what-if="{kind}"' in cluster
    before = _state()
    assert Replica.objects.filter(state=ReplicaState.PENDING).count() == 0
    rack = client.get("/sim/what-if", {"rack": "r0"}).content.decode()
    assert "What if rack r0 went away" in rack and "data-report" in rack
    # Three of six nodes gone: the snapshot after the event says so.
    assert "<td>lose rack=r0</td>" in rack.replace("&#x27;", "'") or "lose rack=r0" in rack
    model = client.get("/sim/what-if", {"model": "chat", "min": "9"}).content.decode()
    assert "What if the minimum of chat were 9" in model
    # 6 x 8 cards hold 12 replicas of 4: nine fit, and three more would still fit after.
    assert "data-end-pending>0<" in model
    unknown = client.get("/sim/what-if", {"node": "gpu99"}).content.decode()
    assert "data-problems" in unknown and "gpu99" in unknown
    bad = client.get("/sim/what-if", {"model": "chat", "min": "lots"}).content.decode()
    assert "whole number" in bad
    assert _state() == before


def test_what_if_through_the_api(live: None, api: Any, key_for: Any) -> None:
    operator = make_user("op@example.com", role=StaffRole.OPERATOR)
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {key_for(operator)}")
    before = _state()
    answer = api.post("/api/v1/sim", {"what_if": {"kind": "node", "name": "gpu00"}}, format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["snapshots"][1]["nodes_ready"] == 5
    no_min = api.post("/api/v1/sim", {"what_if": {"kind": "model", "name": "chat"}}, format="json")
    assert no_min.status_code == 400 and "what_if" in no_min.json()["errors"]
    unknown = api.post("/api/v1/sim", {"what_if": {"kind": "rack", "name": "r9"}}, format="json")
    assert unknown.status_code == 400 and unknown.json()["errors"]["what_if"]
    assert _state() == before


def test_llmgw_sim_from_cluster_starts_from_the_live_fleet(live: None, tmp_path: Any, capsys: Any) -> None:
    import json

    from llmgw.cli import main

    before = _state()
    scenario = tmp_path / "lose.yaml"
    scenario.write_text("duration: 10m\nevents:\n  - {at: 2m, lose: {rack: r1}}\nreport: {model: chat}\n")
    assert main(["sim", str(scenario), "--from-cluster", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    start, lost, _end = report["snapshots"]
    assert report["scenario"]["nodes"] == 6 and start["replicas"]["starting"] == 4  # as the database has them
    assert lost["nodes_ready"] == 3 and start["headroom"]["more_replicas"] == 8  # 48 cards, 16 held
    # Without the flag the file describes no nodes: refused, saying what is missing.
    assert main(["sim", str(scenario)]) == 2
    assert "describe at least one group of nodes" in capsys.readouterr().err
    assert _state() == before


@pytest.mark.parametrize("language", ["", "tr/"])
def test_the_manuals_example_scenario_runs_as_written(language: str, settings: Any) -> None:
    import re

    import yaml

    from apps.sim.service import simulate_text
    from tests.e2e.helpers import REPO

    text = (REPO / "docs" / f"{language}sim.md").read_text()
    example = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert example is not None
    english = re.search(r"```yaml\n(.*?)```", (REPO / "docs" / "sim.md").read_text(), re.S)
    assert english is not None and yaml.safe_load(example.group(1)) == yaml.safe_load(english.group(1))
    from tests.sim.test_sim import FIXTURES

    settings.SIM_CAPTURES_DIR = FIXTURES
    report = simulate_text(example.group(1))
    assert [s["label"] for s in report["snapshots"]][0] == "start" and len(report["snapshots"]) == 6
    assert report["snapshots"][0]["headroom"]["model"] == "chat"
