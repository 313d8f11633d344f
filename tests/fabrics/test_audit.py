"""Fabric tests and fabric maps asked for by an operator are audited: who asked, for which nodes, from
which address, and so is a failed request to a node retried. The API is how they are asked for
(`llmgw ctl fabric-test` is its client); the maps the beat asks for on its own are not operators'
actions and leave no event."""

from __future__ import annotations

from typing import Any

import pytest

from apps.accounts.choices import StaffRole
from apps.accounts.models import AuditEvent, User
from apps.cluster.choices import NodeStatus
from apps.cluster.models import AgentRequest, Node
from apps.fabrics import maps, services
from apps.fabrics.models import FabricTest
from tests.conftest import make_user

pytestmark = pytest.mark.django_db

SM = "0x000000000000000a"
FABRIC = f"ib:{SM}"


def node(name: str, address: str, *, sm: str = SM) -> Node:
    row = Node.objects.create(
        name=name, status=NodeStatus.READY, features=["ibnetdiscover.v1", "perftest.v1"], address=address
    )
    port = {"device": "mlx5_0", "port": 1, "fabric": "ib-a", "link_layer": "InfiniBand", "up": True}
    services.record_fabrics(row.pk, {"ports": [{**port, "rate_gbps": 200.0, "sm_guid": sm}], "declared": ["ib-a"]})
    return row


def operator() -> User:
    return make_user("olga@example.com", role=StaffRole.OPERATOR)


def test_a_fabric_test_started_through_the_api_is_audited_with_who_which_nodes_and_from_where(api: Any) -> None:
    node("n1", "10.0.0.1")
    node("n2", "10.0.0.2")
    olga = operator()
    api.force_authenticate(olga)
    answer = api.post(
        "/api/v1/fabric-tests", {"a": "n1", "b": "n2", "duration": 3}, format="json", REMOTE_ADDR="10.9.8.7"
    )
    assert answer.status_code == 202, answer.json()
    event = AuditEvent.objects.get(action="fabric.test")
    assert (event.actor, event.address) == (olga, "10.9.8.7")
    assert (event.target_type, event.target_id) == ("fabrics.fabrictest", str(answer.json()["id"]))
    assert event.changes == {"client": "n1", "server": "n2", "fabric": FABRIC, "duration_s": 3}


def test_a_fabric_test_refused_leaves_no_test_and_no_event(api: Any) -> None:
    node("n1", "10.0.0.1")
    node("n2", "10.0.0.2", sm="0x000000000000000b")  # on another fabric
    api.force_authenticate(operator())
    answer = api.post("/api/v1/fabric-tests", {"a": "n1", "b": "n2"}, format="json")
    assert answer.status_code == 409
    assert "share no fabric" in answer.json()["detail"]
    assert not FabricTest.objects.exists()
    assert not AuditEvent.objects.filter(action="fabric.test").exists()


def test_a_map_asked_for_through_the_api_is_audited_and_the_beats_are_not(api: Any) -> None:
    mapper = node("n1", "10.0.0.1")
    olga = operator()
    api.force_authenticate(olga)
    answer = api.post(f"/api/v1/fabrics/{FABRIC}/topology", REMOTE_ADDR="10.9.8.7")
    assert answer.status_code == 202, answer.json()
    assert answer.json()["node"] == "n1"
    event = AuditEvent.objects.get(action="fabric.map")
    assert (event.actor, event.address) == (olga, "10.9.8.7")
    assert (event.target_type, event.target_id) == ("cluster.agentrequest", str(answer.json()["request"]))
    assert event.changes == {"fabric": FABRIC, "node": "n1", "device": "mlx5_0", "port": 1}
    AgentRequest.objects.filter(node=mapper).update(state=AgentRequest.State.ANSWERED)
    assert len(maps.map_fabrics()) == 1  # the beat's own request
    assert AuditEvent.objects.filter(action="fabric.map").count() == 1


def test_a_map_no_node_can_make_leaves_no_event(api: Any) -> None:
    api.force_authenticate(operator())
    answer = api.post(f"/api/v1/fabrics/{FABRIC}/topology")
    assert answer.status_code == 409
    assert not AuditEvent.objects.filter(action="fabric.map").exists()


def test_only_operators_may_ask(api: Any) -> None:
    node("n1", "10.0.0.1")
    node("n2", "10.0.0.2")
    api.force_authenticate(make_user("vic@example.com", role=StaffRole.VIEWER))
    assert api.post("/api/v1/fabric-tests", {"a": "n1", "b": "n2"}, format="json").status_code == 403
    assert api.post(f"/api/v1/fabrics/{FABRIC}/topology").status_code == 403
    assert not AuditEvent.objects.filter(action__startswith="fabric.").exists()


def test_a_failed_map_request_retried_through_the_api_is_audited(api: Any) -> None:
    mapper = node("n1", "10.0.0.1")
    failed = AgentRequest.objects.create(
        node=mapper, kind="ibnetdiscover", params={"fabric": FABRIC}, state=AgentRequest.State.FAILED
    )
    olga = operator()
    api.force_authenticate(olga)
    answer = api.post(f"/api/v1/agent-requests/{failed.pk}/retry", REMOTE_ADDR="10.9.8.7")
    assert answer.status_code == 202, answer.json()
    event = AuditEvent.objects.get(action="agent_request.retry")
    assert (event.actor, event.address, event.target_id) == (olga, "10.9.8.7", str(answer.json()["id"]))
    assert event.changes == {"node": "n1", "kind": "ibnetdiscover", "retry_of": failed.pk}
