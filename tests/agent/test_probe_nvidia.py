"""nvidia-smi -q (text and XML) and nvlink -e parsers, against real captured outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.nvidia import (
    GpuReport,
    gpu_class,
    nvidia_class_memory_gb,
    parse_nvidia_smi_text,
    parse_nvidia_smi_xml,
    parse_nvlink_errors,
)
from tests.budget import examples

TEXT = "nvidia-smi-q"
XML = "nvidia-smi-q-xml"
NVLINK = "nvidia-smi-nvlink"

# Files that are deliberately partial upstream; each must say so in a warning.
PARTIAL_TEXT = {"h100-truncated-output-drv535.183.txt"}
PARTIAL_XML = {"a100-sxm4-80gb-mig-enabled-drv535-1of4gpus.xml"}
# `nvidia-smi -q -d PAGE_RETIREMENT`: GPU blocks with only the Retired Pages section.
FILTERED_TEXT = {"q-d-page-retirement-8gpu-azure-drv535.txt"}


def _sane(report: GpuReport, name: str, partial: set[str], filtered: set[str] | None = None) -> None:
    assert report.gpus, "every fixture describes at least one GPU"
    assert report.driver_version and report.driver_version[0].isdigit()
    assert [g.index for g in report.gpus] == list(range(len(report.gpus)))
    for gpu in report.gpus:
        assert gpu.pci_bus_id and ":" in gpu.pci_bus_id
        if filtered and name in filtered:
            assert gpu.name is None and gpu.processes is None
            continue
        assert gpu.name
        assert gpu.uuid and gpu.uuid.startswith("GPU-")
        if gpu.memory_total_mib is not None:
            assert 1000 < gpu.memory_total_mib < 300_000
            assert gpu.memory_used_mib is not None and 0 <= gpu.memory_used_mib <= gpu.memory_total_mib
            assert gpu.gpu_class and gpu.gpu_class.endswith("GB")
        if gpu.temperature_gpu_c is not None:
            assert 0 < gpu.temperature_gpu_c < 110
        if gpu.power_draw_w is not None and gpu.power_limit_w is not None:
            assert 0 < gpu.power_draw_w < gpu.power_limit_w * 1.2
        for value in (gpu.utilization_gpu_pct, gpu.utilization_memory_pct):
            assert value is None or 0 <= value <= 100
        for process in gpu.processes or []:
            assert process.pid and process.pid > 0
    if name in partial:
        assert report.warnings, "a partial output must be reported as such"
    else:
        assert report.warnings == []
        assert report.attached_gpus == len(report.gpus)


@pytest.mark.parametrize("path", fixture_files(TEXT))
def test_text_fixture_parses(path: Path) -> None:
    report = parse_nvidia_smi_text(read_text(path))
    _sane(report, path.name, PARTIAL_TEXT, FILTERED_TEXT)


@pytest.mark.parametrize("path", fixture_files(XML))
def test_xml_fixture_parses(path: Path) -> None:
    report = parse_nvidia_smi_xml(read_text(path))
    _sane(report, path.name, PARTIAL_XML)


@pytest.mark.parametrize("path", fixture_files(NVLINK))
def test_nvlink_fixture_parses(path: Path) -> None:
    counters = parse_nvlink_errors(read_text(path))
    assert isinstance(counters, dict)
    if path.name.startswith("e-"):
        assert counters
    else:  # nvlink -s output and "not supported" messages carry no error counters
        assert counters == {}


# --------------------------------------------------------------------------- hand-checked: text


def test_h100_hgx_fabric_completed_and_power_brake() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt"))
    assert report.driver_version == "535.161.08"
    assert report.cuda_version == "12.2"
    assert len(report.gpus) == 8
    gpu = report.gpus[0]
    assert gpu.pci_bus_id == "00000000:19:00.0"
    assert gpu.uuid == "GPU-ee7954ec-da95-fd7a-ddfd-c6b32cc2f8aa"
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.gpu_class == "H100-80GB"
    assert gpu.memory_total_mib == 81559
    assert gpu.memory_used_mib == 0
    assert gpu.temperature_gpu_c == 29
    assert gpu.temperature_memory_c == 39
    assert gpu.power_draw_w == pytest.approx(67.74)
    assert gpu.power_limit_w == pytest.approx(700.0)
    assert gpu.sm_clock_mhz == 86
    assert gpu.throttle_reasons == ["hw_slowdown", "hw_power_brake_slowdown"]
    assert gpu.pcie_replay_count == 67
    assert report.gpus[1].pcie_replay_count == 63
    assert gpu.ecc_uncorrected_volatile == 0
    assert gpu.ecc_uncorrected_aggregate == 0
    assert gpu.retired_pages_pending is None  # "Pending Page Blacklist : N/A" on HBM3 parts
    assert gpu.remapped_rows_pending is False
    assert gpu.remapped_rows_failure is False
    assert gpu.remapped_rows_uncorrectable == 0
    assert gpu.mig_mode == "Disabled"
    assert gpu.processes == []
    # the old two-field Fabric block: no CliqueId/ClusterUUID lines -> unknown, not 0
    assert gpu.fabric is not None
    assert (gpu.fabric.state, gpu.fabric.status) == ("Completed", "Success")
    assert gpu.fabric.clique_id is None and gpu.fabric.cluster_uuid is None


def test_h100_hgx_clique_zero_and_zero_cluster_uuid() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h100-sxm-80gb-x8-drv565-fabric-clique0-zero-uuid.txt"))
    assert report.driver_version == "565.57.01"
    assert report.cuda_version == "12.7"
    assert len(report.gpus) == 8
    gpu = report.gpus[0]
    assert gpu.pci_bus_id == "00000000:18:00.0"
    assert gpu.power_draw_w == pytest.approx(100.89)
    assert gpu.fabric is not None
    assert gpu.fabric.state == "Completed"
    assert gpu.fabric.clique_id == 0
    assert gpu.fabric.cluster_uuid == "00000000-0000-0000-0000-000000000000"
    assert {g.gpu_class for g in report.gpus} == {"H100-80GB"}


def test_h100_passthrough_vm_throttle_reasons_per_gpu() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h100-80gb-hbm3-x8-drv535.183-passthrough-vm.txt"))
    reasons = [g.throttle_reasons for g in report.gpus]
    assert reasons[0] == ["gpu_idle"]
    assert reasons[2] == ["sw_power_cap", "hw_power_brake_slowdown", "sw_thermal_slowdown"]
    assert [g.pcie_replay_count for g in report.gpus][:3] == [120, 111, 58]
    assert len(report.gpus[2].processes or []) == 1


def test_a10_pending_row_remap() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "a10-drv535.129.txt"))
    gpu = report.gpus[0]
    assert gpu.gpu_class == "A10-24GB"
    assert gpu.memory_total_mib == 23028
    assert gpu.remapped_rows_uncorrectable == 4
    assert gpu.remapped_rows_pending is True
    assert gpu.remapped_rows_failure is False
    assert gpu.power_limit_w == pytest.approx(150.0)
    assert gpu.temperature_memory_c is None  # A10 has no memory sensor: N/A -> None, not 0


def test_a100_x4_fabric_all_na_and_remap_pending_on_second_gpu() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "a100-sxm4-80gb-x4-drv555-fabric-na.txt"))
    assert report.driver_version == "555.42.02"
    assert [g.pci_bus_id for g in report.gpus] == [
        "00000000:68:00.0",
        "00000000:9E:00.0",
        "00000000:C2:00.0",
        "00000000:D4:00.0",
    ]
    assert [g.remapped_rows_pending for g in report.gpus] == [False, True, False, False]
    assert {g.gpu_class for g in report.gpus} == {"A100-80GB"}
    assert report.gpus[0].memory_total_mib == 81920
    fabric = report.gpus[0].fabric
    assert fabric is not None
    assert (fabric.state, fabric.status, fabric.clique_id, fabric.cluster_uuid) == (None, None, None, None)


def test_gtx680_legacy_driver_470_layout() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "gtx680-kepler-drv470-legacy-format.txt"))
    assert (report.driver_version, report.cuda_version) == ("470.256.02", "11.4")
    gpu = report.gpus[0]
    assert gpu.gpu_class == "GTX680-2GB"
    assert gpu.memory_total_mib == 2000
    assert gpu.temperature_gpu_c == 35
    # everything this card does not report is unknown, not zero
    assert gpu.utilization_gpu_pct is None
    assert gpu.power_draw_w is None and gpu.power_limit_w is None
    assert gpu.throttle_reasons is None  # "Clocks Throttle Reasons : N/A"
    assert gpu.ecc_uncorrected_volatile is None
    assert gpu.remapped_rows_pending is None  # "Remapped Rows : N/A"
    assert gpu.fabric is None  # no Fabric block before driver 535
    assert gpu.processes == []


def test_truncated_output_keeps_what_it_holds() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h100-truncated-output-drv535.183.txt"))
    assert report.attached_gpus == 8
    assert len(report.gpus) == 1
    gpu = report.gpus[0]
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.pci_bus_id == "00000000:53:00.0"
    assert gpu.pcie_replay_count == 120
    assert gpu.throttle_reasons == ["gpu_idle"]
    assert gpu.memory_total_mib is None  # cut before FB Memory Usage
    assert gpu.gpu_class == "H100"
    assert gpu.processes is None
    assert any("8 attached" in w for w in report.warnings)
    assert any("truncated" in w for w in report.warnings)


def test_h100_gpu_burn_driver_590_processes_and_average_power() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h100-80gb-hbm3-vm-drv590-gpu-burn-load-masked.txt"))
    assert (report.driver_version, report.cuda_version) == ("590.48.01", "13.1")
    gpu = report.gpus[0]
    assert gpu.utilization_gpu_pct == 100
    assert gpu.utilization_memory_pct == 11
    assert gpu.sm_clock_mhz == 1980
    assert (gpu.temperature_gpu_c, gpu.temperature_memory_c) == (59, 55)
    assert gpu.power_draw_w == pytest.approx(629.45)  # "Average Power Draw"; no plain "Power Draw" in 590
    assert gpu.power_limit_w == pytest.approx(700.0)
    assert gpu.throttle_reasons == []
    assert gpu.processes is not None
    assert [(p.pid, p.name, p.used_memory_mib) for p in gpu.processes] == [
        (11327, "/root/tools/memhog", 2566),
        (11328, "/root/tools/memhog", 1542),
        (11345, "./gpu_burn", 15690),
    ]
    assert gpu.fabric is not None and gpu.fabric.clique_id == 0
    assert gpu.fabric.health_summary is None  # "Summary : N/A"


def test_mig_enabled_h100() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h100-mig-enabled-drv590-idle-masked.txt"))
    gpu = report.gpus[0]
    assert gpu.mig_mode == "Enabled"
    assert gpu.utilization_gpu_pct is None  # not reported for the whole GPU in MIG mode
    assert gpu.memory_total_mib == 81559
    assert gpu.ecc_uncorrected_volatile == 0  # the GPU-level ECC section, not a MIG device's


def test_h200_mig_processes_and_class() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "h200-mig-enabled-drv590-load-masked.txt"))
    gpu = report.gpus[0]
    assert gpu.gpu_class == "H200-141GB"
    assert gpu.memory_total_mib == 143771
    assert gpu.mig_mode == "Enabled"
    assert [p.pid for p in gpu.processes or []] == [12249, 12250, 12267]


def test_windows_driver_610_kmd_version_and_wddm_processes() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "rtx2080super-windows-drv610-load-masked.txt"))
    # "Driver Version : 610.62 [Deprecated; ...]" -> the KMD version
    assert (report.driver_version, report.cuda_version) == ("610.62", "13.3")
    gpu = report.gpus[0]
    assert gpu.gpu_class == "RTX2080SUPER-8GB"
    assert gpu.power_draw_w == pytest.approx(97.99)
    assert gpu.power_limit_w == pytest.approx(250.0)  # from "GPU Ceiling Power Limit"
    assert gpu.processes is not None and len(gpu.processes) == 21
    first = gpu.processes[0]
    assert (first.pid, first.name, first.process_type) == (2140, r"C:\Windows\System32\dwm.exe", "C+G")
    assert first.used_memory_mib is None  # "Not available in WDDM driver model"


def test_page_retirement_filtered_output() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "q-d-page-retirement-8gpu-azure-drv535.txt"))
    assert report.driver_version == "535.86.10"
    assert [g.pci_bus_id for g in report.gpus] == [f"0000000{i}:00:00.0" for i in range(1, 9)]
    assert all(g.retired_pages_pending is False for g in report.gpus)
    assert all(g.memory_total_mib is None and g.temperature_gpu_c is None for g in report.gpus)
    assert report.warnings == []


def test_v100_legacy_ecc_layout() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "v100-sxm2-16gb-x8-drv550.txt"))
    gpu = report.gpus[0]
    assert gpu.name == "Tesla V100-SXM2-16GB"
    assert gpu.gpu_class == "V100-16GB"
    assert gpu.ecc_uncorrected_volatile == 0  # from "Double Bit > Total"
    assert gpu.retired_pages_pending is False
    assert gpu.temperature_memory_c == 33
    assert gpu.remapped_rows_pending is None


def test_rtx4090_busy_processes_per_gpu() -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, "rtx4090-x8-drv535.154-busy-p2.txt"))
    assert {g.gpu_class for g in report.gpus} == {"RTX4090-24GB"}
    assert [(p.pid, p.used_memory_mib) for p in report.gpus[0].processes or []] == [(58130, 20322)]
    assert report.gpus[5].processes == []
    assert report.gpus[1].utilization_gpu_pct == 100
    assert report.gpus[1].temperature_gpu_c == 58


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("l40s-drv550.txt", "L40S-48GB"),
        ("l4-drv550.txt", "L4-24GB"),
        ("h100-nvl-x2-drv550.txt", "H100NVL-94GB"),
        ("rtx6000-ada-x8-drv550.txt", "RTX6000Ada-48GB"),
        ("rtx5090-blackwell-drv570.txt", "RTX5090-32GB"),
        ("titan-v-volta-drv560.txt", "TITANV-12GB"),
        ("h200-x1-passthrough-vm-drv550-fabric-completed-clique0.txt", "H200-141GB"),
    ],
)
def test_gpu_class_of_text_fixtures(name: str, expected: str) -> None:
    report = parse_nvidia_smi_text(fixture_text(TEXT, name))
    assert {g.gpu_class for g in report.gpus} == {expected}


# --------------------------------------------------------------------------- hand-checked: XML


def test_xml_tesla_t4() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "tesla-t4-aws-drv515.xml"))
    assert (report.driver_version, report.cuda_version) == ("515.105.01", "11.7")
    gpu = report.gpus[0]
    assert gpu.pci_bus_id == "00000000:00:1E.0"
    assert gpu.name == "Tesla T4"
    assert gpu.gpu_class == "T4-16GB"
    assert gpu.memory_total_mib == 15360
    assert gpu.temperature_gpu_c == 40
    assert gpu.power_draw_w == pytest.approx(26.78)
    assert gpu.power_limit_w == pytest.approx(70.0)
    assert gpu.ecc_uncorrected_volatile == 0
    assert gpu.retired_pages_pending is False
    assert gpu.remapped_rows_pending is None
    assert gpu.fabric is None  # DTD v11 has no <fabric>
    assert len(gpu.processes or []) == 2


def test_xml_a100_mig_trimmed_to_one_of_four() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "a100-sxm4-80gb-mig-enabled-drv535-1of4gpus.xml"))
    assert report.attached_gpus == 4
    assert len(report.gpus) == 1
    assert any("4 attached" in w for w in report.warnings)
    gpu = report.gpus[0]
    assert gpu.mig_mode == "Enabled"
    assert gpu.gpu_class == "A100-80GB"
    assert gpu.temperature_memory_c == 44


def test_xml_a100_40gb_mig_volatile_ecc_na() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "a100-sxm4-40gb-mig-2-instances-passthrough-drv510.xml"))
    gpu = report.gpus[0]
    assert gpu.gpu_class == "A100-40GB"
    assert gpu.ecc_uncorrected_volatile is None  # all N/A in MIG mode
    assert gpu.ecc_uncorrected_aggregate == 0
    assert gpu.throttle_reasons == []  # includes the element whose text is wrapped over two lines


def test_xml_rtx_a5000_pair_with_llama_server() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "rtx-a5000-x2-drv590.xml"))
    assert report.driver_version == "590.44.01"
    assert [g.pci_bus_id for g in report.gpus] == ["00000000:81:00.0", "00000000:C1:00.0"]
    assert [g.gpu_class for g in report.gpus] == ["RTXA5000-24GB", "RTXA5000-24GB"]
    used = [[(p.pid, p.used_memory_mib) for p in g.processes or []] for g in report.gpus]
    assert used == [[(100477, 22430)], [(100477, 17246)]]
    assert report.gpus[0].processes[0].name == "/root/src/llama.cpp/build/bin/llama-server"  # type: ignore[index]


def test_xml_windows_many_processes_without_memory() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "rtx2080-windows-wddm-many-processes-drv516.xml"))
    processes = report.gpus[0].processes or []
    assert len(processes) == 26
    assert all(p.used_memory_mib is None for p in processes)
    assert processes[0].pid == 7724


def test_xml_new_schema_fields() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "rtx4000-sff-ada-drv595.xml"))
    gpu = report.gpus[0]
    assert gpu.gpu_class == "RTX4000SFFAda-20GB"
    assert gpu.power_draw_w == pytest.approx(8.81)  # average_power_draw
    assert gpu.power_limit_w == pytest.approx(70.0)
    assert gpu.utilization_memory_pct == 37
    assert gpu.throttle_reasons == ["gpu_idle"]
    assert gpu.fabric is not None and gpu.fabric.state is None
    rtx3090 = parse_nvidia_smi_xml(fixture_text(XML, "rtx3090-drv590-schema-v13.xml")).gpus[0]
    assert rtx3090.throttle_reasons == ["sw_power_cap"]


def test_xml_old_schema_graphics_device() -> None:
    report = parse_nvidia_smi_xml(fixture_text(XML, "gtx1660ti-graphics-device-drv418.xml"))
    assert report.driver_version == "418.43"
    gpu = report.gpus[0]
    assert gpu.name == "Graphics Device"
    assert gpu.gpu_class == "GraphicsDevice-6GB"
    p400 = parse_nvidia_smi_xml(fixture_text(XML, "quadro-p400-drv418-schema-v10.xml")).gpus[0]
    assert p400.gpu_class == "P400-2GB"
    assert p400.power_draw_w is None  # <power_draw>N/A</power_draw>


def test_xml_truncated_mid_document() -> None:
    text = fixture_text(XML, "rtx-a5000-x2-drv590.xml")
    cut = text[: text.index("<fb_memory_usage>", text.index('<gpu id="00000000:C1:00.0">')) + 30]
    report = parse_nvidia_smi_xml(cut)
    assert any("truncated" in w for w in report.warnings)
    assert len(report.gpus) == 2
    assert report.gpus[0].memory_total_mib == 24564  # the complete first GPU is intact
    assert report.gpus[1].name == "NVIDIA RTX A5000"
    assert report.gpus[1].temperature_gpu_c is None  # after the cut: unknown


def test_xml_text_and_xml_agree_on_shared_fields() -> None:
    # Not the same capture, but both formats of a 590-series driver must fill the same fields.
    xml_gpu = parse_nvidia_smi_xml(fixture_text(XML, "rtx2080-x2-drv590.xml")).gpus[0]
    text_gpu = parse_nvidia_smi_text(fixture_text(TEXT, "rtx2080super-linux-drv610-idle-masked.txt")).gpus[0]
    for gpu in (xml_gpu, text_gpu):
        assert gpu.memory_total_mib == 8192
        assert gpu.power_draw_w is not None and gpu.power_limit_w is not None
        assert gpu.throttle_reasons == ["gpu_idle"]


# --------------------------------------------------------------------------- robustness


@pytest.mark.parametrize(
    "text",
    ["", "   \n", "garbage", "<nvidia_smi_log><gpu id=", "No devices were found\n", "\ufeff<?xml version='1.0'?><x/>"],
)
def test_odd_input_never_raises(text: str) -> None:
    for parser in (parse_nvidia_smi_text, parse_nvidia_smi_xml):
        report = parser(text)
        assert report.gpus == []
        assert report.warnings
    assert parse_nvlink_errors(text) == {}


def test_xml_with_leading_noise_and_crlf() -> None:
    text = fixture_text(XML, "tesla-t4-aws-drv515.xml").replace("\n", "\r\n")
    report = parse_nvidia_smi_xml("WARNING: infoROM is corrupted at gpu 0000:00:1E.0\r\n" + text)
    assert report.gpus[0].memory_total_mib == 15360
    assert any("before the XML" in w for w in report.warnings)


def test_text_with_crlf_and_bom() -> None:
    text = "\ufeff" + fixture_text(TEXT, "l4-drv550.txt").replace("\n", "\r\n")
    report = parse_nvidia_smi_text(text)
    assert report.gpus[0].gpu_class == "L4-24GB"
    assert report.gpus[0].power_draw_w == pytest.approx(16.47)
    assert report.warnings == []


@settings(max_examples=examples(60), deadline=None)
@given(st.text(alphabet=st.sampled_from(list("GPU 0:.\n :NA/[]WMiBC%-xyz<>\t")), max_size=400))
def test_fuzzed_text_never_raises(text: str) -> None:
    parse_nvidia_smi_text(text)
    parse_nvidia_smi_xml(text)
    parse_nvlink_errors(text)


@settings(max_examples=examples(40), deadline=None)
@given(st.data())
def test_dropping_lines_from_a_real_output_never_raises(data: st.DataObject) -> None:
    lines = fixture_text(TEXT, "h100-80gb-hbm3-vm-drv590-gpu-burn-load-masked.txt").splitlines()
    keep = data.draw(st.lists(st.booleans(), min_size=len(lines), max_size=len(lines)))
    report = parse_nvidia_smi_text("\n".join(line for line, k in zip(lines, keep, strict=True) if k))
    for gpu in report.gpus:
        assert gpu.power_draw_w is None or gpu.power_draw_w > 0


# --------------------------------------------------------------------------- gpu_class


@pytest.mark.parametrize(
    ("name", "memory_mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-PCIE-40GB", 40536, "A100-40GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
        ("NVIDIA L40S", 46068, "L40S-48GB"),
        ("Tesla P100-PCIE-16GB", 16280, "P100-16GB"),
        ("NVIDIA GeForce RTX 3060 Laptop GPU", 6144, "RTX3060Laptop-6GB"),
        ("NVIDIA H100 80GB HBM3", None, "H100"),
        ("NVIDIA B200", 183359, "B200-180GB"),
        ("Some Future GPU", 26 * 1024, "SomeFuture-26GB"),
    ],
)
def test_gpu_class(name: str, memory_mib: int | None, expected: str) -> None:
    assert gpu_class(name, memory_mib) == expected


def test_gpu_class_unknown_name() -> None:
    assert gpu_class(None, 81559) is None
    assert gpu_class("", 81559) is None
    assert nvidia_class_memory_gb(None) is None
    assert nvidia_class_memory_gb(0) is None


# --------------------------------------------------------------------------- nvlink -e


def test_nvlink_errors_h100_fixture() -> None:
    counters = parse_nvlink_errors(fixture_text(NVLINK, "e-h100-error-counters-abridged.txt"))
    assert counters == {0: {"replay": 0, "recovery": 0, "crc": 0}}


def test_nvlink_errors_sum_over_links_and_normalise_names() -> None:
    text = (
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-x)\n"
        "\t Link 0: Replay Errors: 2\n"
        "\t Link 1: Replay Errors: 3\n"
        "\t Link 0: CRC FLIT Error: 1\n"
        "\t Link 1: CRC Data Error: N/A\n"
        "GPU 3: NVIDIA A100-SXM4-80GB (UUID: GPU-y)\n"
        "\t Link 5: Recovery Errors: 7\n"
        "\t Link 6: 25 GB/s\n"
    )
    assert parse_nvlink_errors(text) == {0: {"replay": 5, "crc_flit": 1}, 3: {"recovery": 7}}


# --------------------------------------------------------------------------- hand-checked: our own H200 capture


@pytest.mark.parametrize(
    "parse, name", [(parse_nvidia_smi_xml, "h200-drv580-idle.xml"), (parse_nvidia_smi_text, "h200-drv580-idle.txt")]
)
def test_h200_pcie_vm_driver_580_idle(parse: object, name: str) -> None:
    folder = XML if name.endswith(".xml") else TEXT
    report = parse(fixture_text(folder, name))  # type: ignore[operator]
    assert report.driver_version == "580.159.04" and report.cuda_version == "13.0"
    assert report.warnings == [] and len(report.gpus) == 1
    gpu = report.gpus[0]
    assert (gpu.name, gpu.gpu_class, gpu.memory_total_mib, gpu.memory_used_mib) == (
        "NVIDIA H200",
        "H200-141GB",
        143771,
        0,
    )
    assert gpu.uuid == "GPU-71b8d6c8-52ee-41c1-d4ae-7007e8a9d0b5" and gpu.pci_bus_id == "00000000:00:06.0"
    assert gpu.temperature_gpu_c == 34 and gpu.power_limit_w == 700.0 and round(gpu.power_draw_w or 0) == 79
    assert gpu.throttle_reasons == ["gpu_idle"] and gpu.mig_mode == "Disabled"
    assert gpu.ecc_uncorrected_volatile == 0 and gpu.remapped_rows_pending is False
    assert gpu.processes == []


@pytest.mark.parametrize(
    "parse, name",
    [
        (parse_nvidia_smi_xml, "h200-drv580-one-compute-process.xml"),
        (parse_nvidia_smi_text, "h200-drv580-one-compute-process.txt"),
    ],
)
def test_h200_with_a_compute_process_names_it(parse: object, name: str) -> None:
    folder = XML if name.endswith(".xml") else TEXT
    gpu = parse(fixture_text(folder, name)).gpus[0]  # type: ignore[operator]
    assert gpu.memory_used_mib == 2575 and gpu.sm_clock_mhz == 1980 and gpu.throttle_reasons == []
    assert [(p.pid, p.name, p.used_memory_mib, p.process_type) for p in gpu.processes] == [(674, "python3", 2566, "C")]


def test_nvlink_errors_of_a_card_without_nvlink_are_none() -> None:
    assert parse_nvlink_errors(fixture_text(NVLINK, "no-links-h200-pcie-vm-drv580-e.txt")) == {}
