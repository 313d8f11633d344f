"""AMD GPUs: amd-smi (JSON and text), rocm-smi (JSON and text) and rocminfo on real captures, the
devices a node offers from them (agent.devices), and what cannot be trusted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text

from agent.devices import amd_devices, amd_topology, layout_changes, layout_of
from agent.probes.amd import (
    AmdGpu,
    AmdReport,
    amd_class,
    merge_reports,
    parse_amd_smi_json,
    parse_amd_smi_text,
    parse_amd_topology,
    parse_rocm_smi_json,
    parse_rocm_smi_text,
    parse_rocminfo,
)

JSON = "amd-smi-json"
TEXT = "amd-smi-text"
ROCM_SMI = "rocm-smi"
ROCMINFO = "rocminfo"
MI210 = (JSON, "static-mi210-gpu_data-wrapper-author-trimmed.json.txt")
MONITOR = (TEXT, "monitor-ptumv-8gpu-mi300x-idle-changelog.txt")
TOPOLOGY = (TEXT, "topology-8gpu-xgmi-weight15-5-tables-changelog.txt")


def _sane(report: AmdReport) -> None:
    for gpu in report.gpus:
        for value in (gpu.utilization_gpu_pct, gpu.utilization_memory_pct):
            assert value is None or 0 <= value <= 100
        for value in (gpu.temperature_edge_c, gpu.temperature_junction_c, gpu.temperature_memory_c):
            assert value is None or 0 < value < 150
        assert gpu.memory_total_mib is None or 1000 < gpu.memory_total_mib < 300_000
        assert (
            gpu.memory_used_mib is None or gpu.memory_total_mib is None or gpu.memory_used_mib <= gpu.memory_total_mib
        )
        assert gpu.power_limit_w is None or gpu.power_limit_w > 0


@pytest.mark.parametrize("path", fixture_files(JSON))
def test_every_amd_smi_json_file_parses(path: Path) -> None:
    report = parse_amd_smi_json(read_text(path))
    assert report.warnings == [] and len(report.gpus) == 1
    _sane(report)
    gpu = report.gpus[0]
    if path.name.startswith("static"):
        assert gpu.name and gpu.gfx and gpu.gfx.startswith("gfx") and gpu.memory_total_mib and gpu.gpu_class
        assert report.driver_version and report.driver_version[0].isdigit()
    else:
        assert gpu.bdf == "0000:c4:00.0" and gpu.uuid and gpu.partition_id == 0


@pytest.mark.parametrize("path", fixture_files(TEXT))
def test_every_amd_smi_text_file_parses(path: Path) -> None:
    report = parse_amd_smi_text(read_text(path))
    assert report.warnings == []
    _sane(report)
    if path.name.startswith("topology"):
        assert report.gpus == [] and len(report.links) == 28
    else:
        assert report.gpus and all(g.memory_total_mib for g in report.gpus)


@pytest.mark.parametrize("path", fixture_files(ROCM_SMI))
def test_every_rocm_smi_file_parses(path: Path) -> None:
    text = read_text(path)
    report = parse_rocm_smi_json(text) if path.name.startswith("json") else parse_rocm_smi_text(text)
    assert report.warnings == [] and report.gpus
    _sane(report)
    for gpu in report.gpus:
        assert gpu.device_id and gpu.device_id.startswith("0x")
        assert gpu.power_draw_w is not None and gpu.temperature_junction_c is not None


@pytest.mark.parametrize("path", fixture_files(ROCMINFO))
def test_every_rocminfo_names_its_gpu_agents(path: Path) -> None:
    info = parse_rocminfo(read_text(path))
    assert info.kfd_loaded is True and info.runtime_version == "1.1" and info.warnings == []
    assert info.gpus and all(
        a.name and a.name.startswith("gfx") and a.compute_units and a.memory_kib for a in info.gpus
    )


# --------------------------------------------------------------------------- hand-checked


def test_mi210_static_json_in_the_gpu_data_wrapper() -> None:
    gpu = parse_amd_smi_json(fixture_text(*MI210)).gpus[0]
    assert (gpu.name, gpu.device_id, gpu.gfx, gpu.compute_units) == ("AMD Instinct MI210", "0x740f", "gfx90a", 104)
    assert (gpu.memory_total_mib, gpu.gpu_class, gpu.power_limit_w) == (65520, "MI210-64GB", 300.0)


def test_strix_halo_flat_list_keeps_na_fields_unknown_and_names_no_product_it_is_not() -> None:
    report = parse_amd_smi_json(fixture_text(JSON, "static-strix-halo-radeon-8060s-flat-list-rocm6.3-compat.json.txt"))
    gpu = report.gpus[0]
    assert gpu.gpu_class == "StrixHalo-32GB"  # the bracket names three products: the code name stands
    assert gpu.power_limit_w is None  # "0 W": no cap of its own
    assert gpu.compute_partition is None and gpu.temperature_edge_c is None
    assert report.driver_version == "6.17.1-300.fc43.x86_64"


def test_mi300x_monitor_static_and_topology_together_give_cards_links_and_groups() -> None:
    monitor = parse_amd_smi_text(fixture_text(*MONITOR))
    assert [g.power_draw_w for g in monitor.gpus] == [171, 175, 177, 172, 178, 176, 176, 175]
    topology = parse_amd_topology(fixture_text(*TOPOLOGY))
    bdfs = ["0000:0c:00.0", "0000:22:00.0", "0000:38:00.0", "0000:5c:00.0"]
    bdfs += ["0000:9f:00.0", "0000:af:00.0", "0000:bf:00.0", "0000:df:00.0"]
    static = AmdReport(
        gpus=[AmdGpu(index=i, name="AMD Instinct MI300X", bdf=b, device_id="0x74a1") for i, b in enumerate(bdfs)]
    )
    report = merge_reports(static, monitor, topology)
    assert [g.gpu_class for g in report.gpus] == ["MI300X-192GB"] * 8
    assert len(report.links) == 28 and {link.kind for link in report.links} == {"XGMI"}
    assert (report.links[0].hops, report.links[0].weight) == (1, 15)
    devices, warnings = amd_devices(report)
    assert warnings == [] and [d["index"] for d in devices] == list(range(8))
    first = devices[0]
    assert (first["vendor"], first["kind"], first["device_id"], first["temperature_gpu_c"]) == ("amd", "gpu", "0", 32.0)
    topo = amd_topology(report, devices)
    assert topo is not None and {g["group"] for g in topo["gpus"]} == {"xgmi0"}
    assert topo["gpus"][0]["links"] == {str(i): 1 for i in range(1, 8)}


def test_rocm_smi_json_links_and_showallinfo_memory_from_rocminfo() -> None:
    mi100 = parse_rocm_smi_json(fixture_text(ROCM_SMI, "json-mi100-x4-rocm6.0.2-device-id-key.json.txt"))
    assert [g.gpu_class for g in mi100.gpus] == ["MI100-32GB"] * 4
    merged = merge_reports(mi100)
    assert {(link.a, link.b, link.kind) for link in merged.links} >= {("0", "1", "PCIE")}
    topo = amd_topology(merged, amd_devices(merged)[0])
    assert topo is not None and all(g["group"] is None and g["paths"] for g in topo["gpus"])  # PCIe: no XGMI group
    showall = parse_rocm_smi_text(fixture_text(ROCM_SMI, "showallinfo-a-mi300x-x4-sriov-vbios-drv6.7.0.txt"))
    assert showall.driver_version == "6.7.0" and showall.gpus[0].memory_total_mib is None
    info = parse_rocminfo(fixture_text(ROCMINFO, "mi300x-x4-epyc-9474f-2socket-trailing-spaces.txt"))
    devices, _ = amd_devices(showall, info)
    assert [d["gpu_class"] for d in devices] == ["MI300X-192GB"] * 4 and devices[0]["architecture"] == "gfx942"


def test_old_rocm_smi_printing_a_hex_id_for_the_name_gives_no_name() -> None:
    report = parse_rocm_smi_json(fixture_text(ROCM_SMI, "json-rx6700xt-rocm4.3.0-card-series-hex.json.txt"))
    assert report.gpus[0].name is None and report.gpus[0].gpu_class is None
    assert amd_class("Navi 22 [Radeon RX 6700/6700 XT / 6800M]", 12272) == "Navi22-12GB"
    assert amd_class("AMD Instinct MI300X OAM", 196300) == "MI300X-192GB"
    assert amd_class(None, 196300, "0x74a1") == "MI300X-192GB"
    assert amd_class("AMD Radeon RX 7900 XTX", 24560) == "RX7900XTX-24GB"


# --------------------------------------------------------------------------- bad input


def _metric(**overrides: object) -> str:
    entry = {
        "gpu": 0,
        "usage": {"gfx_activity": {"value": 37, "unit": "%"}, "umc_activity": {"value": 12, "unit": "%"}},
        "power": {"socket_power": {"value": 412, "unit": "W"}},
        "temperature": {"edge": "N/A", "hotspot": {"value": 61, "unit": "C"}, "mem": {"value": 55, "unit": "C"}},
        "ecc": {"total_correctable_count": 3, "total_uncorrectable_count": 0},
        "mem_usage": {"total_vram": {"value": 196592, "unit": "MB"}, "used_vram": {"value": 1200, "unit": "MB"}},
    }
    entry.update(overrides)
    return json.dumps({"gpu_data": [entry]})


def test_metric_json_readings_and_another_version_s_field_names() -> None:
    gpu = parse_amd_smi_json(_metric()).gpus[0]
    assert (gpu.utilization_gpu_pct, gpu.power_draw_w, gpu.temperature_junction_c) == (37, 412, 61)
    assert gpu.temperature_edge_c is None and (gpu.ecc_correctable, gpu.ecc_uncorrectable) == (3, 0)
    older = parse_amd_smi_json(
        json.dumps(
            [
                {
                    "gpu": 0,
                    "power": {"average_socket_power": 300},
                    "ecc": {"total_uncorrectable": 2},
                    "usage": {"gfx_activity": 5},
                }
            ]
        )
    ).gpus[0]
    assert (older.power_draw_w, older.ecc_uncorrectable, older.utilization_gpu_pct) == (300, 2, 5)
    newer = parse_amd_smi_json(
        json.dumps({"gpu_data": [{"gpu": 0, "power": {"socket_power": {"value": "N/A"}}, "new_block": {"x": [1, 2]}}]})
    )
    assert newer.gpus[0].power_draw_w is None and newer.warnings == []


def test_nan_and_negative_readings_are_unknown_and_said() -> None:
    text = _metric(power={"socket_power": {"value": -5, "unit": "W"}}, temperature={"hotspot": "NaN", "mem": -273})
    report = parse_amd_smi_json(text)
    gpu = report.gpus[0]
    assert gpu.power_draw_w is None and gpu.temperature_junction_c is None and gpu.temperature_memory_c is None
    assert any("power -5 is impossible" in w for w in report.warnings)
    nan = parse_amd_smi_json(
        '{"gpu_data": [{"gpu": 0, "usage": {"gfx_activity": NaN}, "power": {"socket_power": 1e999}}]}'
    )
    assert nan.gpus[0].utilization_gpu_pct is None and nan.gpus[0].power_draw_w is None
    assert (
        parse_rocm_smi_json('{"card0": {"GPU use (%)": "250", "Temperature (Sensor edge) (C)": "-1.0"}}')
        .gpus[0]
        .utilization_gpu_pct
        is None
    )


def _partitioned(count: int, compute: str = "CPX", memory: str = "NPS4", same_mode: bool = True) -> AmdReport:
    gpus = []
    for i in range(count):
        gpus.append(
            AmdGpu(
                index=i,
                name="AMD Instinct MI300X",
                device_id="0x74a1",
                bdf=f"0000:0c:00.{i}",
                memory_total_mib=49152,
                compute_partition=compute if same_mode or i else "SPX",
                memory_partition=memory,
                partition_id=i,
                power_draw_w=300.0,
            )
        )
    return merge_reports(AmdReport(gpus=gpus))


def test_an_mi300x_in_cpx_nps4_is_a_split_card_of_eight_partitions_two_to_a_memory_partition() -> None:
    devices, warnings = amd_devices(_partitioned(8))
    assert warnings == []
    card, *parts = devices
    assert (card["index"], card["split"], card["gpu_class"], card["power_draw_w"]) == (0, True, "MI300X-192GB", 300.0)
    assert "device_id" not in card
    assert [p["index"] for p in parts] == list(range(1000, 1008))
    assert {p["gpu_class"] for p in parts} == {"MI300X-192GB-cpx.nps4"}
    assert [p["device_id"] for p in parts] == [str(i) for i in range(8)]
    assert [p["memory_group"] for p in parts] == [
        "0:mem0",
        "0:mem0",
        "0:mem1",
        "0:mem1",
        "0:mem2",
        "0:mem2",
        "0:mem3",
        "0:mem3",
    ]
    assert parts[0]["share"] == pytest.approx(1 / 8) and "power_draw_w" not in parts[0]


def test_partitions_that_cannot_be_told_apart_or_disagree_are_untrusted() -> None:
    devices, warnings = amd_devices(_partitioned(3))
    assert "compute partition CPX makes 8 devices of the card, and the tool lists 3" in devices[0]["fault"]
    assert all("fault" in d for d in devices) and warnings
    devices, _ = amd_devices(_partitioned(8, same_mode=False))
    assert "different partition modes" in devices[0]["fault"]


def test_a_partition_mode_change_between_two_reads_is_a_layout_change() -> None:
    before, _ = amd_devices(_partitioned(1, compute="SPX", memory="NPS1"))
    after, _ = amd_devices(_partitioned(8))
    changes = layout_changes(layout_of(before), layout_of(after))
    assert list(changes) == [0] and "0 slices then, 8 now" in changes[0]


def test_links_of_a_partitioned_card_are_left_out_of_the_topology() -> None:
    report = _partitioned(8)
    devices, _ = amd_devices(report)
    assert amd_topology(report, devices) is None or all(
        g["index"] < 1000 for g in amd_topology(report, devices)["gpus"]
    )
