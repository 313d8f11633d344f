from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from apps.cluster.choices import NodeStatus
from apps.cluster.models import Node

pytestmark = pytest.mark.django_db


def metrics(client: Client) -> list[str]:
    return client.get("/metrics").content.decode().splitlines()


def test_fresh_samples_are_exported_with_unknown_figures_absent(client: Client) -> None:
    Node.objects.create(
        name="gpu1",
        status=NodeStatus.READY,
        sampled_at=timezone.now(),
        sample={
            "cpus": 64,
            "cpu_utilization_pct": 12.5,
            "memory_total_bytes": 1000,
            "memory_used_bytes": 400,
            "gpus": [
                {
                    "index": 0,
                    "gpu_class": "H100-80GB",
                    "temperature_gpu_c": 41,
                    "power_draw_w": 120.5,
                    "memory_total_mib": 81559,
                    "xids": {"79": 2},
                }
            ],
            "storage": [
                {"mount_point": "/models", "fstype": "nfs4", "shared": True, "free_bytes": 5, "total_bytes": 9}
            ],
        },
    )
    lines = metrics(client)
    assert 'llmgw_node_up{node="gpu1"} 1.0' in lines
    assert 'llmgw_node_cpu_utilization_percent{node="gpu1"} 12.5' in lines
    assert any(line.startswith("llmgw_gpu_temperature_celsius{") and line.endswith(" 41.0") for line in lines)
    assert any(line.startswith("llmgw_gpu_xid_errors{") and 'xid="79"' in line for line in lines)
    assert any('kind="shared"' in line and line.startswith("llmgw_node_storage_free_bytes") for line in lines)
    # Measured nowhere: no line at all rather than a 0.
    assert not any(line.startswith("llmgw_gpu_power_limit_watts{") for line in lines)
    assert not any(line.startswith("llmgw_node_memory_available_bytes{") for line in lines)
    assert not any(line.startswith("llmgw_gpu_utilization_percent{") for line in lines)


def test_a_sample_older_than_a_minute_is_left_out_not_repeated(client: Client) -> None:
    Node.objects.create(
        name="old",
        status=NodeStatus.UNREACHABLE,
        sampled_at=timezone.now() - timedelta(minutes=2),
        sample={"cpus": 8, "cpu_utilization_pct": 50},
    )
    lines = metrics(client)
    assert 'llmgw_node_up{node="old"} 0.0' in lines
    assert not any('node="old"' in line and "cpu" in line for line in lines)


def test_clock_events_replica_failures_quotas_and_the_queue_limit(client: Client) -> None:
    from apps.accounts import services as accounts
    from apps.cluster.choices import ReplicaState
    from apps.cluster.models import Replica, Shard
    from apps.quotas.models import CapacityQuota
    from tests.builders import make_model

    gpu = {"index": 0, "gpu_class": "H100-80GB", "uuid": "GPU-a"}
    node = Node.objects.create(
        name="gpu1",
        status=NodeStatus.READY,
        sampled_at=timezone.now(),
        sample={"gpus": [{**gpu, "throttle_reasons": ["sw_power_cap"]}, {**gpu, "index": 1, "uuid": "GPU-b"}]},
    )
    org = accounts.create_organization(name="Acme", actor=None)
    model = make_model("m", gpus=2)
    model.organization = org
    model.save()
    replica = Replica.objects.create(model=model, profile=model.profiles.first(), state=ReplicaState.READY)
    Shard.objects.create(replica=replica, node=node, rank=0, port=9000, secret="s", gpu_indices=[0, 1])
    Replica.objects.create(model=model, profile=model.profiles.first(), state=ReplicaState.FAILED, failures=2)
    CapacityQuota.objects.create(organization=org, gpus=8, cpu_cores=None)
    lines = metrics(client)
    clock = [line for line in lines if line.startswith("llmgw_gpu_clock_event{")]
    assert clock == [
        'llmgw_gpu_clock_event{class="H100-80GB",gpu="0",node="gpu1",reason="sw_power_cap",uuid="GPU-a",'
        'vendor="nvidia"} 1.0'
    ]  # the second card reports none: none held down, and no line
    assert f'llmgw_replica_failures{{model="m",replica="{replica.pk}"}} 0.0' in lines
    assert any(line.startswith("llmgw_replica_failures{") and line.endswith(" 2.0") for line in lines)
    assert 'llmgw_capacity_quota_limit{level="organization",owner="acme",resource="gpus"} 8.0' in lines
    assert 'llmgw_capacity_quota_used{level="organization",owner="acme",resource="gpus"} 2.0' in lines
    assert not any('resource="cpu_cores"' in line for line in lines)  # no limit set: nothing to compare with
    assert "llmgw_gateway_queue_limit 256.0" in lines


def test_labels_an_agent_sent_with_quotes_backslashes_or_newlines_are_escaped(client: Client) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    odd = 'GPU-"a"\\b\nc'
    Node.objects.create(
        name="gpu1",
        status=NodeStatus.READY,
        sampled_at=timezone.now(),
        sample={"gpus": [{"index": 0, "uuid": odd, "gpu_class": "H100\\80GB", "temperature_gpu_c": 40}]},
    )
    text = client.get("/metrics").content.decode()
    found = {
        sample.labels["uuid"]: sample
        for family in text_string_to_metric_families(text)
        if family.name == "llmgw_gpu_temperature_celsius"
        for sample in family.samples
    }
    assert found[odd].labels["class"] == "H100\\80GB" and found[odd].value == 40
