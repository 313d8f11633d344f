"""CPU package / inlet temperatures from hwmon sysfs, sensors -j and sensors -u."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.hwmon import Temps, parse_sensors_json, parse_sensors_u, read_hwmon, tree_from_grep_r
from tests.budget import examples

FOLDER = "hwmon-sensors"


def parse_any(path: Path) -> Temps:
    """Pick the parser from the file name: ``*.json*`` sensors -j, ``-u-A`` sensors -u, ``grep-r`` sysfs."""
    text = read_text(path)
    if ".json" in path.name:
        return parse_sensors_json(text)
    if "-u-A" in path.name:
        return parse_sensors_u(text)
    if "grep-r" in path.name:
        return read_hwmon(tree_from_grep_r(text))
    raise AssertionError(f"no parser known for fixture {path.name}; name it *.json.txt, *-u-A*, or *grep-r*")


@pytest.mark.parametrize("path", fixture_files(FOLDER))
def test_hwmon_fixture_parses(path: Path) -> None:
    temps = parse_any(path)
    assert temps.readings
    assert temps.cpu_packages, "every fixture has a coretemp package sensor"
    assert temps.cpu_package_c == max(temps.cpu_packages.values())
    assert all(10 < value < 105 for value in temps.cpu_packages.values())
    assert temps.inlet_c is None or 0 < temps.inlet_c < 85


def test_sensors_json_nct6798_with_bogus_systin() -> None:
    temps = parse_sensors_json(fixture_text(FOLDER, "sensors-j-json-asrock-nct6798-coretemp-nvme.json.txt"))
    assert temps.cpu_packages == {"coretemp-isa-0000/Package id 0": 37.0}
    assert temps.cpu_package_c == 37.0
    # SYSTIN reads 120 °C: an unconnected input, so no inlet temperature rather than a wrong one
    assert temps.readings["nct6798-isa-02a0/SYSTIN"] == 120.0
    assert temps.inlet_c is None
    assert any("SYSTIN" in w for w in temps.warnings)
    assert temps.readings["nvme-pci-0200/Composite"] == pytest.approx(34.85)
    assert temps.readings["coretemp-isa-0000/Core 31"] == 35.0


def test_sensors_json_coretemp_acpitz_nvme() -> None:
    temps = parse_sensors_json(fixture_text(FOLDER, "sensors-j-json-coretemp-acpitz-2nvme-fan-fail.json.txt"))
    assert temps.cpu_packages == {"coretemp-isa-0000/Package id 0": 27.0}
    assert temps.inlet_c is None
    assert temps.warnings == []
    assert temps.readings["acpitz-acpi-0/temp1"] == pytest.approx(27.8)
    assert len([k for k in temps.readings if k.startswith("coretemp")]) == 17


def test_sensors_u_two_sockets() -> None:
    temps = parse_sensors_u(fixture_text(FOLDER, "sensors-u-A-2socket-coretemp-acpitz-atk0110-telegraf-mock.txt"))
    assert temps.cpu_packages == {
        "coretemp-isa-0000/Physical id 0": 77.0,
        "coretemp-isa-0001/Physical id 1": 70.0,
    }
    assert temps.cpu_package_c == 77.0
    assert temps.readings["acpitz-virtual-0/temp1"] == pytest.approx(8.3)
    assert "atk0110-acpi-0/+3.3 Voltage" not in temps.readings  # voltages are not temperatures
    assert temps.warnings == []


def test_sensors_u_with_adapter_lines_and_k10temp() -> None:
    text = (
        "k10temp-pci-00c3\n"
        "Adapter: PCI adapter\n"
        "Tctl:\n"
        "  temp1_input: 45.250\n"
        "Tccd1:\n"
        "  temp3_input: 40.000\n"
        "\n"
        "nct6775-isa-0290\n"
        "Adapter: ISA adapter\n"
        "SYSTIN:\n"
        "  temp1_input: 28.000\n"
        "  temp1_max: 80.000\n"
    )
    temps = parse_sensors_u(text)
    assert temps.cpu_packages == {"k10temp-pci-00c3/Tctl": 45.25}
    assert temps.inlet_c == 28.0
    assert temps.readings["k10temp-pci-00c3/Tccd1"] == 40.0
    assert temps.warnings == []


def test_sysfs_grep_listing_two_coretemp_devices() -> None:
    tree = tree_from_grep_r(fixture_text(FOLDER, "sysfs-coretemp-2socket-node-exporter-fixture-grep-r.txt"))
    assert tree["coretemp.0/hwmon/hwmon0/temp1_label"] == "Physical id 0"
    assert tree["coretemp.1/hwmon/hwmon1/temp5_input"] == "50000"
    temps = read_hwmon(tree)
    assert temps.cpu_packages == {"coretemp-hwmon0/Physical id 0": 55.0, "coretemp-hwmon1/Physical id 0": 55.0}
    assert temps.readings["coretemp-hwmon1/Core 3"] == 50.0
    assert len(temps.readings) == 10


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, content in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content + "\n")


def test_read_hwmon_real_root_with_k10temp_and_inlet(tmp_path: Path) -> None:
    _write_tree(
        tmp_path,
        {
            "sys/class/hwmon/hwmon0/name": "k10temp",
            "sys/class/hwmon/hwmon0/temp1_label": "Tctl",
            "sys/class/hwmon/hwmon0/temp1_input": "64875",
            "sys/class/hwmon/hwmon0/temp2_label": "Tdie",
            "sys/class/hwmon/hwmon0/temp2_input": "54875",
            "sys/class/hwmon/hwmon0/temp3_label": "Tccd1",
            "sys/class/hwmon/hwmon0/temp3_input": "50000",
            "sys/class/hwmon/hwmon1/name": "k10temp",
            "sys/class/hwmon/hwmon1/temp1_label": "Tctl",
            "sys/class/hwmon/hwmon1/temp1_input": "58000",
            "sys/class/hwmon/hwmon2/name": "nct6779",
            "sys/class/hwmon/hwmon2/temp1_label": "SYSTIN",
            "sys/class/hwmon/hwmon2/temp1_input": "31000",
            "sys/class/hwmon/hwmon2/temp2_label": "AUXTIN0",
            "sys/class/hwmon/hwmon2/temp2_input": "-1000",
            "sys/class/hwmon/hwmon10/name": "ipmi_si",
            "sys/class/hwmon/hwmon10/temp1_label": "Inlet Temp",
            "sys/class/hwmon/hwmon10/temp1_input": "24000",
            "sys/class/hwmon/hwmon11/name": "nvme",
            "sys/class/hwmon/hwmon11/temp1_label": "Composite",
            "sys/class/hwmon/hwmon11/temp1_input": "not-a-number",
        },
    )
    temps = read_hwmon(str(tmp_path))
    assert temps.cpu_packages == {"k10temp-hwmon0/Tdie": 54.875, "k10temp-hwmon1/Tctl": 58.0}
    assert temps.cpu_package_c == 58.0
    assert temps.inlet_c == 24.0  # an "Inlet" label wins over SYSTIN
    assert "nct6779-hwmon2/AUXTIN0" in temps.readings
    assert any("unparsable" in w for w in temps.warnings)


def test_read_hwmon_no_sensors(tmp_path: Path) -> None:
    temps = read_hwmon(str(tmp_path))  # a VM: no /sys/class/hwmon at all
    assert temps.cpu_package_c is None and temps.inlet_c is None
    assert temps.cpu_packages == {}
    assert temps.warnings == ["no temperature sensors found"]
    assert read_hwmon({}).cpu_package_c is None


def test_inlet_from_systin_when_plausible() -> None:
    text = '{"nct6798-isa-0290": {"Adapter": "ISA adapter", "SYSTIN": {"temp1_input": 29.0}}}'
    temps = parse_sensors_json(text)
    assert temps.inlet_c == 29.0
    assert temps.cpu_package_c is None


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '{"chip": 5}', '{"chip": {"x": {"temp1_input": "hot"}}}'])
def test_sensors_json_odd_input(text: str) -> None:
    temps = parse_sensors_json(text)
    assert temps.cpu_package_c is None and temps.inlet_c is None
    assert temps.warnings


def test_tree_from_grep_r_edge_cases() -> None:
    tree = tree_from_grep_r(
        "./hwmon0/name:coretemp\n"
        "Binary file hwmon0/power matches\n"
        "hwmon0/uevent:A=1\n"
        "hwmon0/uevent:B=2\n"
        "intel-rapl:0:0/name:core\n"
        "no colon here\n"
    )
    assert tree == {"hwmon0/name": "coretemp", "hwmon0/uevent": "A=1\nB=2", "intel-rapl:0:0/name": "core"}


@settings(max_examples=examples(60), deadline=None)
@given(st.text(max_size=300))
def test_fuzzed_never_raises(text: str) -> None:
    parse_sensors_json(text)
    parse_sensors_u(text)
    read_hwmon(tree_from_grep_r(text))
