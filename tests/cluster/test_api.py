"""The nodes API for every action, as an operator, a viewer and a person without a role, with the
queries of its lists pinned."""

from __future__ import annotations

from typing import Any

import pytest

from apps.accounts.models import AuditEvent
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node, Replica
from apps.cluster.reconciler import reconcile
from tests.builders import make_model, make_node
from tests.conftest import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator(db: Any) -> Any:
    from apps.accounts.choices import StaffRole

    return make_user("olga@example.com", role=StaffRole.OPERATOR, name="Olga")


def as_user(api: Any, user: Any) -> Any:
    api.force_authenticate(user)
    return api


def test_the_node_list_costs_the_same_queries_for_two_nodes_or_twenty(api, operator, django_assert_num_queries) -> None:
    for i in range(2):
        make_node(f"n{i}", gpus=2)
    client = as_user(api, operator)
    with django_assert_num_queries(3):  # count, nodes, their GPUs
        assert len(client.get("/api/v1/nodes").json()["results"]) == 2
    for i in range(2, 20):
        make_node(f"n{i}", gpus=2)
    with django_assert_num_queries(3):
        assert len(client.get("/api/v1/nodes").json()["results"]) == 20


def test_an_operator_cordons_and_uncordons_with_a_reason_audited(api, operator) -> None:
    make_node("n1")
    client = as_user(api, operator)
    assert client.post("/api/v1/nodes/n1/cordon", {"reason": "fan"}, format="json").json()["cordoned"] is True
    assert client.post("/api/v1/nodes/n1/cordon", {}, format="json").status_code == 400
    assert client.post("/api/v1/nodes/n1/uncordon").json()["cordoned"] is False
    actions = list(AuditEvent.objects.values_list("action", flat=True))
    assert actions.count("node.cordon") == 1 and actions.count("node.uncordon") == 1


def test_a_drain_through_the_api_moves_the_replica_and_says_how_far_it_got(api, operator) -> None:
    make_node("a", gpus=1)
    model = make_model("m", gpus=1)
    reconcile()
    placed_on = Replica.objects.get(model=model).shards.get().node.name
    make_node("b" if placed_on == "a" else "a2", gpus=1)
    client = as_user(api, operator)
    answer = client.post(f"/api/v1/nodes/{placed_on}/drain", {"grace": 30}, format="json")
    assert answer.status_code == 200
    node = answer.json()
    assert node["cordoned"] is True and node["draining"] is True
    assert node["drain"]["left"] == 1 and node["drain"]["grace"] == 30
    reconcile()
    shown = client.get(f"/api/v1/nodes/{placed_on}").json()["drain"]
    assert shown["replicas"][0]["state"] == "moving"
    assert Replica.objects.filter(model=model, replaces__isnull=False).exists()
    assert AuditEvent.objects.filter(action="node.drain").exists()
    ended = client.post(f"/api/v1/nodes/{placed_on}/uncordon").json()
    assert ended["draining"] is False and ended["drain"] is None


def test_a_drain_refuses_a_grace_out_of_range(api, operator) -> None:
    make_node("n1")
    client = as_user(api, operator)
    answer = client.post("/api/v1/nodes/n1/drain", {"grace": 99999}, format="json")
    assert answer.status_code == 400 and "grace" in answer.json()["errors"]
    assert Node.objects.get(name="n1").drain_requested_at is None


@pytest.mark.parametrize("action", ["cordon", "uncordon", "drain", "revoke"])
def test_a_viewer_and_a_person_without_a_role_may_not_act_on_nodes(api, viola, bob, action: str) -> None:
    make_node("n1")
    for user in (viola, bob):
        answer = as_user(api, user).post(f"/api/v1/nodes/n1/{action}", {"reason": "x"}, format="json")
        assert answer.status_code == 403
    node = Node.objects.get(name="n1")
    assert not node.cordoned and node.drain_requested_at is None and node.revoked_at is None


def test_revoking_a_node_through_the_api(api, operator) -> None:
    make_node("n1")
    answer = as_user(api, operator).post("/api/v1/nodes/n1/revoke")
    assert answer.status_code == 200 and answer.json()["status"] == "revoked"
    assert not Replica.objects.filter(state=ReplicaState.READY).exists()
