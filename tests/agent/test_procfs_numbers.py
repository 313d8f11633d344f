"""/proc numbers that are not numbers, and a UTF-8 BOM: a warning naming the field, never an
exception, and the rest of the sample kept."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent import protocol
from agent.config import parse_config
from agent.probes.hwmon import read_hwmon
from agent.probes.procfs import (
    parse_cpuinfo,
    parse_load_average,
    parse_loadavg,
    parse_lscpu,
    parse_meminfo,
    parse_pid_stat,
    parse_proc_stat,
)
from agent.probes.rapl import read_rapl
from agent.sampler import Sampler
from tests.budget import examples
from tests.fleet import HOSTS, build_host, fixtures_available

BOM = "\ufeff"

# Values int() or str.isdigit() would let through, or that no kernel prints.
BAD_NUMBERS = [
    "１２３",  # full-width digits: int() reads them as 123
    "١٢٣",  # Arabic-Indic digits, likewise
    "²",  # str.isdigit() is True, int() raises
    "12e5",
    "-",
    "-5",
    "1_000",  # int() reads 1000
    "0x10",
    "1" * 25,  # more digits than a 64-bit counter
    "9" * 5000,  # more than int() converts at all
]

STAT = ("proc-stat", "procfs-fixture-8cpu-laptop-huge-intr-line.txt")
MEMINFO = ("proc-meminfo", "sysstat-root1-8gb-desktop-memavailable.txt")
CPUINFO = ("proc-cpuinfo", "procfs-fixture-i7-8650u-8cpu-avx2.txt")


def _set_cpu_field(text: str, index: int, value: str) -> str:
    """The text with field ``index`` (0 = user) of the aggregate ``cpu`` line replaced."""
    lines = text.splitlines(keepends=True)
    for n, line in enumerate(lines):
        if line.split()[:1] == ["cpu"]:
            parts = line.split()
            parts[index + 1] = value
            lines[n] = " ".join(parts) + "\n"
            break
    return "".join(lines)


def _set_meminfo_value(text: str, key: str, value: str) -> str:
    return re.sub(rf"^({re.escape(key)}:\s+)\S+", lambda m: m.group(1) + value, text, count=1, flags=re.MULTILINE)


# --------------------------------------------------------------------------- one bad number


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_a_bad_proc_stat_field_is_named_and_the_others_are_kept(bad: str) -> None:
    text = fixture_text(*STAT)
    good = parse_proc_stat(text)
    times = parse_proc_stat(_set_cpu_field(text, 4, bad))  # iowait
    assert times.total == {k: v for k, v in good.total.items() if k != "iowait"}
    assert times.per_cpu == good.per_cpu
    assert len(times.warnings) == 1 and "cpu iowait" in times.warnings[0]
    assert times.idle is None  # idle + iowait cannot be added up without iowait
    assert times.busy == good.busy


def test_a_bad_busy_field_leaves_busy_unknown_not_short() -> None:
    text = fixture_text(*STAT)
    good = parse_proc_stat(text)
    times = parse_proc_stat(_set_cpu_field(text, 7, "１２"))  # steal
    assert times.busy is None and times.idle == good.idle
    assert set(times.total) == set(good.total) - {"steal"}
    assert "cpu steal" in times.warnings[0]


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_a_bad_meminfo_field_is_named_and_the_others_are_kept(bad: str) -> None:
    text = fixture_text(*MEMINFO)
    good = parse_meminfo(text)
    info = parse_meminfo(_set_meminfo_value(text, "MemFree", bad))
    assert (info.total_bytes, info.available_bytes) == (good.total_bytes, good.available_bytes)
    assert info.free_bytes is None
    assert len(info.warnings) == 1 and "MemFree" in info.warnings[0]


def test_a_bad_memtotal_is_named_not_reported_missing() -> None:
    info = parse_meminfo(_set_meminfo_value(fixture_text(*MEMINFO), "MemTotal", "12e5"))
    assert info.total_bytes is None and info.available_bytes is not None
    assert info.warnings == ["/proc/meminfo: MemTotal is not a plain number ('12e5'); ignored"]


def test_a_meminfo_field_with_an_unknown_unit_is_named() -> None:
    info = parse_meminfo("MemTotal: 100 kB\nMemFree: 5 parsecs\nMemAvailable: 50 kB\n")
    assert (info.total_bytes, info.available_bytes, info.free_bytes) == (102400, 51200, None)
    assert len(info.warnings) == 1 and "MemFree" in info.warnings[0]


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_a_bad_cpuinfo_count_is_named_and_the_others_are_kept(bad: str) -> None:
    text = fixture_text(*CPUINFO)
    good = parse_cpuinfo(text)
    cpu = parse_cpuinfo(re.sub(r"^(cpu cores\s*:\s*)\S+", lambda m: m.group(1) + bad, text, flags=re.MULTILINE))
    assert cpu.cores_per_socket is None and cpu.threads_per_core is None
    assert dataclasses.replace(cpu, cores_per_socket=None, threads_per_core=None, warnings=[]) == dataclasses.replace(
        good, cores_per_socket=None, threads_per_core=None, warnings=[]
    )
    assert len(cpu.warnings) == 1 and "cpu cores" in cpu.warnings[0]


def test_a_processor_entry_with_a_bad_number_is_named() -> None:
    text = fixture_text(*CPUINFO)
    cpu = parse_cpuinfo(re.sub(r"^processor\s*:\s*3$", "processor\t: ３", text, flags=re.MULTILINE))
    assert cpu.logical_cpus == parse_cpuinfo(text).logical_cpus - 1  # type: ignore[operator]
    assert any("processor" in w and "３" in w for w in cpu.warnings)
    assert cpu.model == "Intel(R) Core(TM) i7-8650U CPU @ 1.90GHz"


@pytest.mark.parametrize("bad", BAD_NUMBERS)
def test_a_bad_load_average_is_named_and_the_others_are_kept(bad: str) -> None:
    load = parse_load_average(f"0.52 {bad} 0.59 1/467 12345\n")
    assert (load.one, load.five, load.fifteen) == (0.52, None, 0.59)
    assert len(load.warnings) == 1 and "5-minute load" in load.warnings[0]
    assert load.values is None and parse_loadavg(f"0.52 {bad} 0.59 1/467 12345\n") is None


def test_full_width_load_averages_are_not_read_as_numbers() -> None:
    assert parse_loadavg("０.52 0.58 0.59 1/467 12345\n") is None  # float() would take it
    assert parse_load_average("0.52 0.58\n").warnings == ["/proc/loadavg has 2 of the 3 load averages"]


def _pid_stat(pid: str = "4242", pgrp: str = "4200", utime: str = "150", rss: str = "2048") -> str:
    fields = ["S", "1", pgrp, pgrp, "0", "-1", "4194560", "100", "0", "0", "0", utime, "50", "0", "0", "20", "0"]
    fields += ["4", "0", "12345", "1000000", rss, "18446744073709551615"] + ["0"] * 30
    return f"{pid} (vllm) " + " ".join(fields) + "\n"


@pytest.mark.parametrize("bad", BAD_NUMBERS)
@pytest.mark.parametrize("where", ["pid", "pgrp", "utime", "rss"])
def test_a_pid_stat_with_a_bad_number_is_unreadable_not_an_exception(where: str, bad: str) -> None:
    assert parse_pid_stat(_pid_stat(**{where: bad})) is None
    assert parse_pid_stat(_pid_stat()) is not None


def test_rapl_and_hwmon_readings_are_ascii_numbers(tmp_path: Path) -> None:
    rapl = read_rapl(
        {"sys/class/powercap/intel-rapl:0/name": "package-0", "sys/class/powercap/intel-rapl:0/energy_uj": "²"}
    )
    assert rapl.zones["intel-rapl:0"].energy_uj is None
    assert any("energy_uj unparsable" in w for w in rapl.warnings)
    hwmon = tmp_path / "sys" / "class" / "hwmon" / "hwmon0"
    hwmon.mkdir(parents=True)
    (hwmon / "name").write_text("coretemp\n")
    (hwmon / "temp1_label").write_text("Package id 0\n")
    (hwmon / "temp1_input").write_text("４５０００\n")
    (hwmon / "temp2_input").write_text("nan\n")
    temps = read_hwmon(str(tmp_path))
    assert temps.readings == {}
    assert sum("unparsable" in w for w in temps.warnings) == 2


# --------------------------------------------------------------------------- BOM


@pytest.mark.parametrize(
    ("folder", "parse"),
    [
        ("proc-stat", parse_proc_stat),
        ("proc-meminfo", parse_meminfo),
        ("proc-cpuinfo", parse_cpuinfo),
        ("lscpu", parse_lscpu),
    ],
    ids=["proc-stat", "proc-meminfo", "proc-cpuinfo", "lscpu"],
)
def test_a_bom_prefixed_fixture_parses_as_without(folder: str, parse: object) -> None:
    assert callable(parse)
    for param in fixture_files(folder):
        path = param.values[0]
        if path is None:
            pytest.skip(f"no {folder} fixtures")
        text = read_text(path).lstrip(BOM)
        assert parse(BOM + text) == parse(text), path.name


def test_bom_prefixed_loadavg_and_pid_stat_parse_as_without() -> None:
    assert parse_loadavg(BOM + "0.52 0.58 0.59 1/467 12345\n") == (0.52, 0.58, 0.59)
    assert parse_pid_stat(BOM + _pid_stat()) == parse_pid_stat(_pid_stat())


# --------------------------------------------------------------------------- fuzz

# One whitespace-free token each (the parsers split fields on whitespace and lines on line breaks).
_numbers = st.one_of(
    st.integers(min_value=0, max_value=2**64 - 1).map(str),
    st.sampled_from(BAD_NUMBERS),
    st.text(alphabet=st.characters(categories=["Nd", "No", "Pd"]), min_size=1, max_size=8),
    st.text(min_size=1, max_size=12),
).filter(lambda v: bool(v) and not any(c.isspace() for c in v))


def _is_count(value: str) -> bool:
    return re.fullmatch(r"[0-9]{1,20}", value) is not None


@settings(max_examples=examples(150), deadline=None)
@given(st.lists(_numbers, min_size=1, max_size=10), st.booleans())
def test_fuzzed_proc_stat_keeps_every_readable_field(values: list[str], bom: bool) -> None:
    text = (BOM if bom else "") + "cpu  " + " ".join(values) + "\ncpu0 1 2 3 4\nintr 5\n"
    times = parse_proc_stat(text)
    fields = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice")
    for name, value in zip(fields, values, strict=False):
        if _is_count(value):
            assert times.total[name] == int(value)
        else:
            assert name not in times.total
            assert any(f"cpu {name} " in w for w in times.warnings)
    assert times.per_cpu == 1


@settings(max_examples=examples(150), deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached"]), _numbers, min_size=1
    ),
    st.booleans(),
)
def test_fuzzed_meminfo_keeps_every_readable_field(values: dict[str, str], bom: bool) -> None:
    text = (BOM if bom else "") + "".join(f"{key}:  {value} kB\n" for key, value in values.items())
    info = parse_meminfo(text)
    got = {"MemTotal": info.total_bytes, "MemFree": info.free_bytes, "MemAvailable": info.available_bytes}
    for key, value in values.items():
        if _is_count(value):
            assert got.get(key, int(value) * 1024) == int(value) * 1024
        else:
            assert any(w.startswith(f"/proc/meminfo: {key} ") for w in info.warnings)


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(_numbers, min_size=0, max_size=6))
def test_fuzzed_cpuinfo_loadavg_and_pid_stat_never_raise(values: list[str]) -> None:
    padded = values + ["1"] * (4 - len(values))
    cpu = parse_cpuinfo(
        f"processor\t: {padded[0]}\nvendor_id\t: GenuineIntel\ncpu cores\t: {padded[1]}\nsiblings\t: {padded[2]}\n"
        "flags\t\t: fpu sse2 avx2 lm\n"
    )
    assert cpu.logical_cpus in (None, 1)
    parse_load_average(" ".join(values))
    parse_pid_stat(f"{padded[0]} (x) S 1 " + " ".join(padded * 12))


# --------------------------------------------------------------------------- the sampler


@pytest.mark.skipif(not fixtures_available(), reason="no captured fixtures")
def test_the_sampler_passes_a_bad_field_on_and_keeps_the_rest(tmp_path: Path) -> None:
    tools = build_host(HOSTS["cpu"], tmp_path)
    proc = tmp_path / "proc"
    (proc / "meminfo").write_text(_set_meminfo_value((proc / "meminfo").read_text(), "MemFree", "１２３"))
    (proc / "stat").write_text(_set_cpu_field((proc / "stat").read_text(), 0, "12e5"))
    (proc / "loadavg").write_text("0.52 - 0.59 1/467 12345\n")
    config = parse_config(
        {"server": "http://127.0.0.1:1", "state_dir": str(tmp_path / "state"), "root": str(tmp_path), "tools": tools}
    )
    sample = asyncio.run(Sampler(config).sample(force=True))
    assert sample["memory_total_bytes"] == 8144960 * 1024
    assert sample["memory_available_bytes"] == 4389516 * 1024
    assert sample["cpus"] == 9
    assert "load" not in sample  # the protocol takes all three averages or none
    warnings = sample["warnings"]
    assert any("MemFree" in w for w in warnings)
    assert any("cpu user" in w for w in warnings)
    assert any("5-minute load" in w for w in warnings)
    protocol.parse_message(protocol.encode("heartbeat", {"sample": sample}), expect="agent")
