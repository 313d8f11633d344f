from __future__ import annotations

from datetime import timedelta

import pytest
import time_machine
from django.utils import timezone

from apps.cluster import actions, enrolment, history, reports
from apps.cluster.choices import NodeStatus
from apps.cluster.models import EnrollmentToken, Gpu, Node

pytestmark = pytest.mark.django_db


def enrolled(name: str = "gpu1") -> tuple[Node, str]:
    token = enrolment.create_enrollment(name, actor=None)
    return enrolment.enroll_node(token.secret)


def register(node: Node, gpus: int = 2, **sample: object) -> Node:
    hardware = {
        "cpus": 8,
        "gpus": [{"index": i, "gpu_class": "H100-80GB", "memory_total_mib": 81559} for i in range(gpus)],
    }
    return enrolment.register_node(
        node.pk,
        {
            "agent_version": "0.1.0",
            "hardware": hardware,
            "sample": {"gpus": [{"index": i} for i in range(gpus)], **sample},
        },
    )


def test_an_enrollment_token_is_stored_hashed_and_works_once(alice) -> None:
    new = enrolment.create_enrollment("gpu1", labels={"rack": "r1"}, actor=alice)
    token = EnrollmentToken.objects.get()
    assert new.secret not in token.token_hash and len(token.token_hash) == 64
    node, credential = enrolment.enroll_node(new.secret)
    assert node.labels == {"rack": "r1"}
    assert enrolment.authenticate_node(credential) == node
    assert node.credential_hash != credential
    with pytest.raises(enrolment.EnrollmentRefused, match="already used"):
        enrolment.enroll_node(new.secret)


def test_an_expired_token_is_refused_with_when_it_expired(alice) -> None:
    new = enrolment.create_enrollment("gpu1", expires_in=timedelta(minutes=10), actor=alice)
    with (
        time_machine.travel(timezone.now() + timedelta(minutes=25)),
        pytest.raises(enrolment.EnrollmentRefused, match=r"expired at .* \(15 minutes ago\)"),
    ):
        enrolment.enroll_node(new.secret)


def test_an_unknown_token_is_refused() -> None:
    with pytest.raises(enrolment.EnrollmentRefused, match="Unknown enrollment token"):
        enrolment.enroll_node("llmgwe_nothing")


@pytest.mark.parametrize("name", ["", "GPU 1", "-gpu", "a" * 64, "gpu_1"])
def test_a_bad_node_name_is_refused_naming_it(name: str) -> None:
    with pytest.raises(ValueError, match="node name"):
        enrolment.create_enrollment(name, actor=None)


def heartbeat(node: Node, sample: dict) -> None:
    """A heartbeat as the agent connection's writer stores it."""
    reports.record_heartbeats({node.pk: (sample, timezone.now())})


def test_gpu_health_rows_are_written_only_when_a_cards_health_changed(django_assert_num_queries) -> None:
    node, _ = enrolled()
    register(node)
    health = reports.sample_health({"gpus": [{"index": 0}, {"index": 1}]})
    with django_assert_num_queries(0):
        reports.write_gpu_health(
            node.pk, reports.sample_health({"cpus": 8, "gpus": [{"index": 0}, {"index": 1}]}), health
        )


def test_a_gpu_with_ecc_errors_or_a_foreign_process_is_not_healthy() -> None:
    node, _ = enrolled()
    register(node)
    health = reports.sample_health({"gpus": [{"index": 0}, {"index": 1}]})
    sick = {"gpus": [{"index": 0, "ecc_uncorrected_volatile": 2}, {"index": 1, "foreign_processes": 1}]}
    reports.write_gpu_health(node.pk, reports.sample_health(sick), health)
    assert [g.healthy for g in Gpu.objects.filter(node=node).order_by("index")] == [False, False]


def test_silent_nodes_become_unreachable_after_the_grace_and_ready_when_they_return() -> None:
    node, _ = enrolled()
    register(node)
    with time_machine.travel(timezone.now() + timedelta(seconds=31)):
        assert reports.mark_unreachable_nodes(timedelta(seconds=30)) == 1
    node.refresh_from_db()
    assert node.status == NodeStatus.UNREACHABLE
    heartbeat(node, {})
    node.refresh_from_db()
    assert node.status == NodeStatus.READY


def test_a_revoked_node_stays_revoked_whatever_its_agent_sends() -> None:
    node, credential = enrolled()
    actions.revoke_node(node, actor=None)
    heartbeat(node, {})
    node.refresh_from_db()
    assert node.status == NodeStatus.REVOKED
    assert enrolment.authenticate_node(credential) is None


def test_the_history_keeps_the_last_hour_only() -> None:
    node, _ = enrolled()
    now = timezone.now().timestamp()
    heartbeat(node, {"taken_at": now - 4000, "cpu_utilization_pct": 5})
    heartbeat(node, {"taken_at": now, "cpu_utilization_pct": 7, "memory_total_bytes": 100, "memory_used_bytes": 25})
    points = history.sample_history(node.pk)
    assert [p["cpu"] for p in points] == [7]
    assert points[0]["mem"] == 25.0


def test_register_replaces_gpus_that_went_away() -> None:
    node, _ = enrolled()
    register(node, gpus=4)
    register(node, gpus=2)
    assert list(Gpu.objects.filter(node=node).values_list("index", flat=True)) == [0, 1]


def test_heartbeats_of_many_nodes_are_written_in_one_statement(django_assert_num_queries) -> None:
    nodes = [enrolled(f"n{i}")[0] for i in range(20)]
    actions.revoke_node(nodes[0], actor=None)
    now = timezone.now()
    from django.db import connection

    # PostgreSQL: savepoint, one statement (rows locked in id order, updated, versions returned),
    # release. Elsewhere: savepoint, the lock, the bulk update, the revoked check, the versions, release.
    with django_assert_num_queries(3 if connection.vendor == "postgresql" else 6):
        versions = reports.write_heartbeats({n.pk: ({"cpus": 8}, now) for n in nodes})
    assert versions == {n.pk: n.desired_version for n in Node.objects.filter(pk__in=[n.pk for n in nodes])}
    assert Node.objects.get(pk=nodes[1].pk).sample == {"cpus": 8}
    assert Node.objects.get(pk=nodes[1].pk).status == NodeStatus.READY
    assert Node.objects.get(pk=nodes[0].pk).status == NodeStatus.REVOKED
