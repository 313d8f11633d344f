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
