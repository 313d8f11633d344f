"""Power of MIG slices and AMD cards: a slice's derived draw is its share of its card's TDP, its
measured draw its share of what its card reads (a slice reads none of its own), a split card is
counted once in its node's draw, and AMD cards count by their own TDP and readings. The nodes are
registered with the devices their agents make of real captures (tests.cluster.test_slices)."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from apps.cluster import history
from apps.cluster.gpu_classes import class_share
from apps.cluster.models import Node, Replica
from apps.cluster.reconciler import reconcile
from apps.facility import power
from apps.facility.draw import derived_watts
from tests.builders import make_model
from tests.cluster.test_slices import mi300x_devices, mig_devices, register

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("gpu_class", "devices", "watts"),
    [
        ("MI300X-192GB", 2, 1500),  # AMD Instinct: the OAM board's power
        ("MI250X-128GB", 1, 560),
        ("H100-80GB-1g.10gb", 1, 100),  # 1 of an H100's 7 compute slices of 700 W
        ("H100-80GB-3g.40gb", 1, 300),
        ("H100-80GB-1g.10gb", 2, 200),
        ("MI300X-192GB-cpx.nps4", 1, 94),  # one of eight compute partitions of 750 W
        ("MI300X-192GB-dpx.nps1", 1, 375),
        ("MI9999-1GB", 1, None),  # unknown: not zero
        ("H100-80GB-1g.10gb", 0, None),
    ],
)
def test_a_devices_derived_draw_is_its_share_of_its_cards_tdp(gpu_class: str, devices: int, watts: int | None) -> None:
    assert derived_watts(gpu_class, devices) == watts


def test_a_slices_share_of_its_card() -> None:
    assert class_share("H100-80GB") == 1.0
    assert class_share("H100-80GB-2g.20gb") == pytest.approx(2 / 7)
    assert class_share("H100-80GB-1c.3g.40gb") == pytest.approx(1 / 7)  # one compute instance of a 3g
    assert class_share("H100-96GB-1g.12gb+me") == pytest.approx(1 / 7)
    assert class_share("A30-24GB-2g.12gb") == pytest.approx(2 / 4)  # an A30 has four
    assert class_share("MI300X-192GB-qpx.nps1") == pytest.approx(1 / 4)
    assert class_share("MI300X-192GB") == 1.0


def _node(name: str) -> Node:
    return Node.objects.get(name=name)


def _draws(*names: str) -> dict[str, float | None]:
    nodes = {n.pk: n for n in Node.objects.filter(name__in=names)}
    return {nodes[pk].name: watts for pk, watts in power.node_draws(nodes).items()}


def _mig(card_watts: float) -> list[dict[str, Any]]:
    devices = mig_devices()
    devices[0]["power_draw_w"] = card_watts
    return devices


def test_a_mig_card_is_measured_once_and_its_slices_derive_their_share() -> None:
    register("h100-mig", _mig(71.27))  # idle, as captured
    # Measured: the card once, not again for each of its slices (which read no power).
    assert _draws("h100-mig") == {"h100-mig": pytest.approx(71.27)}
    make_model("small", accelerators=("H100-80GB-1g.10gb",), gpus=1, replicas=2)
    reconcile()
    assert Replica.objects.filter(model__name="small", shards__isnull=False).count() == 2
    # Two 1g.10gb slices: 2 x 700 W / 7 derived beats the idle card's reading; not 2 x 700 W.
    assert _draws("h100-mig") == {"h100-mig": 200}
    # A busier card: each slice draws its share of it, and the node draws the card once.
    node = _node("h100-mig")
    history.append_histories({node.pk: {"gpus": _mig(560.0), "taken_at": timezone.now().timestamp() - 60}})
    assert _draws("h100-mig") == {"h100-mig": pytest.approx(560.0)}
    slices = power.slices_of({"gpus": mig_devices()})
    assert slices[1002] == (0, pytest.approx(1 / 7)) and 0 not in slices


def test_an_amd_board_counts_by_its_own_readings_and_tdp() -> None:
    devices = mi300x_devices()
    measured = sum(d["power_draw_w"] for d in devices)
    register("mi300x", devices, engine_builds={"vllm": "rocm700"})
    assert _draws("mi300x") == {"mi300x": pytest.approx(measured)}  # eight cards' readings, as captured
    make_model("on-vllm", accelerators=("MI300X-192GB",), gpus=2)
    reconcile()
    assert Replica.objects.get(model__name="on-vllm").shards.get().gpu_indices
    # Two MI300X by their TDP: 1.5 kW, more than the idle board's readings.
    assert measured < 1500
    assert _draws("mi300x") == {"mi300x": 1500}
    busy = [{**d, "power_draw_w": 700.0} for d in devices]
    node = _node("mi300x")
    history.append_histories({node.pk: {"gpus": busy, "taken_at": timezone.now().timestamp() - 30}})
    assert _draws("mi300x") == {"mi300x": pytest.approx(8 * 700.0)}


def test_a_rack_cap_counts_a_slice_by_its_share_of_its_cards_tdp() -> None:
    node = register("h100-mig", _mig(71.27))
    Node.objects.filter(pk=node.pk).update(labels={"llmgw.io/rack": "r1"})
    power.apply_budgets([{"domain": "rack=r1", "watts": 300}], source="api", replace=False)
    make_model("small", accelerators=("H100-80GB-1g.10gb",), gpus=1)  # adds 100 W: fits
    make_model("mid", accelerators=("H100-80GB-3g.40gb",), gpus=1)  # adds 300 W: over the cap
    reconcile()
    assert Replica.objects.get(model__name="small").shards.get().gpu_indices in ([1002], [1003])
    mid = Replica.objects.get(model__name="mid")
    assert mid.state == "pending"
    # The small slice's 100 W is drawn; a 3g's 3/7 of 700 W would pass the cap.
    assert "rack=r1: 0.1 kW of 0.3 kW drawn, this replica adds 0.3 kW" in [r["message"] for r in mid.rejections]
