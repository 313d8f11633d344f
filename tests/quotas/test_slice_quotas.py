"""GPU capacity quotas count a MIG slice by its share of its card: a 1g.10gb of an H100 is 1/7 of a
GPU, so seven of them fill a quota of one GPU, and a refusal says what is in use and needed in cards.
The nodes are registered with the devices their agents make of real captures (tests.cluster.test_slices)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.devices import nvidia_devices
from agent.probes import nvidia
from apps.accounts.models import Organization
from apps.cluster.models import Gpu, Node, Replica
from apps.cluster.reconciler import reconcile
from apps.quotas.models import CapacityQuota
from tests.agent.fixturefiles import fixture_text
from tests.builders import make_model
from tests.cluster.test_slices import mig_devices, register

pytestmark = pytest.mark.django_db


def whole_h100() -> list[dict[str, Any]]:
    report = nvidia.parse_nvidia_smi_text(fixture_text("nvidia-smi-q", "h100-80gb-hbm3-vm-drv590-idle-masked.txt"))
    devices, _ = nvidia_devices(report, None)
    for device in devices:
        device["foreign_processes"] = len(device.pop("process_pids", None) or [])
    return devices


@pytest.fixture
def acme(db: Any) -> Organization:
    org = Organization.objects.create(name="Acme", slug="acme")
    CapacityQuota.objects.create(organization=org, gpus=1)
    return org


@pytest.fixture
def nodes(db: Any) -> tuple[Node, Node]:
    return register("h100-mig", mig_devices()), register("h100", whole_h100())


def placed(name: str) -> list[list[int]]:
    return sorted(s.gpu_indices for r in Replica.objects.filter(model__name=name) for s in r.shards.all())


def refusals(name: str) -> list[str]:
    return [r["message"] for r in Replica.objects.get(model__name=name).rejections]


def test_slices_count_by_their_share_so_seven_sevenths_fill_a_quota_of_one_gpu(acme, nodes) -> None:
    make_model("small", accelerators=("H100-80GB-1g.10gb",), replicas=2, organization=acme)
    make_model("mid", accelerators=("H100-80GB-3g.40gb",), organization=acme)
    reconcile()
    # Three slices of one card: 5/7 of a GPU, inside a quota of one (not three GPUs over it).
    assert placed("small") == [[1002], [1003]] and placed("mid") == [[1000]]
    make_model("whole", accelerators=("H100-80GB",), organization=acme)
    reconcile()
    assert placed("whole") == []
    assert f"quota of org:{acme.pk}: 0.71 of 1 GPUs in use, needs 1 more" in refusals("whole")
    # The last 2/7 of the card fits exactly: 7/7 is one GPU, not a hair over it.
    make_model("pair", accelerators=("H100-80GB-2g.20gb",), organization=acme)
    reconcile()
    assert placed("pair") == [[1001]]


def test_a_slice_over_a_full_quota_is_refused_with_its_share_in_the_numbers(acme, nodes) -> None:
    make_model("whole", accelerators=("H100-80GB",), organization=acme)
    reconcile()
    assert placed("whole") == [[0]]
    make_model("small", accelerators=("H100-80GB-1g.10gb",), organization=acme)
    reconcile()
    assert placed("small") == []
    assert f"quota of org:{acme.pk}: 1 of 1 GPUs in use, needs 0.14 more" in refusals("small")


def test_a_slice_whose_agent_gave_no_share_counts_the_share_its_class_names(acme, nodes) -> None:
    Gpu.objects.filter(node=nodes[0], parent_index__isnull=False).update(share=None)
    make_model("small", accelerators=("H100-80GB-1g.10gb",), replicas=2, organization=acme)
    make_model("mid", accelerators=("H100-80GB-3g.40gb",), organization=acme)
    make_model("pair", accelerators=("H100-80GB-2g.20gb",), organization=acme)
    reconcile()
    assert placed("small") == [[1002], [1003]] and placed("mid") == [[1000]] and placed("pair") == [[1001]]
