"""The models API for every action: apply (strict, with a dry run), target, resources, delete, with
the queries of its list pinned."""

from __future__ import annotations

from typing import Any

import pytest

from apps.accounts.models import AuditEvent
from apps.catalog.models import Model, Profile
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Replica
from apps.cluster.reconciler import desired_shards, reconcile
from apps.quotas.models import UsageRecord
from tests.builders import GB, make_model, make_node, make_replica
from tests.conftest import make_user

pytestmark = pytest.mark.django_db

TINY = {
    "name": "tiny",
    "source": "/models/tiny.gguf",
    "replicas": 1,
    "profiles": [{"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "1GB", "cpu_cores": 1}],
}


@pytest.fixture
def operator(db: Any) -> Any:
    from apps.accounts.choices import StaffRole

    return make_user("olga@example.com", role=StaffRole.OPERATOR, name="Olga")


def as_user(api: Any, user: Any) -> Any:
    api.force_authenticate(user)
    return api


def apply(client: Any, *specs: dict[str, Any], dry_run: bool = False) -> Any:
    return client.post(
        "/api/v1/models/apply", {"models": list(specs), **({"dry_run": True} if dry_run else {})}, format="json"
    )


def with_profile(**changes: Any) -> dict[str, Any]:
    return {**TINY, "profiles": [{**TINY["profiles"][0], **changes}]}


def test_the_model_list_costs_the_same_queries_for_two_models_or_twenty(
    api, operator, django_assert_num_queries
) -> None:
    for i in range(2):
        make_model(f"m{i}", memory_gb=1)
    client = as_user(api, operator)
    with django_assert_num_queries(4):
        assert len(client.get("/api/v1/models").json()["results"]) == 2
    for i in range(2, 20):
        make_model(f"m{i}", memory_gb=1)
    with django_assert_num_queries(4):
        assert len(client.get("/api/v1/models").json()["results"]) == 20


def test_a_typo_in_a_profile_is_an_error_naming_the_path_and_the_nearest_field(api, operator) -> None:
    client = as_user(api, operator)
    assert apply(client, TINY).status_code == 200
    typo = {**TINY, "profiles": [{k: v for k, v in TINY["profiles"][0].items() if k != "memory"} | {"memroy": "1GB"}]}
    answer = apply(client, typo)
    assert answer.status_code == 400
    assert answer.json()["errors"]["models[0].profiles[0].memroy"] == ["unknown field; did you mean memory?"]
    assert Profile.objects.get(model__name="tiny").memory_bytes == GB  # nothing changed


def test_a_typo_of_a_model_field_changes_nothing(api, operator) -> None:
    client = as_user(api, operator)
    apply(client, TINY)
    answer = apply(client, {k: v for k, v in TINY.items() if k != "source"} | {"sourse": "/elsewhere"})
    assert answer.json()["errors"]["models[0].sourse"] == ["unknown field; did you mean source?"]
    assert Model.objects.get(name="tiny").source == "/models/tiny.gguf"
    far = apply(client, {**TINY, "zzz": 1}).json()["errors"]["models[0].zzz"][0]
    assert far.startswith("unknown field; the fields here are ")


def test_a_change_must_keep_the_rules_of_a_new_model(api, operator) -> None:
    client = as_user(api, operator)
    apply(client, TINY)
    # An apply states the whole spec: a CPU profile left without its memory is refused, not reset to 0.
    answer = apply(client, {**TINY, "profiles": [{k: v for k, v in TINY["profiles"][0].items() if k != "memory"}]})
    assert answer.status_code == 400
    assert "memory" in answer.json()["errors"]["models[0].profiles[0].memory"][0]
    assert Profile.objects.get(model__name="tiny").memory_bytes == GB


def test_a_dry_run_lists_field_by_field_what_would_change_and_writes_nothing(api, operator) -> None:
    client = as_user(api, operator)
    apply(client, TINY)
    events = AuditEvent.objects.count()
    answer = apply(client, with_profile(parallel=8, memory="2GB"), dry_run=True).json()
    assert answer["dry_run"] is True
    result = answer["results"][0]
    assert result["outcome"] == "changed"
    assert result["changes"]["profiles"]["cpu"]["parallel"] == [4, 8]
    assert result["changes"]["profiles"]["cpu"]["memory_bytes"] == [GB, 2 * GB]
    assert Profile.objects.get(model__name="tiny").parallel == 4
    assert AuditEvent.objects.count() == events
    assert apply(client, TINY, dry_run=True).json()["results"][0]["outcome"] == "unchanged"


def test_deleting_a_model_stops_its_replicas_keeps_its_usage_and_is_audited(api, operator) -> None:
    node = make_node("n1", gpus=0)
    model = make_model("gone", memory_gb=1, cores=1)
    replica = make_replica(model, node)
    UsageRecord.objects.create(request_id="req_1", model="gone", endpoint="chat.completions", status=200)
    client = as_user(api, operator)
    assert client.delete("/api/v1/models/gone").status_code == 204
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.STOPPING
    assert client.get("/api/v1/models/gone").status_code == 404  # no longer served or listed
    assert desired_shards(node) == []  # the node is told to stop its engine
    assert AuditEvent.objects.filter(action="model.delete").exists()
    refused = apply(client, {**TINY, "name": "gone"})
    assert refused.status_code == 400 and "being deleted" in refused.json()["errors"]["models[0].name"][0]
    from apps.cluster import reports

    reports.record_report(node.pk, [])  # the agent stopped it
    reconcile()
    reconcile()
    assert not Model.objects.filter(name="gone").exists()
    assert UsageRecord.objects.filter(model="gone").exists()
    assert apply(client, {**TINY, "name": "gone"}).status_code == 200  # the name can be used again


@pytest.mark.parametrize("user_name", ["viola", "bob"])
def test_a_viewer_and_a_person_without_a_role_may_not_apply_or_delete(api, user_name: str, request) -> None:
    make_model("kept", memory_gb=1)
    client = as_user(api, request.getfixturevalue(user_name))
    assert apply(client, TINY).status_code == 403
    assert client.delete("/api/v1/models/kept").status_code == 403
    assert Model.objects.filter(name="kept", deleted_at__isnull=True).exists()


def test_explain_breaks_each_fitting_node_score_into_its_scorers_and_says_who_holds_the_weights(api, operator) -> None:
    from apps.cluster.models import Node

    make_node("holder", memory_gb=64)
    make_node("fetcher", memory_gb=64)
    holder = Node.objects.get(name="holder")
    holder.sample = {
        **holder.sample,
        "storage": [{"mount_point": "/", "directories": ["/models"], "weights": ["/models/tiny.gguf"]}],
    }
    holder.save(update_fields=["sample"])
    make_model("tiny", memory_gb=1, cores=1, source="/models/tiny.gguf", replicas=0)
    answer = as_user(api, operator).get("/api/v1/models/tiny/explain").json()
    [profile] = answer["profiles"]
    nodes = {n["node"]: n for n in profile["nodes"]}
    assert nodes["holder"]["weights"] == "holds the weights"
    assert nodes["fetcher"]["weights"] == "must fetch them"
    for node in nodes.values():
        assert node["fits"] and node["scores"]
        assert sum(node["scores"].values()) == pytest.approx(node["score"])
    assert nodes["holder"]["scores"]["weights"] > nodes["fetcher"]["scores"]["weights"]
    assert nodes["holder"]["score"] > nodes["fetcher"]["score"]


def test_explain_says_where_each_placed_replica_runs_with_its_own_claim_released(api, operator) -> None:
    """Two replicas of 2 cores on a 4-core node: each fits where it runs, its sibling counted once;
    one more replica fits nowhere, with both counted."""
    from apps.cluster.reconciler import reconcile

    make_node("vm", cpus=4, memory_gb=8)
    make_model("tiny", memory_gb=1, cores=2, source="/models/tiny.gguf", replicas=2)
    reconcile()
    answer = as_user(api, operator).get("/api/v1/models/tiny/explain").json()
    assert len(answer["placed"]) == 2 and answer["more_placed"] == 0
    for item in answer["placed"]:
        ((node),) = item["nodes"]
        assert node["node"] == "vm" and node["fits"] is True and node["reasons"] == [] and node["scores"]
        assert item["state"] == "starting" and item["reasons"] == []
    [profile] = answer["profiles"]
    assert not profile["fits"]
    assert profile["nodes"][0]["reasons"] == ["node vm has 0 of 4 CPU cores free, needs 2"]


def test_explain_spells_out_as_many_nodes_as_asked_and_counts_the_rest(api, operator) -> None:
    from apps.cluster.models import Node

    for name in ("n1", "n2", "n3", "n4"):
        make_node(name, memory_gb=64)
    Node.objects.filter(name="n4").update(cordoned=True, cordon_reason="fan")
    make_model("tiny", memory_gb=1, cores=1, replicas=0)
    client = as_user(api, operator)
    [every] = client.get("/api/v1/models/tiny/explain").json()["profiles"]
    assert len(every["nodes"]) == 4 and every["more_fit"] == 0 and every["more_refused"] == []
    [two] = client.get("/api/v1/models/tiny/explain?nodes=2").json()["profiles"]
    assert [n["node"] for n in two["nodes"]] == [n["node"] for n in every["nodes"]][:2]
    assert two["more_fit"] == 1
    assert two["more_refused"] == [{"code": "cordoned", "count": 1, "example": "node n4 is cordoned: fan"}]
    bad = client.get("/api/v1/models/tiny/explain?nodes=none")
    assert bad.status_code == 400 and "nodes must be a number or all" in bad.json()["detail"]
    assert client.get("/api/v1/models/tiny/explain?nodes=0").status_code == 400
    assert len(client.get("/api/v1/models/tiny/explain?nodes=all").json()["profiles"][0]["nodes"]) == 4
