"""MIG: nvidia-smi -L, mig -lgip/-lgipp/-lgi and the MIG devices of -q, on real captures, and the
devices a node offers from them (agent.devices)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text

from agent.devices import layout_changes, layout_of, nvidia_devices
from agent.probes.mig import (
    merge_mig_list,
    mig_share,
    parse_gpu_instances,
    parse_mig_list,
    parse_mig_placements,
    parse_mig_profiles,
    profile_memory_gb,
    slice_index,
    slice_parent,
)
from agent.probes.nvidia import parse_nvidia_smi_text, parse_nvidia_smi_xml

LIST = "nvidia-smi-mig-list"
PROFILES = "nvidia-smi-mig-profiles"
QMIG = "nvidia-smi-q-mig"
H100_Q = ("nvidia-smi-q-mig", "q-h100-80gb-hbm3-mig-4dev-drv590-load-masked.txt")
H100_L = (LIST, "L-h100-80gb-hbm3-4mig-3g40-2g20-1g10x2-drv590-masked.txt")
H200_Q = ("nvidia-smi-q", "h200-mig-enabled-drv590-load-masked.txt")
H200_L = (LIST, "L-h200-5mig-1c3g71-2c3g71-2g35-1g18x2-drv590-masked.txt")


@pytest.mark.parametrize("path", fixture_files(LIST))
def test_every_mig_listing_names_its_card_and_each_mig_device(path: Path) -> None:
    listing = parse_mig_list(read_text(path))
    assert listing.warnings == [] and listing.orphans == []
    assert len(listing.gpus) == 1
    gpu = listing.gpus[0]
    assert gpu.uuid and gpu.uuid.startswith("GPU-") and gpu.name and gpu.name.startswith("NVIDIA")
    assert gpu.migs and [m.index for m in gpu.migs] == list(range(len(gpu.migs)))
    for item in gpu.migs:
        assert item.uuid.startswith("MIG-")
        assert profile_memory_gb(item.profile) is not None


@pytest.mark.parametrize("path", fixture_files(PROFILES))
def test_every_mig_table_gives_its_rows(path: Path) -> None:
    text = read_text(path)
    rows = text.count("MIG ") if not path.name.startswith("lgipp") else len(text.strip().splitlines())
    if path.name.startswith("lgipp"):
        placements = parse_mig_placements(text)
        assert len(placements) == rows and all(p.starts and p.size >= 1 for p in placements)
    elif path.name.startswith("lgip"):
        profiles = parse_mig_profiles(text)
        assert len(profiles) == rows
        assert all(p.memory_gib and p.total and p.free is not None and p.free <= p.total for p in profiles)
    else:
        instances = parse_gpu_instances(text)
        assert len(instances) == rows and all(i.instance_id and i.size for i in instances)


@pytest.mark.parametrize("path", fixture_files(QMIG))
def test_every_mig_q_report_describes_its_mig_devices(path: Path) -> None:
    report = parse_nvidia_smi_text(read_text(path))
    gpu = report.gpus[0]
    assert gpu.mig_mode == "Enabled" and gpu.mig_pending == "Enabled"
    assert gpu.mig_devices and [d.index for d in gpu.mig_devices] == list(range(len(gpu.mig_devices)))
    for device in gpu.mig_devices:
        assert device.gpu_instance_id is not None and device.compute_instance_id is not None
        assert device.memory_total_mib and device.memory_used_mib is not None


def test_h100_profiles_table_reads_each_profile_and_the_three_digit_sm_row() -> None:
    profiles = parse_mig_profiles(fixture_text(PROFILES, "lgip-h100-nvl-94gb-azure-nc40ads-7-profiles.txt"))
    assert [(p.name, p.profile_id, p.free, p.total) for p in profiles][:2] == [
        ("1g.12gb", 19, 7, 7),
        ("1g.12gb+me", 20, 1, 1),
    ]
    assert (profiles[-1].name, profiles[-1].multiprocessors, profiles[-1].memory_gib) == ("7g.94gb", 132, 93.12)
    placements = parse_mig_placements(fixture_text(PROFILES, "lgipp-h100-nvl-94gb-azure-nc40ads-placements.txt"))
    assert (placements[0].starts, placements[0].size) == ([0, 1, 2, 3, 4, 5, 6], 1)
    assert (placements[-1].profile_id, placements[-1].starts, placements[-1].size) == (0, [0], 8)


def test_h100_q_joined_to_its_listing_gives_each_slice_its_profile_uuid_memory_and_share() -> None:
    report = parse_nvidia_smi_text(fixture_text(*H100_Q))
    listing = parse_mig_list(fixture_text(*H100_L))
    assert merge_mig_list(report, listing) == {}
    devices, warnings = nvidia_devices(report, listing)
    assert warnings == []
    card, *slices = devices
    assert (card["index"], card["kind"], card["split"], card["gpu_class"]) == (0, "gpu", True, "H100-80GB")
    assert [s["index"] for s in slices] == [1000, 1001, 1002, 1003]
    assert [s["gpu_class"] for s in slices] == [
        "H100-80GB-3g.40gb",
        "H100-80GB-2g.20gb",
        "H100-80GB-1g.10gb",
        "H100-80GB-1g.10gb",
    ]
    third = slices[2]
    assert third["device_id"] == "MIG-00000002-0000-0000-0000-000000000002" and third["parent"] == 0
    assert third["memory_total_mib"] == 9984 and third["share"] == pytest.approx(1 / 7)
    # The load's three processes run in GPU instance 2: the 3g.40gb slice.
    assert [len(s["process_pids"]) for s in slices] == [3, 0, 0, 0]
    assert "fault" not in third


def test_h200_compute_instances_of_one_gpu_instance_share_its_memory() -> None:
    report = parse_nvidia_smi_text(fixture_text(*H200_Q))
    devices, warnings = nvidia_devices(report, parse_mig_list(fixture_text(*H200_L)))
    assert warnings == []
    slices = devices[1:]
    assert [s["profile"] for s in slices] == ["1c.3g.71gb", "2c.3g.71gb", "2g.35gb", "1g.18gb", "1g.18gb"]
    assert slices[0]["memory_group"] == slices[1]["memory_group"] == "0:gi2"
    assert len({s["memory_group"] for s in slices}) == 4
    assert [round(s["share"] * 7) for s in slices] == [1, 2, 2, 1, 1]
    assert slices[0]["gpu_class"] == "H200-141GB-1c.3g.71gb"


def test_xml_mig_devices_are_read_too() -> None:
    report = parse_nvidia_smi_xml(
        fixture_text("nvidia-smi-q-xml", "a100-sxm4-40gb-mig-2-instances-passthrough-drv510.xml")
    )
    gpu = report.gpus[0]
    assert gpu.mig_pending == "Enabled"
    assert [(d.gpu_instance_id, d.memory_total_mib) for d in gpu.mig_devices or []] == [(1, 19968), (2, 19968)]
    devices, warnings = nvidia_devices(report, None)
    assert "UUIDs are unknown" in devices[0]["fault"] and all("fault" in d for d in devices)
    assert warnings


# --------------------------------------------------------------------------- what cannot be trusted


def _h100(text_edit: tuple[str, str] | None = None, listing_edit: tuple[str, str] | None = None) -> tuple:
    q = fixture_text(*H100_Q)
    listing = fixture_text(*H100_L)
    if text_edit:
        q = q.replace(*text_edit)
    if listing_edit:
        listing = listing.replace(*listing_edit)
    return parse_nvidia_smi_text(q), parse_mig_list(listing)


def test_mig_enabled_with_no_mig_device_offers_nothing_and_says_why() -> None:
    report, listing = _h100()
    report.gpus[0].mig_devices = None
    devices, warnings = nvidia_devices(report, parse_mig_list(fixture_text(*H100_L).split("\n")[0]))
    assert len(devices) == 1 and devices[0]["split"] is True
    assert "no MIG device is set up" in devices[0]["fault"] and warnings


def test_a_listing_and_a_report_that_disagree_make_every_slice_of_the_card_untrusted() -> None:
    report, listing = _h100()
    listing.gpus[0].migs.pop()
    devices, warnings = nvidia_devices(report, listing)
    assert all("lists 3 MIG device(s) on GPU 0, -q describes 4" in d["fault"] for d in devices)
    report, listing = _h100(listing_edit=("MIG 1g.10gb     Device  3", "MIG 3g.40gb     Device  3"))
    devices, _ = nvidia_devices(report, listing)
    assert "is 3g.40gb by nvidia-smi -L but has 9984 MiB by -q" in devices[-1]["fault"]


def test_a_mig_device_whose_card_is_missing_is_not_offered() -> None:
    report, listing = _h100()
    listing.gpus[0].index = 5
    devices, warnings = nvidia_devices(report, listing)
    assert any("GPU 5, which nvidia-smi -q does not describe" in w for w in warnings)
    assert all(d.get("parent") in (None, 0) for d in devices)
    assert "does not list GPU 0" in devices[0]["fault"]


def test_a_pending_mode_change_is_shown_and_not_acted_on() -> None:
    report, listing = _h100(
        text_edit=(
            "        Pending                                        : Enabled",
            "        Pending                                        : Disabled",
        )
    )
    devices, _ = nvidia_devices(report, listing)
    assert "changes to Disabled at the next GPU reset" in devices[0]["fault"]
    assert len(devices) == 5  # the slices still exist until the reset, shown with the reason


def test_a_changed_layout_is_named_per_card() -> None:
    before, _ = nvidia_devices(*_h100())
    report, listing = _h100()
    report.gpus[0].mig_devices.pop()  # type: ignore[union-attr]
    listing.gpus[0].migs.pop()
    after, _ = nvidia_devices(report, listing)
    changes = layout_changes(layout_of(before), layout_of(after))
    assert list(changes) == [0] and "4 slices then, 3 now" in changes[0]
    assert layout_changes(layout_of(before), layout_of(before)) == {}


def test_slice_indices_name_their_card_and_shares_follow_the_profile() -> None:
    assert slice_index(0, 2) == 1002 and slice_index(3, 6) == 1306 and slice_parent(1306) == 3
    assert slice_parent(7) is None and slice_index(256, 0) is None and slice_index(0, 64) is None
    assert mig_share("1g.10gb", 7) == pytest.approx(1 / 7) and mig_share("2c.3g.71gb", 7) == pytest.approx(2 / 7)
    assert mig_share("4g.24gb", 4) == 1.0 and mig_share("8g.1gb", 7) is None and mig_share("weird", 7) is None
