"""Xid kernel log lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.xid import XidEvent, bus_id_to_xid_pci, count_xids, parse_xid_lines
from tests.budget import examples

FOLDER = "xid"


@pytest.mark.parametrize("path", fixture_files(FOLDER))
def test_xid_fixture_parses(path: Path) -> None:
    text = read_text(path)
    events = parse_xid_lines(text)
    assert len(events) == sum(1 for line in text.splitlines() if "NVRM: Xid" in line)
    for event in events:
        assert event.code > 0
        assert event.pci and event.pci.count(":") == 2
        assert event.text
        assert event.pid is None or event.pid > 0


def test_dbe_row_remap_contained_sequence() -> None:
    events = parse_xid_lines(fixture_text(FOLDER, "xid48-dbe-xid63-rowremap-xid94-contained.log.txt"))
    assert [e.code for e in events] == [48, 63] + [94] * 9
    dbe = events[0]
    assert dbe.pci == "0000:19:00"
    assert dbe.pid is None  # pid='<unknown>'
    assert dbe.process_name is None
    assert dbe.text.startswith("An uncorrectable double bit error (DBE)")
    assert dbe.prefix == "2024-11-15T12:02:03,470068+00:00"
    contained = events[3]
    assert (contained.pid, contained.process_name, contained.text) == (1248209, "python3.10", "Ch 00000008")
    assert count_xids(events) == {"0000:19:00": {48: 1, 63: 1, 94: 9}}


def test_gsp_timeout_with_multiline_noise() -> None:
    events = parse_xid_lines(fixture_text(FOLDER, "dmesg-with-xid-119.log.txt"))
    assert [e.code for e in events] == [119] * 5
    assert {e.pci for e in events} == {"0000:9b:00"}
    assert [e.pid for e in events] == [2024380, 2024380, 2024380, 1263500, 1240590]
    assert events[-1].process_name == "gpud"
    assert events[0].prefix == "[Sun Feb 23 16:24:18 2025]"
    assert "GSP_RM_ALLOC" in events[0].text
    assert count_xids(events) == {"0000:9b:00": {119: 5}}


def test_single_bare_line_with_short_pci() -> None:
    events = parse_xid_lines(fixture_text(FOLDER, "xid63-row-remapper-single-line.txt"))
    assert events == [
        XidEvent(
            code=63,
            pci="0000:10:1c",
            pid=1896,
            text="Row Remapper: New row marked for remapping, reset gpu to activate.",
            process_name=None,
            prefix=None,
        )
    ]


def test_other_line_forms() -> None:
    text = (
        "Jun  3 10:11:12 gpu01 kernel: [ 123.4] NVRM: Xid (PCI:0000:3B:00): 79, pid=0, GPU has fallen off the bus.\r\n"
        "kernel: NVRM: Xid (0000:01:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1): Out Of Range Address\n"
        "NVRM: Xid (PCI:0000:3b:00): 31, pid=4242, name=python, Ch 00000010, intr 10000000. MMU Fault\n"
        "NVRM: GPU at PCI:0000:3b:00: GPU-509665ad\n"
        "NVRM: Xid: malformed\n"
    )
    events = parse_xid_lines(text)
    assert [(e.code, e.pci, e.pid) for e in events] == [
        (79, "0000:3b:00", None),  # pid=0 is not a process
        (13, "0000:01:00", None),
        (31, "0000:3b:00", 4242),
    ]
    assert events[0].text == "GPU has fallen off the bus."
    assert events[1].text.startswith("Graphics SM Warp Exception on (GPC 0, TPC 1)")
    assert events[2].process_name == "python"
    assert count_xids(events) == {"0000:3b:00": {79: 1, 31: 1}, "0000:01:00": {13: 1}}


def test_count_without_address() -> None:
    assert count_xids([XidEvent(code=79, pci=None, pid=None, text="x")]) == {"unknown": {79: 1}}
    assert count_xids([]) == {}


@pytest.mark.parametrize(
    ("bus_id", "expected"),
    [("00000000:19:00.0", "0000:19:00"), ("00000000:9B:00.0", "0000:9b:00"), ("0000:3b:00", "0000:3b:00"), ("x", None)],
)
def test_bus_id_to_xid_pci(bus_id: str, expected: str | None) -> None:
    assert bus_id_to_xid_pci(bus_id) == expected


@settings(max_examples=examples(80), deadline=None)
@given(st.text(max_size=300))
def test_fuzzed_never_raises(text: str) -> None:
    events = parse_xid_lines("NVRM: Xid " + text)
    count_xids(events)
