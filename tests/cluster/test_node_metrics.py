"""/metrics for what runs on the nodes: each shard's claimed and used cores and memory, the GPUs each
replica holds and for whom, and each model's replicas by state. Only current rows are exported."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from apps.accounts.models import Organization, Project, Team
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Node
from tests.builders import GB, make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


def metrics(client: Client) -> list[str]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return response.content.decode().splitlines()


def series(lines: list[str], name: str) -> list[str]:
    return [line for line in lines if line.startswith(name + "{")]


def values(lines: list[str], name: str) -> dict[frozenset[tuple[str, str]], float]:
    """Each series of the metric by its labels, with its value."""
    found = {}
    for family in text_string_to_metric_families("\n".join(lines) + "\n"):
        for sample in family.samples:
            if sample.name == name:
                found[frozenset(sample.labels.items())] = sample.value
    return found


def labels(**pairs: object) -> frozenset[tuple[str, str]]:
    return frozenset((key, str(value)) for key, value in pairs.items())


def test_each_shard_exports_what_it_claims_and_what_its_engine_uses(client: Client) -> None:
    node = make_node("cpu1")
    replica = make_replica(make_model("small", memory_gb=4, cores=2), node)
    Node.objects.filter(pk=node.pk).update(
        sampled_at=timezone.now(),
        sample={**node.sample, "shards": [{"shard": f"r{replica.pk}s0", "cpu_cores": 1.25, "memory_bytes": 3 * GB}]},
    )
    lines = metrics(client)
    shard = labels(model="small", node="cpu1", replica=replica.pk)
    assert values(lines, "llmgw_shard_cpu_cores") == {shard: 2.0}
    assert values(lines, "llmgw_shard_memory_bytes") == {shard: 4 * GB}
    assert values(lines, "llmgw_shard_cpu_cores_used") == {shard: 1.25}
    assert values(lines, "llmgw_shard_memory_used_bytes") == {shard: 3 * GB}


def test_what_an_engine_uses_is_absent_when_unmeasured_or_stale(client: Client) -> None:
    fresh = make_node("fresh")
    stale = make_node("stale")
    model = make_model("small", memory_gb=4, cores=2)
    first, second = make_replica(model, fresh), make_replica(model, stale)
    # First figures of a new engine: its memory is read, its cores not yet (they need two readings).
    Node.objects.filter(pk=fresh.pk).update(
        sampled_at=timezone.now(), sample={**fresh.sample, "shards": [{"shard": f"r{first.pk}s0", "memory_bytes": GB}]}
    )
    Node.objects.filter(pk=stale.pk).update(
        sampled_at=timezone.now() - timedelta(minutes=5),
        sample={**stale.sample, "shards": [{"shard": f"r{second.pk}s0", "cpu_cores": 1.0, "memory_bytes": GB}]},
    )
    lines = metrics(client)
    assert len(series(lines, "llmgw_shard_cpu_cores")) == 2  # the claims stand whatever was measured
    assert series(lines, "llmgw_shard_cpu_cores_used") == []
    assert values(lines, "llmgw_shard_memory_used_bytes") == {labels(model="small", node="fresh", replica=first.pk): GB}


def test_each_gpu_a_replica_holds_is_assigned_to_its_model_and_owner(client: Client) -> None:
    acme = Organization.objects.create(name="Acme", slug="acme")
    search = Team.objects.create(organization=acme, name="Search", slug="search")
    ranking = Project.objects.create(team=search, name="Ranking", slug="ranking")
    node = make_node("gpu1", gpus=4)
    teams = make_replica(make_model("qwen", gpus=2, team=search), node, gpu_indices=(0, 1))
    orgs = make_replica(make_model("llama", gpus=1, organization=acme), node, gpu_indices=(2,))
    projects = make_replica(make_model("phi", gpus=1, project=ranking), node, gpu_indices=(3,))
    nobodys = make_replica(make_model("tiny", cores=1), node)
    lines = series(metrics(client), "llmgw_gpu_assigned")
    assert sorted(lines) == sorted(
        [
            f'llmgw_gpu_assigned{{gpu="0",model="qwen",node="gpu1",owner="acme/search",replica="{teams.pk}"}} 1.0',
            f'llmgw_gpu_assigned{{gpu="1",model="qwen",node="gpu1",owner="acme/search",replica="{teams.pk}"}} 1.0',
            f'llmgw_gpu_assigned{{gpu="2",model="llama",node="gpu1",owner="acme",replica="{orgs.pk}"}} 1.0',
            f'llmgw_gpu_assigned{{gpu="3",model="phi",node="gpu1",owner="acme/search",replica="{projects.pk}"}} 1.0',
        ]
    )
    assert not any(f'replica="{nobodys.pk}"' in line for line in lines)  # a CPU replica holds no GPU


def test_an_unowned_models_gpus_are_owned_by_a_dash(client: Client) -> None:
    node = make_node("gpu1", gpus=1)
    replica = make_replica(make_model("qwen", gpus=1), node, gpu_indices=(0,))
    assert series(metrics(client), "llmgw_gpu_assigned") == [
        f'llmgw_gpu_assigned{{gpu="0",model="qwen",node="gpu1",owner="-",replica="{replica.pk}"}} 1.0'
    ]


def test_replicas_are_counted_per_model_and_state_with_zeros_for_the_states_it_has_none_in(client: Client) -> None:
    node = make_node("cpu1")
    model = make_model("small", replicas=3, cores=1)
    make_replica(model, node)
    make_replica(model, node, state=ReplicaState.STARTING)
    make_replica(model, state=ReplicaState.PENDING)  # not placed
    make_model("idle", replicas=0, cores=1)
    make_model("remote", external_url="https://api.example.com/v1")
    lines = series(metrics(client), "llmgw_replicas")
    assert 'llmgw_replicas{model="small",state="ready"} 1.0' in lines
    assert 'llmgw_replicas{model="small",state="starting"} 1.0' in lines
    assert 'llmgw_replicas{model="small",state="pending"} 1.0' in lines
    assert 'llmgw_replicas{model="small",state="failed"} 0.0' in lines
    assert 'llmgw_replicas{model="idle",state="ready"} 0.0' in lines
    assert not any('model="remote"' in line for line in lines)  # served elsewhere: no replicas of its own


def test_a_deleted_models_series_go_with_it(client: Client) -> None:
    node = make_node("gpu1", gpus=1)
    model = make_model("qwen", gpus=1, memory_gb=8)
    make_replica(model, node, gpu_indices=(0,))
    make_replica(make_model("kept", cores=1), node)
    before = metrics(client)
    assert any('model="qwen"' in line for line in before if line.startswith("llmgw_shard_memory_bytes{"))
    model.deleted_at = timezone.now()  # its replica is stopping, its row stays until it stopped
    model.save(update_fields=["deleted_at"])
    after = metrics(client)
    assert not any('model="qwen"' in line for line in after)
    assert any('model="kept"' in line for line in series(after, "llmgw_shard_cpu_cores"))
    assert any('model="kept"' in line for line in series(after, "llmgw_replicas"))


def test_a_released_replicas_series_go_at_the_next_scrape(client: Client) -> None:
    node = make_node("gpu1", gpus=1)
    replica = make_replica(make_model("qwen", gpus=1), node, gpu_indices=(0,))
    assert series(metrics(client), "llmgw_gpu_assigned")
    replica.delete()
    lines = metrics(client)
    assert series(lines, "llmgw_gpu_assigned") == []
    assert series(lines, "llmgw_shard_memory_bytes") == []
    assert 'llmgw_replicas{model="qwen",state="ready"} 0.0' in lines
