"""A reconciler pass (apps.cluster.decisions) reads models, replicas, profiles and drains through
small Protocols, and works through a Store: on the database (DatabaseStore, the catalog's and the
cluster's rows) and in the simulator (MemoryStore, its own copies). mypy holds both to them where
they are handed to run_pass; here, a name a Protocol declares that one side lacks (a misspelt
attribute, a field renamed on one side only) fails on the rows and copies themselves."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from django.utils import timezone

from apps.cluster.choices import ReplicaState
from apps.cluster.decisions import DrainRow, ModelRow, ProfileRow, ReplicaRow, Store
from apps.cluster.models import Replica
from apps.cluster.reconciler import DatabaseStore
from apps.sim.store import MemoryStore, SimDrain, SimModel, SimProfile, SimReplica
from tests.builders import make_model, make_node


def declared(protocol: type) -> set[str]:
    """The attributes and methods a Protocol declares."""
    return {name for name in vars(protocol) if not name.startswith("_")}


def lacking(obj: Any, protocol: type) -> set[str]:
    return {name for name in declared(protocol) if not hasattr(obj, name)}


def test_the_protocols_declare_what_a_pass_reads() -> None:
    assert {"name", "min_replicas", "max_replicas", "wanted_replicas", "owner_keys"} <= declared(ModelRow)
    assert {"state", "replaces_id", "profile_id", "spec", "model_id"} <= declared(ReplicaRow)
    assert {"pk", "name"} <= declared(ProfileRow)
    assert {"drain_force"} <= declared(DrainRow)


@pytest.mark.django_db
def test_the_databases_rows_carry_every_attribute_a_pass_reads() -> None:
    model = make_model("m")
    profile = model.profiles.get()
    replica = Replica.objects.create(model=model, state=ReplicaState.PENDING, created_at=timezone.now())
    node = make_node("gpu1")
    assert lacking(model, ModelRow) == set()
    assert lacking(profile, ProfileRow) == set()
    assert lacking(replica, ReplicaRow) == set()
    assert lacking(node, DrainRow) == set()


def test_the_simulators_copies_carry_every_attribute_a_pass_reads() -> None:
    model = SimModel(pk=1, name="m", profiles=[SimProfile(pk=1, name="default")])
    replica = SimReplica(pk=1, model=model, created_at=timezone.now())
    assert lacking(model, ModelRow) == set()
    assert lacking(model.profiles[0], ProfileRow) == set()
    assert lacking(replica, ReplicaRow) == set()
    assert lacking(SimDrain(), DrainRow) == set()


@pytest.mark.parametrize("store", [DatabaseStore, MemoryStore])
def test_both_stores_answer_every_call_of_a_pass_with_the_same_parameters(store: type) -> None:
    for name in declared(Store):
        wanted = list(inspect.signature(getattr(Store, name)).parameters)
        found = getattr(store, name, None)
        assert callable(found), f"{store.__name__} has no {name}"
        assert list(inspect.signature(found).parameters) == wanted, name
