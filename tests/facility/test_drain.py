"""A rack held with drain: its replicas move out as from a drained node, each replaced elsewhere
first; a release ends the drain; the reconciler does the moving, pass by pass."""

from __future__ import annotations

import pytest

from apps.cluster import reports
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node, Replica, Shard
from apps.cluster.reconciler import reconcile
from apps.facility import services as facility
from tests.builders import make_model, make_node

RACK = "llmgw.io/rack"


def all_ready() -> None:
    for node in Node.objects.all():
        shards = Shard.objects.filter(node=node, replica__state__in=(ReplicaState.STARTING, ReplicaState.READY))
        reports.record_report(node.pk, [{"shard": s.shard_id, "state": "ready"} for s in shards])


@pytest.mark.django_db
def test_a_draining_hold_moves_the_racks_replicas_out_replacement_first() -> None:
    a = make_node("a", gpus=2, labels={RACK: "r1"})
    b = make_node("b", gpus=2, labels={RACK: "r2"})
    model = make_model("m", replicas=1, gpus=1)
    reconcile()
    first = Replica.objects.get(model=model)
    held, other = (a, b) if first.shards.get().node_id == a.pk else (b, a)
    rack = held.labels[RACK]
    all_ready()
    facility.hold("rack", rack, reason="PDU swap", drain=True, actor=None)
    reconcile()
    replacement = Replica.objects.get(model=model, replaces=first)
    assert replacement.shards.get().node_id == other.pk
    assert Replica.objects.get(pk=first.pk).state == ReplicaState.READY  # serving until the new one is
    all_ready()
    reconcile()
    assert Replica.objects.get(pk=first.pk).state == ReplicaState.STOPPING
    assert not Node.objects.get(pk=held.pk).cordoned  # a hold, not a cordon: release lets work back


@pytest.mark.django_db
def test_a_hold_without_drain_leaves_what_runs_and_a_release_ends_a_drain_that_has_nowhere_to_go() -> None:
    only = make_node("only", gpus=1, labels={RACK: "r1"})
    model = make_model("m", replicas=1, gpus=1)
    reconcile()
    replica = Replica.objects.get(model=model)
    all_ready()
    facility.hold("rack", "r1", reason="survey", actor=None)
    reconcile()
    assert Replica.objects.filter(model=model).count() == 1  # nothing moves without drain
    facility.release("rack", "r1", actor=None)
    facility.hold("rack", "r1", reason="swap", drain=True, actor=None)
    reconcile()
    reconcile()
    assert Replica.objects.get(pk=replica.pk).state == ReplicaState.READY  # nowhere else: it waits
    waiting = Replica.objects.get(model=model, replaces=replica)
    assert waiting.state == ReplicaState.PENDING
    assert any("rack=r1, which is held: swap" in str(r.get("message")) for r in waiting.rejections)
    facility.release("rack", "r1", actor=None)
    reconcile()
    reconcile()
    running = Replica.objects.filter(model=model).exclude(state__in=(ReplicaState.STOPPING, ReplicaState.PENDING))
    assert list(running) == [Replica.objects.get(pk=replica.pk)]
    assert only.pk
