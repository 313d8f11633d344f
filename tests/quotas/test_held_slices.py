"""Held GPU time and energy of MIG slices and AMD devices: a slice (a MIG device, an AMD compute
partition) holds its share of a GPU-second each second and draws its share of what its card reads
(it reads no power of its own); an AMD card counts by its own reading. The nodes are registered with
the devices their agents make of real captures (tests.cluster.test_slices)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import time_machine

from agent.devices import amd_devices
from agent.probes import amd
from apps.accounts.choices import StaffRole
from apps.cluster.held import accrue_held_time
from apps.cluster.models import Gpu
from apps.quotas.models import HeldTime
from apps.quotas.selectors import usage_summary
from apps.quotas.usage import write_records_sync
from tests.builders import make_model, make_replica
from tests.cluster.test_slices import mi300x_devices, mig_devices, register
from tests.conftest import make_user
from tests.fleet import mi300x_static
from tests.quotas.conftest import make_key, record

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 11, 2, 10, 30, tzinfo=UTC)


def _held() -> dict[str, tuple[str, float, float, float]]:
    return {h.model: (h.gpu_class, h.gpu_seconds, h.energy_joules, h.measured_seconds) for h in HeldTime.objects.all()}


def test_a_mig_slice_holds_and_draws_its_share_of_its_card() -> None:
    devices = mig_devices()
    devices[0]["power_draw_w"] = 350.0
    with time_machine.travel(T0, tick=False):
        node = register("h100-mig", devices)
        small = make_replica(make_model("small", accelerators=("H100-80GB-1g.10gb",)), node, gpu_indices=(1002,))
        make_replica(make_model("mid", accelerators=("H100-80GB-3g.40gb",)), node, gpu_indices=(1000,), port=9100)
    accrue_held_time(T0 + timedelta(seconds=56))
    held = _held()
    assert held["small"] == ("H100-80GB-1g.10gb", pytest.approx(8), pytest.approx(50 * 56), pytest.approx(8))
    assert held["mid"] == ("H100-80GB-3g.40gb", pytest.approx(24), pytest.approx(150 * 56), pytest.approx(24))
    # Tokens per GPU-hour and per watt-hour by the slice's share, not a whole card's.
    key = make_key(make_user("alice@example.com"))
    write_records_sync([record(key, model="small", prompt_tokens=700, completion_tokens=300, created_at=T0)])
    staff = make_user("vic@example.com", role=StaffRole.VIEWER)
    rows = {r.group: r for r in usage_summary(staff, group_by="model", since=T0, until=T0 + timedelta(minutes=2))}
    assert rows["small"].tokens_per_gpu_hour == pytest.approx(1000 / (8 / 3600))
    assert rows["small"].watt_hours == pytest.approx(50 * 56 / 3600)
    assert rows["small"].tokens_per_watt_hour == pytest.approx(1000 / (50 * 56 / 3600))
    assert small.pk


def test_a_slice_whose_card_reads_no_power_has_time_and_no_energy() -> None:
    devices = mig_devices()
    devices[0].pop("power_draw_w")
    with time_machine.travel(T0, tick=False):
        node = register("h100-mig", devices)
        Gpu.objects.filter(node=node, index=1003).update(share=None)  # not said: the share its class names
        make_replica(make_model("small", accelerators=("H100-80GB-1g.10gb",)), node, gpu_indices=(1003,))
    accrue_held_time(T0 + timedelta(seconds=56))
    assert _held()["small"] == ("H100-80GB-1g.10gb", pytest.approx(8), 0, 0)  # unknown energy, not zero draw


def test_amd_cards_count_by_their_own_readings_and_a_partition_by_its_share() -> None:
    board = mi300x_devices()
    report = amd.parse_amd_smi_text(mi300x_static(2, "CPX", "NPS4", parts=8, split={0}))
    split, _ = amd_devices(amd.merge_reports(report))
    split[0]["power_draw_w"] = 400.0  # the socket's reading, on the card
    with time_machine.travel(T0, tick=False):
        whole = register("mi300x", board, engine_builds={"vllm": "rocm700"})
        parted = register("mi300x-cpx", split, engine_builds={"vllm": "rocm700"})
        make_replica(make_model("pair", accelerators=("MI300X-192GB",), gpus=2), whole, gpu_indices=(0, 1))
        make_replica(make_model("part", accelerators=("MI300X-192GB-cpx.nps4",)), parted, gpu_indices=(1003,))
    accrue_held_time(T0 + timedelta(seconds=60))
    held = _held()
    drawn = (board[0]["power_draw_w"] + board[1]["power_draw_w"]) * 60
    assert held["pair"] == ("MI300X-192GB", 120, pytest.approx(drawn), 120)
    assert held["part"] == ("MI300X-192GB-cpx.nps4", pytest.approx(60 / 8), pytest.approx(400 / 8 * 60), 7.5)
