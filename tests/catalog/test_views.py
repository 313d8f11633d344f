from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from apps.accounts.models import AuditEvent
from apps.catalog.models import Model
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Replica, Shard
from tests.builders import GB, make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

# The model most of these pages show: one llama.cpp profile "cpu" of 8 GiB and 4 cores, up to 2 replicas.
QWEN: dict[str, Any] = {"max_replicas": 2, "profile": "cpu", "memory_gb": 8, "cores": 4}


@pytest.fixture
def placement() -> None:
    """The card's headroom, explain and a changed target dry-run or wake the placement package.

    It is written apart from these pages; until it imports, the tests that need it are skipped.
    """
    pytest.importorskip("apps.cluster.placement")
    pytest.importorskip("apps.cluster.inventory", exc_type=ImportError)
    pytest.importorskip("apps.cluster.reconciler", exc_type=ImportError)


def signed_in(client: Client, user: Any) -> Client:
    client.force_login(user)
    return client


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html)).strip()


def row(content: bytes | str, attribute: str, value: Any) -> str:
    html = content.decode() if isinstance(content, bytes) else content
    found = re.search(rf'<tr {attribute}="{re.escape(str(value))}">(.*?)</tr>', html, re.S)
    assert found is not None, f"no row {attribute}={value}"
    return found.group(1)


def cell(content: bytes | str, attribute: str, value: Any, column: str) -> str:
    found = re.search(rf'<td data-col="{column}"[^>]*>(.*?)</td>', row(content, attribute, value), re.S)
    assert found is not None, f"no {column} cell"
    return found.group(1)


def error(content: bytes, field: str) -> str:
    found = re.search(rf'data-error="{field}">(.*?)<', content.decode(), re.S)
    assert found is not None, f"no error on {field}"
    return found.group(1)


# Who may see and do what ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,path",
    [
        ("get", "/models/"),
        ("get", "/models/qwen/"),
        ("get", "/models/qwen/explain"),
        ("post", "/models/qwen/target"),
        ("post", "/models/qwen/class"),
        ("post", "/models/qwen/resources"),
    ],
)
def test_an_outsider_is_refused_every_model_page(client: Client, bob, method: str, path: str) -> None:
    make_model("qwen", **QWEN)
    data = (
        {
            "min_replicas": 3,
            "max_replicas": 4,
            "capacity_class": "critical",
            "profile": "cpu",
            "memory": "16GiB",
            "cpu_cores": 8,
        }
        if method == "post"
        else {}
    )
    assert getattr(signed_in(client, bob), method)(path, data).status_code == 403
    model = Model.objects.get()
    assert (model.min_replicas, model.max_replicas, model.capacity_class) == (1, 2, "")
    assert model.profiles.get().memory_bytes == 8 * GB
    assert not AuditEvent.objects.exists()


@pytest.mark.parametrize("path", ["/models/nope/", "/models/nope/explain"])
def test_an_outsider_is_refused_even_for_a_model_that_does_not_exist(client: Client, bob, path: str) -> None:
    assert signed_in(client, bob).get(path).status_code == 403
    assert client.post("/models/nope/class", {"capacity_class": "critical"}).status_code == 403


def test_strangers_are_asked_to_sign_in(client: Client) -> None:
    response = client.get("/models/")
    assert response.status_code == 302 and response["Location"].startswith("/login/")


@pytest.mark.parametrize("path", ["/models/nope/", "/models/nope/explain"])
def test_an_unknown_model_is_not_found(client: Client, viola, path: str) -> None:
    assert signed_in(client, viola).get(path).status_code == 404


def test_changing_an_unknown_model_is_not_found(client: Client, alice) -> None:
    assert signed_in(client, alice).post("/models/nope/class", {"capacity_class": "critical"}).status_code == 404


def test_the_nav_links_to_models_for_readers_only(client: Client, bob, viola) -> None:
    assert b'href="/models/"' not in signed_in(client, bob).get("/").content
    assert b'href="/models/"' in signed_in(client, viola).get("/").content


def test_a_viewer_may_not_change_a_model(client: Client, viola) -> None:
    make_model("qwen", **QWEN)
    signed_in(client, viola)
    assert client.post("/models/qwen/target", {"min_replicas": 0, "max_replicas": 1}).status_code == 403
    assert client.post("/models/qwen/class", {"capacity_class": "critical"}).status_code == 403
    assert (
        client.post("/models/qwen/resources", {"profile": "cpu", "memory": "1GiB", "cpu_cores": 1}).status_code == 403
    )
    model = Model.objects.get()
    assert (model.min_replicas, model.max_replicas, model.capacity_class) == (1, 2, "")
    assert model.profiles.get().memory_bytes == 8 * GB
    assert not AuditEvent.objects.exists()


def test_a_viewer_reads_the_card_without_forms(client: Client, viola, placement) -> None:
    make_model("qwen", **QWEN)
    response = signed_in(client, viola).get("/models/qwen/")
    assert response.status_code == 200
    assert b"data-form=" not in response.content
    assert b"/models/qwen/target" not in response.content


# The models list --------------------------------------------------------------------------------------


def test_the_list_says_how_each_model_runs_and_where(client: Client, viola) -> None:
    first, second = make_node("gpu-r1-01"), make_node("gpu-r1-02")
    model = make_model(
        "qwen", replicas=2, max_replicas=3, profile="cpu", memory_gb=8, cores=4, capacity_class="critical"
    )
    make_replica(model, first)
    make_replica(model, second, state=ReplicaState.STARTING)
    make_replica(model, state=ReplicaState.PENDING, message="No node has 8 GB of memory free.")
    make_replica(model, second, state=ReplicaState.FAILED)
    make_model("opt", external_url="https://api.example.com/v1")
    content = signed_in(client, viola).get("/models/").content
    assert b'href="/models/qwen/"' in content
    assert text(cell(content, "data-model", "qwen", "class")) == "critical"
    assert text(cell(content, "data-model", "qwen", "ready")) == "1/2"
    assert text(cell(content, "data-model", "qwen", "starting")) == "1"
    pending = cell(content, "data-model", "qwen", "pending")
    assert text(pending) == "1" and 'title="No node has 8 GB of memory free."' in pending
    assert text(cell(content, "data-model", "qwen", "failed")) == "1"
    nodes = cell(content, "data-model", "qwen", "nodes")
    assert text(nodes) == "01, 02"
    assert 'title="gpu-r1-01"' in nodes and 'title="gpu-r1-02"' in nodes
    assert text(cell(content, "data-model", "qwen", "runs-on")) == "llama.cpp cpu"
    assert b'hx-trigger="every 5s"' in content


def test_an_external_model_shows_its_provider_and_dashes(client: Client, viola) -> None:
    make_model("opt", external_url="https://api.example.com/v1")
    content = signed_in(client, viola).get("/models/").content
    runs_on = cell(content, "data-model", "opt", "runs-on")
    assert text(runs_on) == "external" and 'title="https://api.example.com/v1"' in runs_on
    for column in ("ready", "starting", "pending", "failed", "nodes"):
        assert text(cell(content, "data-model", "opt", column)) == "-"


def test_a_model_without_a_class_shows_the_one_it_follows(client: Client, viola) -> None:
    make_model("lazy", replicas=0, max_replicas=1, profile="cpu", memory_gb=8, cores=4)
    content = signed_in(client, viola).get("/models/").content
    assert text(cell(content, "data-model", "lazy", "class")) == "opportunistic"
    assert text(cell(content, "data-model", "lazy", "ready")) == "0/0"
    assert text(cell(content, "data-model", "lazy", "nodes")) == "-"


def test_node_names_without_a_shared_prefix_stay_whole(client: Client, viola) -> None:
    model = make_model("qwen", **QWEN)
    make_replica(model, make_node("alpha"))
    make_node("beta")
    assert text(cell(signed_in(client, viola).get("/models/").content, "data-model", "qwen", "nodes")) == "alpha"


def test_an_htmx_refresh_of_the_list_gets_only_the_table(client: Client, viola) -> None:
    make_model("qwen", **QWEN)
    response = signed_in(client, viola).get("/models/", headers={"HX-Request": "true"})
    body = response.content.decode().strip()
    assert body.startswith('<div id="model-table"')
    assert "<html" not in body and 'data-model="qwen"' in body
    boosted = client.get("/models/", headers={"HX-Request": "true", "HX-Boosted": "true"})
    assert b"<html" in boosted.content


def test_the_list_does_not_query_per_model(client: Client, alice, django_assert_max_num_queries) -> None:
    nodes = [make_node(f"cpu-{i:02d}") for i in range(4)]
    for i in range(20):
        model = make_model(f"m{i:02d}", **QWEN)
        make_replica(model, nodes[i % 4])
        make_replica(model, nodes[(i + 1) % 4], also_on=(nodes[(i + 2) % 4],), state=ReplicaState.STARTING)
    signed_in(client, alice)
    # session, user, models, profiles, replicas, shards with their nodes, every node's name
    with django_assert_max_num_queries(7):
        response = client.get("/models/")
    assert response.content.count(b"<tr data-model=") == 20


# The card ------------------------------------------------------------------------------------------


def test_the_card_shows_the_model_its_profiles_and_replicas(client: Client, alice, placement) -> None:
    node = make_node("cpu-01")
    model = make_model("qwen", **QWEN, source="/models/qwen.gguf", fallbacks=["opt"])
    replica = make_replica(model, node, state=ReplicaState.FAILED, message="engine exited")
    Shard.objects.filter(replica=replica).update(exit_code=137, log_tail=["loading", "killed: out of memory"])
    content = signed_in(client, alice).get("/models/qwen/").content
    html = content.decode()
    assert 'href="/models/opt/"' in html and "/models/qwen.gguf" in html
    profile = row(content, "data-profile", "cpu")
    assert "8.0 GiB" in profile and "llama.cpp" in profile
    assert re.search(r'data-field="headroom">\s*\d+ more fit now, \d+ with preemption', html)
    replica_row = row(content, "data-replica", replica.pk)
    assert "failed" in replica_row and "cpu-01" in replica_row and 'title="engine exited"' in replica_row
    notes = row(content, "data-replica-notes", replica.pk)
    # A failed replica's notes are open: the real reason is in its engine's last lines, not its exit code.
    assert "<details open>" in notes and "exit code 137" in notes and "killed: out of memory" in notes
    assert 'data-form="target"' in html and 'data-form="class"' in html and 'data-profile="cpu"' in html
    assert 'href="/models/qwen/explain"' in html


def test_measured_use_stands_beside_the_claim_and_is_a_dash_without_a_fresh_sample(client: Client, viola) -> None:
    model = make_model("qwen", **QWEN)
    measured = make_node("cpu-01")
    quiet = make_node("cpu-02", sample=False)
    stale = make_node("cpu-03")
    one = make_replica(model, measured)
    two = make_replica(model, quiet)
    three = make_replica(model, stale)
    measured.sample["shards"] = [{"shard": f"r{one.pk}s0", "cpu_cores": 2.5, "memory_bytes": 3 * GB}]
    measured.save(update_fields=["sample"])
    stale.sample["shards"] = [{"shard": f"r{three.pk}s0", "cpu_cores": 2.5, "memory_bytes": 3 * GB}]
    stale.sampled_at = timezone.now() - timedelta(minutes=5)
    stale.save(update_fields=["sample", "sampled_at"])
    # The htmx refresh of the replicas, which needs no dry run of placement.
    content = signed_in(client, viola).get("/models/qwen/", headers={"HX-Request": "true"}).content
    assert text(cell(content, "data-replica", one.pk, "cpu")) == "2.5 of 4.0"
    assert text(cell(content, "data-replica", one.pk, "memory")) == "3.0 GiB of 8.0 GiB"
    for replica in (two, three):
        assert text(cell(content, "data-replica", replica.pk, "cpu")) == "- of 4.0"
        assert text(cell(content, "data-replica", replica.pk, "memory")) == "- of 8.0 GiB"


def test_a_replica_over_its_memory_claim_is_marked(client: Client, viola) -> None:
    model = make_model("qwen", max_replicas=2, profile="cpu", memory_gb=2, cores=4)
    node = make_node("cpu-01")
    replica = make_replica(model, node)
    node.sample["shards"] = [{"shard": f"r{replica.pk}s0", "cpu_cores": 1, "memory_bytes": 3 * GB}]
    node.save(update_fields=["sample"])
    memory = cell(
        signed_in(client, viola).get("/models/qwen/", headers={"HX-Request": "true"}).content,
        "data-replica",
        replica.pk,
        "memory",
    )
    assert "more memory than it claims" in memory


def test_a_pending_replica_has_dashes_not_zeros(client: Client, viola) -> None:
    replica = make_replica(make_model("qwen", **QWEN), state=ReplicaState.PENDING, message="No node fits.")
    content = signed_in(client, viola).get("/models/qwen/", headers={"HX-Request": "true"}).content
    for column in ("nodes", "gpus", "port"):
        assert text(cell(content, "data-replica", replica.pk, column)) == "-"
    assert text(cell(content, "data-replica", replica.pk, "cpu")) == "-"
    assert text(cell(content, "data-replica", replica.pk, "memory")) == "-"
    assert "No node fits." in row(content, "data-replica", replica.pk)


def test_an_htmx_refresh_of_the_card_gets_only_the_replicas(client: Client, viola) -> None:
    make_replica(make_model("qwen", **QWEN), make_node("cpu-01"))
    body = signed_in(client, viola).get("/models/qwen/", headers={"HX-Request": "true"}).content.decode().strip()
    assert body.startswith('<section id="model-replicas"')
    assert "<html" not in body and 'data-section="profiles"' not in body and "data-replica=" in body


def test_an_external_model_card_names_its_provider(client: Client, viola) -> None:
    make_model("opt", external_url="https://api.example.com/v1")
    content = signed_in(client, viola).get("/models/opt/").content.decode()
    assert "https://api.example.com/v1" in content and "gpt-x" in content
    assert 'data-section="replicas"' not in content and 'data-field="headroom"' not in content


# Changing a model ------------------------------------------------------------------------------------


def test_the_card_says_under_a_pending_replica_why_no_node_takes_it(client: Client, alice, placement) -> None:
    """A node that refused to fetch the weights (its agent's words) is the reason on the card."""
    from apps.cluster.models import Node
    from apps.cluster.reconciler import reconcile

    node = make_node("vm", cpus=2, memory_gb=8)
    folder = "/var/lib/llmgw/models/mirror/acme--tiny-GGUF/" + "c" * 40
    reason = f"{folder} is not inside this node's model_dirs (/home/me/var/models)"
    sample = {**node.sample, "mirror": [{"version": 1, "dir": folder, "state": "refused", "message": reason}]}
    Node.objects.filter(pk=node.pk).update(sample=sample)
    make_model("tiny", profile="cpu", memory_gb=1, cores=1, source=f"{folder}/tiny.gguf")
    reconcile()
    (replica,) = Replica.objects.filter(model__name="tiny")
    content = signed_in(client, alice).get("/models/tiny/").content
    shown = re.findall(r"<li>(.*?)</li>", row(content, "data-replica-refusals", replica.pk))
    assert shown[0] == f"node vm refused to fetch {folder}/tiny.gguf: {reason}".replace("'", "&#x27;")
    assert shown[1:] == ["no node can take profile cpu: 1 of 1 nodes refused it"]


def test_an_admin_sets_the_replica_counts(client: Client, alice, placement) -> None:
    model = make_model("qwen", **QWEN)
    response = signed_in(client, alice).post("/models/qwen/target", {"min_replicas": 0, "max_replicas": 3})
    assert response.status_code == 302 and response["Location"] == "/models/qwen/"
    model.refresh_from_db()
    assert (model.min_replicas, model.max_replicas) == (0, 3)
    event = AuditEvent.objects.get(action="model.target")
    assert event.actor == alice and event.changes == {"max_replicas": [2, 3], "min_replicas": [1, 0]}
    assert "0 always running, up to 3 under load" in client.get("/models/qwen/").content.decode()


def test_only_what_changed_is_applied(client: Client, alice, placement) -> None:
    make_model("qwen", **QWEN)
    signed_in(client, alice).post("/models/qwen/target", {"min_replicas": 1, "max_replicas": 4})
    assert AuditEvent.objects.get(action="model.target").changes == {"max_replicas": [2, 4]}


def test_posting_the_same_values_writes_nothing(client: Client, alice) -> None:
    make_model("qwen", **QWEN, capacity_class="standard")
    signed_in(client, alice)
    response = client.post("/models/qwen/target", {"min_replicas": 1, "max_replicas": 2})
    assert response.status_code == 302 and response["Location"] == "/models/qwen/"
    client.post("/models/qwen/class", {"capacity_class": "standard"})
    client.post("/models/qwen/resources", {"profile": "cpu", "memory": "8GiB", "cpu_cores": "4.0"})
    assert not AuditEvent.objects.exists()


def test_an_admin_sets_the_capacity_class(client: Client, alice) -> None:
    model = make_model("qwen", **QWEN)
    response = signed_in(client, alice).post("/models/qwen/class", {"capacity_class": "critical"})
    assert response.status_code == 302 and response["Location"] == "/models/qwen/"
    model.refresh_from_db()
    assert model.capacity_class == "critical"
    event = AuditEvent.objects.get(action="model.class")
    assert event.actor == alice and event.changes == {"capacity_class": ["", "critical"]}


def test_an_admin_sets_memory_and_cores_of_a_profile(client: Client, alice) -> None:
    model = make_model("qwen", **QWEN)
    signed_in(client, alice).post("/models/qwen/resources", {"profile": "cpu", "memory": "12GiB", "cpu_cores": "4"})
    profile = model.profiles.get()
    assert (profile.memory_bytes, profile.cpu_cores) == (12 * GB, 4)
    assert AuditEvent.objects.get(action="profile.resources").changes == {"memory_bytes": [8 * GB, 12 * GB]}


def test_fewer_under_load_than_always_running_is_refused(client: Client, alice, placement) -> None:
    model = make_model("qwen", replicas=2, max_replicas=2, profile="cpu", memory_gb=8, cores=4)
    response = signed_in(client, alice).post("/models/qwen/target", {"min_replicas": 2, "max_replicas": 1})
    assert response.status_code == 200
    assert "cannot be fewer than always-running replicas (2)" in error(response.content, "max_replicas")
    model.refresh_from_db()
    assert (model.min_replicas, model.max_replicas) == (2, 2)
    assert 'data-field="max">2<' in response.content.decode()
    assert not AuditEvent.objects.exists()


def test_memory_that_is_not_a_size_is_refused(client: Client, alice, placement) -> None:
    model = make_model("qwen", **QWEN)
    response = signed_in(client, alice).post(
        "/models/qwen/resources", {"profile": "cpu", "memory": "lots", "cpu_cores": "6"}
    )
    assert response.status_code == 200
    assert "“lots”" in error(response.content, "memory")
    profile = model.profiles.get()
    assert (profile.memory_bytes, profile.cpu_cores) == (8 * GB, 4)
    assert not AuditEvent.objects.exists()


def test_an_unknown_profile_is_refused(client: Client, alice, placement) -> None:
    make_model("qwen", **QWEN)
    response = signed_in(client, alice).post(
        "/models/qwen/resources", {"profile": "gpu", "memory": "1GiB", "cpu_cores": "1"}
    )
    assert "No profile “gpu”" in error(response.content, "resources")
    assert not AuditEvent.objects.exists()


def test_more_always_running_replicas_than_fit_are_refused_with_the_numbers(client: Client, alice, placement) -> None:
    make_node("cpu-01", memory_gb=16)
    model = make_model("qwen", replicas=0, max_replicas=1, profile="cpu", memory_gb=12, cores=1)
    response = signed_in(client, alice).post("/models/qwen/target", {"min_replicas": 5, "max_replicas": 5})
    message = error(response.content, "min_replicas")
    assert message.startswith("Only ") and "of qwen fit" in message
    assert "5 always-running would need 5 more." in message
    model.refresh_from_db()
    assert (model.min_replicas, model.max_replicas) == (0, 1)
    assert not AuditEvent.objects.exists()


def test_an_htmx_change_answers_with_the_card(client: Client, alice, placement) -> None:
    make_model("qwen", **QWEN)
    response = signed_in(client, alice).post(
        "/models/qwen/class", {"capacity_class": "critical"}, headers={"HX-Request": "true"}
    )
    assert response.status_code == 200
    body = response.content.decode().strip()
    assert body.startswith('<div id="model-card"')
    assert "<html" not in body and "data-notice" in body and "critical" in body
    assert Model.objects.get().capacity_class == "critical"


def test_an_htmx_refusal_answers_with_the_card_and_its_error(client: Client, alice, placement) -> None:
    make_model("qwen", **QWEN)
    response = signed_in(client, alice).post(
        "/models/qwen/resources", {"profile": "cpu", "memory": "lots", "cpu_cores": "4"}, headers={"HX-Request": "true"}
    )
    body = response.content.decode().strip()
    assert response.status_code == 200 and body.startswith('<div id="model-card"')
    assert "“lots”" in error(response.content, "memory")


# Why it runs where it does ---------------------------------------------------------------------------


def test_explain_shows_every_node_with_its_reasons_and_what_replicas_met(client: Client, viola, placement) -> None:
    make_node("cpu-big", memory_gb=64)
    make_node("cpu-small", memory_gb=4)
    model = make_model("qwen", max_replicas=2, profile="cpu", memory_gb=8, cores=1)
    replica = make_replica(
        model,
        state=ReplicaState.PENDING,
        rejections=[
            {
                "profile": "cpu",
                "node": "cpu-small",
                "message": "cpu-small: 4 GB memory, 8 GB needed",
                "template": "%(node)s: %(free)s GB memory, %(need)s GB needed",
                "params": {"node": "cpu-small", "free": 4, "need": 8},
            },
        ],
    )
    response = signed_in(client, viola).get("/models/qwen/explain")
    assert response.status_code == 200
    content = response.content
    small = row(content, "data-node", "cpu-small")
    assert "refused" in small and "<li>" in small
    assert 'data-node="cpu-big"' in content.decode()
    assert "cpu-small: 4 GB memory, 8 GB needed" in text(row(content, "data-replica", replica.pk))


def test_explain_of_a_running_model_says_where_it_runs_and_why_then_what_one_more_replica_would_find(
    client: Client, viola, placement
) -> None:
    """The page no longer says "fits nowhere, 0 of 2 CPU cores free" of the very replica it says
    runs: that replica is judged on its node with its own claim released; one more replica, with
    it counted once, is what fits nowhere."""
    from apps.cluster.reconciler import reconcile

    make_node("vm", cpus=2, memory_gb=8)
    make_model("tiny", profile="cpu", memory_gb=1, cores=2)
    reconcile()
    (replica,) = Replica.objects.filter(model__name="tiny")
    page = signed_in(client, viola).get("/models/tiny/explain").content.decode()
    assert "Why tiny runs where it does" in page
    placed = re.search(rf'<tr data-placed="{replica.pk}" data-placed-node="vm">(.*?)</tr>', page, re.S)
    assert placed is not None
    assert "fits" in text(placed.group(1)) and "score" in text(placed.group(1)) and "refused" not in placed.group(1)
    assert page.index('data-section="placed"') < page.index('data-section="next"') < page.index('data-profile="cpu"')
    assert "node vm has 0 of 2 CPU cores free, needs 2" in text(row(page, "data-node", "vm"))


def test_explain_on_a_large_fleet_shows_the_first_nodes_and_counts_the_rest(
    client: Client, viola, placement, monkeypatch
) -> None:
    from apps.cluster import model_api as api
    from apps.cluster.models import Node

    monkeypatch.setattr(api, "EXPLAIN_NODES", 1)
    for name in ("cpu-a", "cpu-b", "cpu-c"):
        make_node(name, memory_gb=64)
    Node.objects.filter(name="cpu-c").update(cordoned=True, cordon_reason="fan")
    make_model("qwen", max_replicas=2, profile="cpu", memory_gb=8, cores=1)
    page = signed_in(client, viola).get("/models/qwen/explain").content.decode()
    assert page.count('<tr data-node="') == 1
    found = re.search(r"<div [^>]*data-more>(.*?)</div>", page, re.S)
    assert found is not None
    more = text(found.group(1))
    assert "1 node shown." in more and "1 more fits." in more
    assert "1 more refused, such as: node cpu-c is cordoned: fan" in more
    assert 'href="?nodes=all"' in page
    every = signed_in(client, viola).get("/models/qwen/explain?nodes=all").content.decode()
    assert every.count('<tr data-node="') == 3 and "data-more" not in every


@pytest.mark.django_db
def test_an_operator_declares_models_in_the_console_and_a_bad_field_changes_nothing(client, alice, viola) -> None:
    from apps.catalog.models import Model as CatalogModel

    client.force_login(viola)
    assert client.get("/models/apply").status_code == 403
    client.force_login(alice)
    page = client.get("/models/")
    assert b"/models/apply" in page.content
    spec = (
        "models:\n  - name: console-made\n    replicas: 0\n    source: /models/x.gguf\n"
        "    profiles:\n      - {name: cpu, accelerator: cpu, memory: 2GB, cpu_cores: 1}\n"
    )
    response = client.post("/models/apply", {"spec": spec})
    assert response.status_code == 200 and b"console-made" in response.content
    assert CatalogModel.objects.get(name="console-made").profiles.get().memory_bytes == 2 * 1024**3
    bad = spec.replace("memory: 2GB", "memory: lots").replace("console-made", "other")
    response = client.post("/models/apply", {"spec": bad})
    assert b"models[0].profiles[0].memory" in response.content
    assert not CatalogModel.objects.filter(name="other").exists()
    assert b"valid YAML" in client.post("/models/apply", {"spec": "models: [unclosed"}).content
