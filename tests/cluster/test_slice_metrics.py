"""MIG slices and AMD cards in /metrics, from nodes registered with the devices their agents make of
real captures (tests.cluster.test_slices): every card's series names its vendor; an AMD card's edge
and junction temperatures and corrected ECC count are exported where it reads them and absent where
it does not; a slice is exported in the llmgw_gpu_slice_* families, labelled with its card, never as
one more card; a capacity quota's GPUs held count a slice by its share of its card."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from agent.devices import amd_devices
from agent.probes import amd
from apps.accounts.models import Organization
from apps.cluster.reconciler import reconcile
from apps.quotas.models import CapacityQuota
from tests.agent.fixturefiles import fixture_text
from tests.builders import make_model
from tests.cluster.test_slices import UUID_2, mi300x_devices, mig_devices, register
from tests.fleet import mi300x_static

pytestmark = pytest.mark.django_db

Series = list[tuple[dict[str, str], float]]


def scrape(client: Client) -> dict[str, Series]:
    response = client.get("/metrics")
    assert response.status_code == 200
    found: dict[str, Series] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def on(series: Series, **labels: str) -> Series:
    return [(found, value) for found, value in series if all(found.get(k) == v for k, v in labels.items())]


def devices_of(report: amd.AmdReport) -> list[dict[str, Any]]:
    devices, _ = amd_devices(amd.merge_reports(report))
    return devices


def test_slices_are_exported_as_slices_of_their_card_and_cards_name_their_vendor(client: Client) -> None:
    register("h100-mig", mig_devices())
    metrics = scrape(client)
    # One card, in the cards' families, with its vendor; its four MIG devices are not four more.
    cards = on(metrics["llmgw_gpu_memory_total_bytes"], node="h100-mig")
    assert [(labels["gpu"], labels["vendor"], labels["class"]) for labels, _ in cards] == [("0", "nvidia", "H100-80GB")]
    assert not on(metrics["llmgw_gpu_memory_used_bytes"], node="h100-mig", gpu="1002")
    info = on(metrics["llmgw_gpu_slice_info"], node="h100-mig")
    assert sorted((labels["slice"], labels["card"], labels["kind"], labels["profile"]) for labels, _ in info) == [
        ("1000", "0", "mig", "3g.40gb"),
        ("1001", "0", "mig", "2g.20gb"),
        ("1002", "0", "mig", "1g.10gb"),
        ("1003", "0", "mig", "1g.10gb"),
    ]
    ((labels, share),) = on(metrics["llmgw_gpu_slice_share"], node="h100-mig", slice="1002")
    assert share == pytest.approx(1 / 7)
    assert (labels["uuid"], labels["vendor"], labels["class"]) == (UUID_2, "nvidia", "H100-80GB-1g.10gb")
    ((_, total),) = on(metrics["llmgw_gpu_slice_memory_total_bytes"], node="h100-mig", slice="1000")
    assert total == 40448 * 1024 * 1024


def test_amd_temperatures_and_corrected_ecc_where_read_and_absent_where_not(client: Client) -> None:
    register("mi300x", mi300x_devices())  # amd-smi monitor: junction and memory, no edge, no ECC
    register(
        "mi100",
        devices_of(amd.parse_rocm_smi_json(fixture_text("rocm-smi", "json-mi100-x4-rocm6.0.2-device-id-key.json.txt"))),
    )
    data = json.loads(fixture_text("amd-smi-json", "static-mi210-gpu_data-wrapper-author-trimmed.json.txt"))
    data["gpu_data"][0]["ecc"] = {"total_correctable_count": 3, "total_uncorrectable_count": 0}
    register("mi210", devices_of(amd.parse_amd_smi_json(json.dumps(data))))
    metrics = scrape(client)
    junction = on(metrics["llmgw_gpu_junction_temperature_celsius"], node="mi300x")
    assert len(junction) == 8 and {labels["vendor"] for labels, _ in junction} == {"amd"}
    assert on(metrics["llmgw_gpu_junction_temperature_celsius"], node="mi300x", gpu="0")[0][1] == 32.0
    assert not on(metrics["llmgw_gpu_edge_temperature_celsius"], node="mi300x")  # not read: absent, not 0
    assert on(metrics["llmgw_gpu_edge_temperature_celsius"], node="mi100", gpu="0")[0][1] == 53.0
    assert on(metrics["llmgw_gpu_junction_temperature_celsius"], node="mi100", gpu="0")[0][1] == 55.0
    assert on(metrics["llmgw_gpu_ecc_corrected_errors"], node="mi210", gpu="0")[0][1] == 3.0
    assert on(metrics["llmgw_gpu_ecc_uncorrected_errors"], node="mi210", gpu="0")[0][1] == 0.0
    assert not on(metrics["llmgw_gpu_ecc_corrected_errors"], node="mi300x")
    assert not on(metrics["llmgw_gpu_ecc_corrected_errors"], node="mi100")


def test_a_partitioned_amd_card_is_one_card_and_its_partitions_slices(client: Client) -> None:
    register("mi300x-cpx", devices_of(amd.parse_amd_smi_text(mi300x_static(2, "CPX", "NPS4", parts=8, split={0}))))
    metrics = scrape(client)
    cards = on(metrics["llmgw_gpu_memory_total_bytes"], node="mi300x-cpx")
    assert sorted(labels["gpu"] for labels, _ in cards) == ["0", "1"]
    parts = on(metrics["llmgw_gpu_slice_share"], node="mi300x-cpx")
    assert len(parts) == 8 and {(labels["card"], labels["vendor"], value) for labels, value in parts} == {
        ("0", "amd", 0.125)
    }
    info = on(metrics["llmgw_gpu_slice_info"], node="mi300x-cpx")
    assert {(labels["kind"], labels["profile"]) for labels, _ in info} == {("partition", "cpx.nps4")}


def test_a_quota_s_gpus_held_and_the_assigned_series_count_a_slice_by_its_share(client: Client) -> None:
    org = Organization.objects.create(name="Acme", slug="acme")
    CapacityQuota.objects.create(organization=org, gpus=2)
    register("h100-mig", mig_devices())
    make_model("small", accelerators=("H100-80GB-1g.10gb",), organization=org)
    make_model("mid", accelerators=("H100-80GB-3g.40gb",), organization=org)
    reconcile()
    metrics = scrape(client)
    ((_, used),) = on(metrics["llmgw_capacity_quota_used"], owner="acme", resource="gpus")
    assert used == pytest.approx(4 / 7)
    assigned = on(metrics["llmgw_gpu_assigned"], node="h100-mig")
    assert sorted((labels["gpu"], labels["slice"], labels["model"], value) for labels, value in assigned) == [
        ("0", "1000", "mid", pytest.approx(3 / 7)),
        ("0", "1002", "small", pytest.approx(1 / 7)),
    ]
