"""The registry through which the catalogue hears of the cluster app above it: empty, the catalogue
runs on its own (a deleted model stops no replica, no pass is asked for, no plugin field is read);
filled by ClusterConfig.ready() (once, however often it runs), deleting a model stops its replicas
as it did. The model page's parts from the mirror come through the cluster app's registry."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.test import Client

from apps.accounts.choices import StaffRole
from apps.catalog import profile_fields, services
from apps.catalog.extensions import EXTENSIONS, Extensions
from apps.cluster import model_views
from apps.cluster.choices import ReplicaState, StopReason
from apps.cluster.extensions import Extensions as ClusterExtensions
from apps.cluster.models import Replica, Shard
from tests.builders import make_model, make_node, make_replica
from tests.conftest import make_user


def test_an_empty_registry_answers_nothing_for_every_slot() -> None:
    empty = Extensions()
    empty.changed()  # no reconciler: nothing asked, nothing raised
    assert empty.stop(None) == 0  # type: ignore[arg-type]
    assert empty.fields() == ()
    assert empty.owned == []


def test_the_cluster_app_fills_it_once_however_often_ready_runs() -> None:
    owned = list(EXTENSIONS.owned)
    apps.get_app_config("cluster").ready()
    assert EXTENSIONS.owned == owned == [Replica, Shard]
    assert EXTENSIONS.reconcile is not None and EXTENSIONS.stop_replicas is not None
    assert {"keep_within", "power_watts"} <= {f.name for f in EXTENSIONS.fields()}  # facility's, through placement
    assert {"keep_within", "power_watts"} <= set(profile_fields.field_names())


@pytest.mark.django_db
def test_without_the_cluster_app_a_deleted_model_keeps_its_replicas_to_the_reconciler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = make_model("gone", memory_gb=1, cores=1)
    replica = make_replica(model, make_node("n1", gpus=0))
    monkeypatch.setattr(services, "EXTENSIONS", Extensions())
    services.delete_model(model, actor=None)
    assert model.deleted_at is not None
    assert Replica.objects.get(pk=replica.pk).state == replica.state  # nobody stopped it


@pytest.mark.django_db
def test_with_the_cluster_app_a_deleted_model_stops_its_replicas_from_the_moment_it_went() -> None:
    model = make_model("gone", memory_gb=1, cores=1)
    replica = make_replica(model, make_node("n1", gpus=0))
    services.delete_model(model, actor=None)
    stopped = Replica.objects.get(pk=replica.pk)
    assert stopped.state == ReplicaState.STOPPING and stopped.stop_reason == StopReason.DELETED
    assert stopped.stop_requested_at == model.deleted_at


@pytest.mark.django_db
def test_the_model_page_leaves_the_mirrors_part_out_without_it(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    make_model("base", memory_gb=1, cores=1, engine="llama.cpp")
    client.force_login(make_user("ops@example.com", role=StaffRole.OPERATOR))
    calls: list[Any] = []
    registry = ClusterExtensions()
    registry.add_model_panel("adapters", lambda model, can_change: calls.append((model.name, can_change)))
    monkeypatch.setattr(model_views, "EXTENSIONS", registry)
    assert client.get("/models/base/").status_code == 200
    assert calls == [("base", True)]
    monkeypatch.setattr(model_views, "EXTENSIONS", ClusterExtensions())
    page = client.get("/models/base/")
    assert page.status_code == 200 and 'data-section="adapters"' not in page.content.decode()
