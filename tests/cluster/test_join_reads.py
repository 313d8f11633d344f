"""What an agent's join reads and writes: the credential check and the connection named in one
statement, the node's shards read once for its desired state, and the fleet-wide reads (engine
rules, releases, the mirror's fetches) shared by the registrations under way at once, never older
than the node's row they were read for."""

from __future__ import annotations

import time

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from apps.cluster import consumers, enrolment
from apps.cluster.choices import ReplicaState
from apps.cluster.engines import EngineTables
from apps.cluster.models import EngineChoice, Node
from apps.cluster.reconciler import desired_message
from tests.builders import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

HARDWARE = {"hostname": "n", "cpus": 8, "memory_total_bytes": 2**34, "gpus": []}


def enrolled(name: str) -> tuple[Node, str]:
    token = enrolment.create_enrollment(name, actor=None)
    return enrolment.enroll_node(token.secret)


def test_a_credential_is_checked_and_the_connection_named_in_one_statement() -> None:
    node, credential = enrolled("n1")
    with CaptureQueriesContext(connection) as queries:
        found = enrolment.connect_node(credential, "chan.one")
    assert found == (node.pk, "n1")
    assert len(queries.captured_queries) == 1
    node.refresh_from_db()
    assert node.connection == "chan.one"


def test_an_unknown_revoked_or_malformed_credential_names_no_connection() -> None:
    node, credential = enrolled("n1")
    assert enrolment.connect_node(credential + "x", "chan.bad") is None
    assert enrolment.connect_node("not-a-credential", "chan.bad") is None
    Node.objects.filter(pk=node.pk).update(revoked_at=node.created_at)
    assert enrolment.connect_node(credential, "chan.bad") is None
    node.refresh_from_db()
    assert node.connection != "chan.bad"


def wide_shard_reads(queries: CaptureQueriesContext) -> list[str]:
    """The reads of a node's shards with their replicas (what its desired state is made of)."""
    return [
        q["sql"]
        for q in queries.captured_queries
        if 'FROM "cluster_shard"' in q["sql"] and 'JOIN "cluster_replica"' in q["sql"]
    ]


def test_a_desired_state_reads_the_nodes_shards_and_their_replicas_once() -> None:
    node = make_node("n1", gpus=2)
    make_replica(make_model("m", gpus=1), node, gpu_indices=(0,))
    make_replica(make_model("gone", gpus=1), node, gpu_indices=(1,), state=ReplicaState.STOPPING)
    with CaptureQueriesContext(connection) as queries:
        desired = desired_message(node, node.desired_version)
    assert len(wide_shard_reads(queries)) == 1, wide_shard_reads(queries)
    assert [s["model"] for s in desired["shards"]] == ["m"]
    assert len(desired["draining"]) == 1


def test_a_node_without_shards_costs_no_wide_read() -> None:
    node = make_node("n1", gpus=2)
    with CaptureQueriesContext(connection) as queries:
        desired = desired_message(node, node.desired_version)
    assert wide_shard_reads(queries) == []
    assert desired["shards"] == [] and desired["draining"] == []


def engine_reads(queries: CaptureQueriesContext) -> int:
    return sum('FROM "cluster_enginechoice"' in q["sql"] for q in queries.captured_queries)


def test_registrations_under_way_share_the_fleet_reads_made_after_their_rows_were_read() -> None:
    consumers._FleetReads.last = None
    first = time.monotonic()  # a registration read its node's row
    second = time.monotonic()  # another did, a moment later
    with CaptureQueriesContext(connection) as queries:
        consumers._FleetReads.since(second)
        consumers._FleetReads.since(first)  # the read made after its row serves it too
        consumers._FleetReads.since(second)
    assert engine_reads(queries) == 1
    later = time.monotonic()  # a registration that read its row after that read: never the older one
    with CaptureQueriesContext(connection) as queries:
        consumers._FleetReads.since(later)
    assert engine_reads(queries) == 1


def test_a_rule_saved_before_a_registration_read_its_row_reaches_that_registration() -> None:
    consumers._FleetReads.last = None
    consumers._FleetReads.since(time.monotonic())  # read before the rule
    EngineChoice.objects.create(scope=EngineChoice.Scope.ALL, engine="llama.cpp", version="b9999")
    tables, _fetches = consumers._FleetReads.since(time.monotonic())
    assert [(r.engine, r.version) for r in tables.rules] == [("llama.cpp", "b9999")]
    assert isinstance(tables, EngineTables)


def test_a_registration_sends_the_engines_the_rules_give_and_records_the_version_sent() -> None:
    consumers._FleetReads.last = None
    node, _credential = enrolled("n1")
    consumers._FleetReads.since(time.monotonic())
    EngineChoice.objects.create(scope=EngineChoice.Scope.ALL, engine="llama.cpp", version="b9999")
    Node.objects.filter(pk=node.pk).update(desired_version=7)
    body = {"agent_version": "1", "hardware": dict(HARDWARE), "features": []}
    _name, version, desired, _requests = consumers._register(node.pk, body, "127.0.0.1")
    assert version == 7
    assert [(e["engine"], e["version"]) for e in desired["engines"]] == [("llama.cpp", "b9999")]
