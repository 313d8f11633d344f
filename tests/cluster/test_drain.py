"""A replica that stops drains: it leaves every gateway's routes at once, its node's agent is told
how long its engine may run on for the requests in flight and why it stops, and the reconciler
holds its claims for that long when its node is out of touch."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from agent.protocol import DesiredShard, parse_draining
from apps.catalog import services as catalog
from apps.catalog.models import Model, Profile
from apps.cluster import actions, reports
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState, StopReason
from apps.cluster.models import Node, Replica, Shard
from apps.cluster.reconciler import ROUTES_SETTLE_S, desired_message, desired_shards, reconcile
from apps.gateway.models import TableVersion
from apps.gateway.tables import load_tables
from tests.builders import make_model, make_node


def _ready(node: Node) -> None:
    """The agent says every shard the node should run answers."""
    reports.record_report(node.pk, [{"shard": s["shard"], "state": "ready"} for s in desired_shards(node)])


def _version() -> int:
    return TableVersion.objects.filter(pk=1).values_list("version", flat=True).first() or 0


def _draining(node: Node) -> dict[str, object]:
    return {d.shard: d for d in map(parse_draining, desired_message(node, 1)["draining"])}


@pytest.mark.django_db(transaction=True)
def test_a_replica_a_profile_change_replaced_leaves_the_routes_at_once_and_drains_for_the_servers_grace() -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=1, gpus=1)
    Model.objects.filter(pk=model.pk).update(max_replicas=2)
    reconcile()
    _ready(node)
    old = Replica.objects.get(model=model)
    assert [u.id for u in load_tables().models["m"].upstreams] == [str(old.pk)]
    Profile.objects.filter(model=model).update(parallel=8)
    reconcile()
    _ready(node)  # the replacement answers
    before = _version()
    reconcile()  # ... so the old one stops

    old.refresh_from_db()
    assert old.state == ReplicaState.STOPPING
    assert (old.stop_reason, old.drain_grace) == (StopReason.ROLLED, settings.DRAIN_GRACE)
    assert _version() > before  # every gateway hears of it, not only at its next full reload
    tables = load_tables()
    assert str(old.pk) not in [u.id for u in tables.models["m"].upstreams]
    assert tables.stopping[str(old.pk)].message() == (
        f"the replica r{old.pk} was stopped: its drain grace of {settings.DRAIN_GRACE} s ran out "
        "(a profile change replaced it)"
    )
    # Its engine is not desired any more, but drained: the agent keeps it for the requests in flight.
    shard = old.shards.get()
    assert shard.shard_id not in [s["shard"] for s in desired_shards(node)]
    drain = _draining(node)[shard.shard_id]
    assert drain.grace == settings.DRAIN_GRACE and 0 < drain.left <= settings.DRAIN_GRACE
    assert 0 < drain.settle <= ROUTES_SETTLE_S

    # The agent says it drains, then that it stopped: the replica is released, and the list is empty.
    reports.record_report(node.pk, [{"shard": shard.shard_id, "state": "draining", "message": "draining: 1 running"}])
    assert Shard.objects.get(pk=shard.pk).state == ShardState.DRAINING
    reconcile()
    assert Replica.objects.filter(pk=old.pk).exists()  # its claims are held while it drains
    reports.record_report(node.pk, [{"shard": shard.shard_id, "state": "stopped"}])
    reconcile()
    assert not Replica.objects.filter(pk=old.pk).exists()
    assert _draining(node) == {}


@pytest.mark.django_db
def test_a_drained_nodes_replica_drains_for_the_nodes_own_grace() -> None:
    first, second = make_node("a", gpus=2), make_node("b", gpus=2)
    model = make_model("m", replicas=1, gpus=1)
    reconcile()
    on_a = Replica.objects.get(model=model)
    if on_a.shards.get().node_id != first.pk:
        first, second = second, first
    _ready(first)
    actions.drain_node(Node.objects.get(pk=first.pk), grace=30, actor=None)
    reconcile()
    _ready(second)
    reconcile()
    on_a.refresh_from_db()
    assert (on_a.state, on_a.stop_reason, on_a.drain_grace) == (ReplicaState.STOPPING, StopReason.DRAINED, 30)
    assert _draining(Node.objects.get(pk=first.pk))[on_a.shards.get().shard_id].grace == 30
    # The engine's SIGTERM to SIGKILL stays the server's stop grace.
    assert all(s["stop_grace"] == settings.ENGINE_STOP_GRACE for s in desired_shards(Node.objects.get(pk=second.pk)))


@pytest.mark.django_db
def test_a_scaled_down_and_a_deleted_replica_say_why_they_stop() -> None:
    make_node(gpus=8)
    model = make_model("m", replicas=2, gpus=1)
    reconcile()
    Model.objects.filter(pk=model.pk).update(min_replicas=1, max_replicas=1)
    reconcile()
    scaled = Replica.objects.get(model=model, state=ReplicaState.STOPPING)
    assert (scaled.stop_reason, scaled.drain_grace) == (StopReason.SCALED_DOWN, settings.DRAIN_GRACE)
    kept = Replica.objects.get(model=model, state=ReplicaState.STARTING)
    catalog.delete_model(Model.objects.get(pk=model.pk), actor=None)
    kept.refresh_from_db()
    assert (kept.state, kept.stop_reason, kept.drain_grace) == (
        ReplicaState.STOPPING,
        StopReason.DELETED,
        settings.DRAIN_GRACE,
    )
    assert load_tables().stopping[str(kept.pk)].reason == "the model was deleted"


@pytest.mark.django_db
def test_a_stopping_replica_on_a_node_out_of_touch_keeps_its_claims_for_its_drain_grace_and_three_stop_graces() -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=2, gpus=1)
    reconcile()
    Model.objects.filter(pk=model.pk).update(min_replicas=1, max_replicas=1)
    reconcile()
    stopping = Replica.objects.get(model=model, state=ReplicaState.STOPPING)
    Node.objects.filter(pk=node.pk).update(status=NodeStatus.UNREACHABLE)
    held = timedelta(seconds=stopping.drain_grace + settings.ENGINE_STOP_GRACE * 3)
    # Its engine may still answer requests there: the room is not given to another replica.
    reconcile(now=stopping.stop_requested_at + held - timedelta(seconds=1))
    assert Replica.objects.filter(pk=stopping.pk).exists()
    reconcile(now=stopping.stop_requested_at + held + timedelta(seconds=1))
    assert not Replica.objects.filter(pk=stopping.pk).exists()


@pytest.mark.django_db
def test_the_other_ranks_of_a_multi_node_replica_run_on_while_rank_0_drains_then_are_told_to_stop() -> None:
    first, second = make_node("a", gpus=8, address="10.0.0.1"), make_node("b", gpus=8, address="10.0.0.2")
    model = make_model("big", replicas=1, gpus=8, engine="vllm")
    Profile.objects.filter(model=model).update(nodes_per_replica=2, gpus_per_shard=8)
    profile = Profile.objects.get(model=model)
    spec = {
        "source": model.source,
        "profile": profile.name,
        "engine": "vllm",
        "nodes_per_replica": 2,
        "gpus_per_shard": 8,
    }
    replica = Replica.objects.create(model=model, profile=profile, state=ReplicaState.READY, spec=spec)
    for rank, node in enumerate((first, second)):
        Shard.objects.create(
            replica=replica,
            rank=rank,
            node=node,
            gpu_indices=list(range(8)),
            port=20000 + rank,
            secret="s",
            state=ShardState.READY,
        )
    Replica.objects.filter(pk=replica.pk).update(
        state=ReplicaState.STOPPING,
        stop_requested_at=timezone.now(),
        stop_reason=StopReason.ROLLED,
        drain_grace=120,
    )
    rank0, rank1 = f"r{replica.pk}s0", f"r{replica.pk}s1"
    assert list(_draining(first)) == [rank0] and desired_shards(first) == []
    kept = [DesiredShard.parse(s) for s in desired_shards(second)]
    assert [(s.shard, s.rank) for s in kept] == [(rank1, 1)]  # rank 0's requests need it
    assert _draining(second) == {}

    version = Node.objects.get(pk=second.pk).desired_version
    reports.record_report(first.pk, [{"shard": rank0, "state": "stopped"}])
    assert Node.objects.get(pk=second.pk).desired_version > version  # its agent hears at once
    assert desired_shards(second) == []


@pytest.mark.django_db
def test_a_roll_in_place_stops_the_next_replica_only_once_the_last_replacement_is_ready() -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=2, gpus=1)  # at its maximum: each is replaced in its place
    reconcile()
    _ready(node)
    old = set(Replica.objects.values_list("pk", flat=True))
    Profile.objects.filter(model=model).update(parallel=8)
    reconcile()
    assert Replica.objects.filter(pk__in=old, state=ReplicaState.STOPPING).count() == 1
    reconcile()
    reconcile()
    # Its replacement is starting: the other old one keeps serving meanwhile.
    assert Replica.objects.filter(pk__in=old, state=ReplicaState.READY).count() == 1
    assert Replica.objects.exclude(pk__in=old).get().state == ReplicaState.STARTING
    _ready(node)  # (the first old one, stopped, is released meanwhile)
    reconcile()
    assert not Replica.objects.filter(pk__in=old).exclude(state=ReplicaState.STOPPING).exists()


@pytest.mark.django_db
def test_a_replica_that_becomes_ready_asks_for_a_pass_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # So a roll or a drain moves on as soon as its replacement answers, not at the next beat.
    from apps.cluster import reconciler

    asked: list[int] = []
    monkeypatch.setattr(reconciler, "request_reconcile", lambda: asked.append(1))
    node = make_node(gpus=8)
    make_model("m", replicas=1, gpus=1)
    reconcile()
    _ready(node)
    assert asked == [1]
    _ready(node)  # already ready: nothing new
    assert asked == [1]


@pytest.mark.django_db(transaction=True)
def test_a_report_of_a_shard_released_meanwhile_is_skipped_and_the_rest_of_the_report_recorded() -> None:
    # The race itself (the reconciler releasing the replica between the report's read and its
    # write) needs two connections at the right moment; here the row is gone before the write.
    from django.db import transaction

    node = make_node(gpus=8)
    make_model("m", replicas=2, gpus=1)
    reconcile()
    gone, kept = Shard.objects.order_by("pk")
    with transaction.atomic():
        Replica.objects.filter(pk=gone.replica_id).delete()  # released by another process
        gone.state = ShardState.STOPPED
        assert reports._save_reported(gone, ["state"]) is False
        kept.state = ShardState.READY
        assert reports._save_reported(kept, ["state"]) is True  # the transaction goes on
    assert Shard.objects.get(pk=kept.pk).state == ShardState.READY
    assert Node.objects.get(pk=node.pk)


@pytest.mark.django_db
def test_the_node_page_and_the_models_card_say_a_shard_drains_and_why(client, alice) -> None:
    node = make_node(gpus=8)
    model = make_model("m", replicas=2, gpus=1)
    reconcile()
    _ready(node)
    Model.objects.filter(pk=model.pk).update(min_replicas=1, max_replicas=1)
    reconcile()
    stopping = Replica.objects.get(state=ReplicaState.STOPPING)
    shard = stopping.shards.get()
    reports.record_report(node.pk, [{"shard": shard.shard_id, "state": "draining", "message": "draining: busy"}])
    client.force_login(alice)
    card = client.get("/models/m/").content.decode()
    row = card[card.index(f'data-replica="{stopping.pk}"') :]
    row = row[: row.index("</tr>")]
    assert ">draining</span>" in row
    assert (
        f"Draining (the model was scaled down): its engine runs on for the requests in flight, "
        f"{settings.DRAIN_GRACE} s at most, and stops once idle." in row
    )
    page = client.get(f"/nodes/{node.name}/").content.decode()
    engine = page[page.index(f'data-shard="{shard.shard_id}"') :]
    assert ">draining</span>" in engine[: engine.index("</tr>")]
    # In Turkish, as the catalogue says it.
    client.post("/i18n/setlang/", {"language": "tr"})
    card = client.get("/models/m/", HTTP_ACCEPT_LANGUAGE="tr").content.decode()
    assert "boşaltılıyor" in card
