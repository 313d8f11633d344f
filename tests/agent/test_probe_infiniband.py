"""InfiniBand/RoCE ports from sysfs, sminfo, saquery SMIR and perftest output."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.infiniband import (
    IbPort,
    RoceGid,
    SmRecord,
    counter_saturated,
    describe_state,
    expected_rate_mismatch,
    fabric_identity,
    master_sm,
    normalise_guid,
    parse_ip_addr_json,
    parse_perftest,
    parse_saquery_smir,
    parse_sminfo,
    port_is_up,
    read_ports,
    roce_network,
    roce_port_network,
    select_roce_gid,
)
from agent.probes.sysfs import SysfsReader
from tests.budget import examples

SYSFS = "sysfs-infiniband"
PERFTEST = "perftest"
INIT_FILE = "dgx-a100-cx6-hdr-two-ports-2-INIT-ipoib-down.json.txt"
EDR_FILE = "dgx-a100-cx6-ports-at-100-edr-instead-of-hdr.json.txt"
DGX_DEVICES = ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_9"]


def sysfs_tree(name: str) -> dict[str, str]:
    return json.loads(fixture_text(SYSFS, name))


# --------------------------------------------------------------------------- sysfs fixtures


@pytest.mark.parametrize("path", fixture_files(SYSFS))
def test_sysfs_fixture_reads_every_port(path: Path) -> None:
    tree = json.loads(read_text(path))
    expected_ports = {k.rsplit("/ports/", 1)[0] for k in tree if "/infiniband/" in k and "/ports/" in k}
    report = read_ports(SysfsReader(tree))
    assert len(report.ports) == len(expected_ports) > 0
    for port in report.ports:
        assert port.device.startswith("mlx5_")
        assert port.port == 1
        assert port.link_layer == "InfiniBand"
        assert port.state in (2, 4) and port.phys_state == 5
        assert port.rate_gbps in (100.0, 200.0) and port.width == 4
        # upstream masked lid/sm_lid/node_guid with placeholder words: unknown, not zero
        assert port.lid is None and port.sm_lid is None and port.node_guid is None
        assert port.lmc == 0
        assert port.netdev is not None and port.netdev.startswith("ib")
    assert any("lid: not a 0x-prefixed hex number: 'lid'" in w for w in report.warnings)


def test_two_hdr_ports_stuck_in_init_without_sm() -> None:
    report = read_ports(SysfsReader(sysfs_tree(INIT_FILE)))
    ports = report.ports
    assert [p.device for p in ports] == DGX_DEVICES
    assert {p.device: (p.state, p.state_name, p.phys_state, p.phys_state_name) for p in ports} == {
        d: (2, "INIT", 5, "LinkUp") if d in ("mlx5_6", "mlx5_8") else (4, "ACTIVE", 5, "LinkUp") for d in DGX_DEVICES
    }
    assert [p.device for p in ports if not port_is_up(p)] == ["mlx5_6", "mlx5_8"]
    assert {(p.rate_gbps, p.rate_text, p.width, p.speed) for p in ports} == {(200.0, "200 Gb/sec (4X HDR)", 4, "HDR")}
    stuck = {p.device: p for p in ports}["mlx5_8"]
    assert (stuck.netdev, stuck.netdev_operstate) == ("ib6", "down")
    assert stuck.fw_ver == "20.31.2354"
    assert stuck.node_desc == "node1661 HCA-11"
    assert describe_state(stuck) == (
        "mlx5_8/1: INIT (2), LinkUp (5), 200 Gb/sec (4X HDR): "
        "link is up but the port was not activated; is a subnet manager running?"
    )
    assert {p.netdev_operstate for p in ports if port_is_up(p)} == {"up"}
    assert expected_rate_mismatch(ports) == []
    assert "mlx5_0 node_guid: unparsable 'node_guid'" in report.warnings
    assert len(report.warnings) == 3 * len(DGX_DEVICES)  # node_guid, lid, sm_lid placeholders


def test_every_port_downshifted_to_edr() -> None:
    report = read_ports(SysfsReader(sysfs_tree(EDR_FILE)))
    ports = report.ports
    assert [p.device for p in ports] == DGX_DEVICES
    assert all(port_is_up(p) for p in ports)
    assert {(p.rate_gbps, p.speed) for p in ports} == {(100.0, "EDR")}
    # all eight agree with each other, so only the fleet's expected rate exposes the downshift
    assert expected_rate_mismatch(ports) == []
    flagged = expected_rate_mismatch(ports, 200.0)
    assert [(p.device, rate, ref) for p, rate, ref in flagged] == [(d, 100.0, 200.0) for d in DGX_DEVICES]
    assert len(expected_rate_mismatch(ports, {"InfiniBand": 200.0})) == 8
    assert expected_rate_mismatch(ports, {"Ethernet": 200.0}) == []
    assert all(p.fw_ver is None for p in ports)  # masked as the word "fw_ver"
    assert "mlx5_0 fw_ver: not a version: 'fw_ver'" in report.warnings


def test_one_downshifted_port_stands_out_against_the_others() -> None:
    tree = sysfs_tree(INIT_FILE)
    tree["/sys/bus/pci/devices/0000:0c:00.0/infiniband/mlx5_0/ports/1/rate"] = "100 Gb/sec (4X EDR)\n"
    tree["/sys/bus/pci/devices/0000:8d:00.0/infiniband/mlx5_6/ports/1/rate"] = "50 Gb/sec (2X EDR)\n"  # INIT: ignored
    flagged = expected_rate_mismatch(read_ports(SysfsReader(tree)).ports)
    assert [(p.device, rate, ref) for p, rate, ref in flagged] == [("mlx5_0", 100.0, 200.0)]


def test_tree_keys_relative_absolute_and_duplicated() -> None:
    port = {"state": "4: ACTIVE\n", "phys_state": "5: LinkUp\n", "rate": "10 Gb/sec (4X)\n", "link_layer": "InfiniBand"}
    port |= {"lid": "0x1f\n", "sm_lid": "0x1\n", "lid_mask_count": "0\n"}
    relative = {f"mlx5_0/ports/1/{k}": v for k, v in port.items()} | {"mlx5_0/node_guid": "b859:9f03:00a1:b2c2\n"}
    report = read_ports(relative)
    assert [(p.device, p.lid, p.sm_lid, p.node_guid) for p in report.ports] == [("mlx5_0", 31, 1, "0xb8599f0300a1b2c2")]
    old_kernel = report.ports[0]
    assert (old_kernel.rate_gbps, old_kernel.width, old_kernel.speed) == (10.0, 4, None)  # an HDR link on an old kernel
    assert report.warnings == []
    both = {f"/sys/class/infiniband/mlx5_0/ports/1/{k}": v for k, v in port.items()}
    both |= {f"/sys/devices/pci0000:00/0000:3b:00.0/infiniband/mlx5_0/ports/1/{k}": v for k, v in port.items()}
    assert [(p.device, p.port) for p in read_ports(both).ports] == [("mlx5_0", 1)]
    assert read_ports({}).ports == []


def test_state_and_rate_forms() -> None:
    port = {"state": "ACTIVE", "phys_state": "2: Polling", "rate": "2.5 Gb/sec (1X SDR)", "link_layer": "InfiniBand"}
    port |= {"lid": "0x0", "sm_lid": "0x0", "lid_mask_count": "0"}
    p = read_ports({f"sys/class/infiniband/qib0/ports/2/{k}": v for k, v in port.items()}).ports[0]
    assert (p.device, p.port, p.state, p.state_name, p.phys_state_name) == ("qib0", 2, 4, "ACTIVE", "Polling")
    assert (p.rate_gbps, p.width, p.speed) == (2.5, 1, "SDR")
    assert not port_is_up(p)
    assert describe_state(p).endswith(
        "Polling (2), 2.5 Gb/sec (1X SDR): no link: no cable, peer down or wrong speed (Polling)"
    )


def test_unknown_is_none_with_a_warning() -> None:
    tree = {"x/mlx5_3/ports/1/state": "garbage", "x/mlx5_3/ports/1/rate": "fast", "x/mlx5_3/ports/1/lid": "31"}
    report = read_ports(tree)
    (p,) = report.ports
    assert (p.state, p.rate_gbps, p.rate_text, p.lid, p.link_layer, p.phys_state) == (
        None,
        None,
        "fast",
        None,
        None,
        None,
    )
    assert "mlx5_3 port 1 state: unparsable 'garbage'" in report.warnings
    assert "mlx5_3 port 1 lid: not a 0x-prefixed hex number: '31'" in report.warnings
    assert "mlx5_3 port 1 phys_state: missing or unreadable" in report.warnings
    assert describe_state(p) == "mlx5_3/1: state unknown, phys unknown, fast"


# --------------------------------------------------------------------------- a real sysfs tree


def _write(root: Path, rel: str, content: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content + "\n")


def _unreadable(root: Path, rel: str) -> None:
    """A path whose open() fails even for root (a directory), as an empty GID slot's attrs do."""
    (root / rel).mkdir(parents=True, exist_ok=True)


def _make_sysfs(root: Path) -> None:
    fn0 = "sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0"
    fn1 = "sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.1"
    (root / "sys/class/infiniband").mkdir(parents=True)
    for fn, dev in ((fn0, "mlx5_0"), (fn1, "mlx5_1")):
        (root / fn / "infiniband" / dev).mkdir(parents=True)
        os.symlink(f"../../../{fn.rsplit('/', 1)[1]}", root / fn / "infiniband" / dev / "device")
        os.symlink(f"../../{fn.removeprefix('sys/')}/infiniband/{dev}", root / "sys/class/infiniband" / dev)
    ib = f"{fn0}/infiniband/mlx5_0"
    _write(root, f"{ib}/node_guid", "b859:9f03:00a1:b2c2")
    _write(root, f"{ib}/fw_ver", "28.39.1002")
    p = f"{ib}/ports/1"
    for name, value in {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "400 Gb/sec (4X NDR)",
        "link_layer": "InfiniBand",
        "lid": "0x1f",
        "sm_lid": "0x1",
        "lid_mask_count": "0",
        "gids/0": "fe80:0000:0000:0000:b859:9f03:00a1:b2c3",
        "gids/1": "0000:0000:0000:0000:0000:0000:0000:0000",
        "counters/port_xmit_data": "1000",
        "counters/port_rcv_data": "4294967295",
        "counters/symbol_error": "65535",
        "counters/link_downed": "3",
        "counters/port_rcv_errors": "N/A (no PMA)",
        "counters/VL15_dropped": "garbage",
        "hw_counters/out_of_buffer": "7",
        "hw_counters/rx_write_requests": "18446744073709551615",
    }.items():
        _write(root, f"{p}/{name}", value)
    _write(root, f"{fn0}/net/ib0/dev_port", "0")
    _write(root, f"{fn0}/net/ib0/operstate", "up")

    roce = f"{fn1}/infiniband/mlx5_1"
    _write(root, f"{roce}/node_guid", "b859:9f03:00a1:b2c4")
    r = f"{roce}/ports/1"
    for name, value in {
        "state": "4: ACTIVE",
        "phys_state": "5: LinkUp",
        "rate": "100 Gb/sec (4X EDR)",
        "link_layer": "Ethernet",
        "lid": "0x0",
        "sm_lid": "0x0",
        "lid_mask_count": "0",
    }.items():
        _write(root, f"{r}/{name}", value)
    gids = [
        ("fe80:0000:0000:0000:ba59:9fff:fea1:b2c4", "IB/RoCE v1", "ens1f1np1"),
        ("fe80:0000:0000:0000:ba59:9fff:fea1:b2c4", "RoCE v2", "ens1f1np1"),
        ("0000:0000:0000:0000:0000:ffff:c0a8:140b", "IB/RoCE v1", "ens1f1np1"),
        ("0000:0000:0000:0000:0000:ffff:c0a8:140b", "RoCE v2", "ens1f1np1"),
        ("2001:0db8:0020:0000:0000:0000:0000:0011", "RoCE v2", "ens1f1np1"),
    ]
    for i, (gid, kind, ndev) in enumerate(gids):
        _write(root, f"{r}/gids/{i}", gid)
        _write(root, f"{r}/gid_attrs/types/{i}", kind)
        _write(root, f"{r}/gid_attrs/ndevs/{i}", ndev)
    _write(root, f"{r}/gids/5", "0000:0000:0000:0000:0000:0000:0000:0000")  # empty slot
    _unreadable(root, f"{r}/gid_attrs/types/5")
    _unreadable(root, f"{r}/gid_attrs/ndevs/5")
    _write(root, f"{r}/gids/6", "0000:0000:0000:0000:0000:ffff:0a01:0005")  # populated, attrs unreadable
    _unreadable(root, f"{r}/gid_attrs/types/6")
    _write(root, f"{r}/gids/7", "0000:0000:0000:0000:0000:0000:0000:0000")
    _write(root, f"{fn1}/net/ens1f1np1/dev_port", "0")
    _write(root, f"{fn1}/net/ens1f1np1/operstate", "up")


def test_real_directory_tree(tmp_path: Path) -> None:
    _make_sysfs(tmp_path)
    report = read_ports(SysfsReader(str(tmp_path)))
    assert report.warnings == [
        "mlx5_0 port 1 counters/VL15_dropped: unparsable 'garbage'",
        "mlx5_1 port 1 gid 6: gid_attrs/types unreadable for a non-empty GID",
    ]
    ib, roce = report.ports
    assert (ib.device, ib.port, ib.link_layer, ib.rate_gbps, ib.speed) == ("mlx5_0", 1, "InfiniBand", 400.0, "NDR")
    assert (ib.lid, ib.sm_lid, ib.lmc) == (31, 1, 0)
    assert ib.node_guid == "0xb8599f0300a1b2c2"
    assert ib.port_guid == "0xb8599f0300a1b2c3"
    assert ib.fw_ver == "28.39.1002"
    assert (ib.netdev, ib.netdev_operstate) == ("ib0", "up")
    assert ib.counters == {
        "port_xmit_data": 1000,
        "port_rcv_data": 4294967295,
        "symbol_error": 65535,
        "link_downed": 3,
        "hw_out_of_buffer": 7,
        "hw_rx_write_requests": 2**64 - 1,
    }
    assert (ib.xmit_bytes, ib.rcv_bytes) == (4000, 4 * 4294967295)
    assert sorted(ib.saturated) == ["port_rcv_data", "symbol_error"]  # hw_ counters have no known width
    assert sorted(ib.unreadable_counters) == ["VL15_dropped", "port_rcv_errors"]
    assert ib.roce_gids == [] and ib.roce_ip is None

    assert roce.link_layer == "Ethernet" and roce.port_guid is None
    assert [(g.index, g.version, g.ip, g.family) for g in roce.roce_gids] == [
        (0, 1, None, None),
        (1, 2, None, None),
        (2, 1, "192.168.20.11", 4),
        (3, 2, "192.168.20.11", 4),
        (4, 2, "2001:db8:20::11", 6),
        (6, None, "10.1.0.5", 4),
    ]
    assert (roce.roce_gid_index, roce.roce_ip, roce.netdev) == (3, "192.168.20.11", "ens1f1np1")
    assert roce.roce_gid == "0000:0000:0000:0000:0000:ffff:c0a8:140b"
    assert roce.netdev_operstate == "up"
    assert select_roce_gid(roce.roce_gids, family=6) == roce.roce_gids[4]
    assert select_roce_gid(roce.roce_gids, version=1, family=None) == roce.roce_gids[2]
    assert [p.device for p in read_ports(str(tmp_path)).ports] == ["mlx5_0", "mlx5_1"]
    assert read_ports(str(tmp_path / "nowhere")).ports == []


def test_roce_port_with_only_link_local_and_ipv6_selects_nothing() -> None:
    base = "sys/class/infiniband/mlx5_2/ports/1"
    tree = {f"{base}/link_layer": "Ethernet", f"{base}/gids/0": "fe80:0000:0000:0000:0000:0000:0000:0001"}
    tree |= {f"{base}/gid_attrs/types/0": "RoCE v2", f"{base}/gids/1": "2001:0db8:0000:0000:0000:0000:0000:0001"}
    tree |= {f"{base}/gid_attrs/types/1": "RoCE v2", f"{base}/gid_attrs/ndevs/1": "eth2"}
    (p,) = read_ports(tree).ports
    assert [g.ip for g in p.roce_gids] == [None, "2001:db8::1"]
    assert p.roce_gid_index is None and p.roce_ip is None  # NCCL's AF_INET default finds no GID


# --------------------------------------------------------------------------- counters, GUIDs, IPs


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("symbol_error", 65535, True),
        ("symbol_error", 65534, False),
        ("link_downed", 255, True),
        ("local_link_integrity_errors", 15, True),
        ("port_xmit_data", 2**32 - 1, True),
        ("port_xmit_data", 2**32, False),  # past 32 bits: the 64-bit extended set
        ("port_rcv_packets", 2**64 - 1, True),
        ("port_xmit_wait", 2**32 - 1, True),
        ("rx_write_requests", 2**64 - 1, False),
    ],
)
def test_counter_saturated(name: str, value: int, expected: bool) -> None:
    assert counter_saturated(name, value) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("b859:9f03:00a1:b2c2", "0xb8599f0300a1b2c2"),
        ("0x2c903000a1b2", "0x00002c903000a1b2"),
        ("0XB8599F0300A1B2C2", "0xb8599f0300a1b2c2"),
        ("node_guid", None),
        ("0x1234567890abcdef0", None),
        (None, None),
    ],
)
def test_normalise_guid(text: str | None, expected: str | None) -> None:
    assert normalise_guid(text) == expected


IP_JSON = json.dumps(
    [
        {"ifindex": 1, "ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1", "prefixlen": 8}]},
        {
            "ifindex": 4,
            "ifname": "ens1f1np1",
            "operstate": "UP",
            "addr_info": [
                {"family": "inet", "local": "192.168.20.11", "prefixlen": 22, "scope": "global"},
                {"family": "inet6", "local": "fe80::ba59:9fff:fea1:b2c4", "prefixlen": 64, "scope": "link"},
                {"family": "inet", "local": "not-an-ip", "prefixlen": 24},
                {"family": "inet", "local": "10.0.0.1", "prefixlen": True},
            ],
        },
        {},
        {"ifindex": 5, "ifname": "ens2"},
    ]
)


def test_ip_addr_json_and_roce_network() -> None:
    addrs = parse_ip_addr_json("\ufeff" + IP_JSON)
    assert addrs == {
        "lo": [("127.0.0.1", 8)],
        "ens1f1np1": [("192.168.20.11", 22), ("fe80::ba59:9fff:fea1:b2c4", 64)],
        "ens2": [],
    }
    assert roce_network("192.168.20.11", 22) == "192.168.20.0/22"
    assert roce_network("10.0.0.7", 24) == "10.0.0.0/24"
    assert roce_network("2001:db8:20::11", 64) == "2001:db8:20::/64"
    assert roce_network("10.0.0.7", 33) is None
    assert roce_network("nonsense", 24) is None
    port = IbPort(device="mlx5_1", port=1, roce_ip="192.168.20.11", netdev="ens1f1np1")
    assert roce_port_network(port, addrs) == "192.168.20.0/22"
    assert roce_port_network(IbPort(device="mlx5_0", port=1), addrs) is None
    for bad in ("", "not json", "{}", "[1, 2]", '[{"ifname": 3}]', "[" * 5000):
        assert isinstance(parse_ip_addr_json(bad), dict)


# --------------------------------------------------------------------------- sminfo


def sminfo_line(lid: int, guid: int, act: int, prio: int, state: int) -> str:
    """``printf("sminfo: sm lid %d sm guid 0x%" PRIx64 ", activity count %u priority %d state %d %s\\n")``."""
    names = ["SMINFO_NOTACT", "SMINFO_DISCOVER", "SMINFO_STANDBY", "SMINFO_MASTER"]
    name = names[state] if state < len(names) else "???"
    return f"sminfo: sm lid {lid} sm guid 0x{guid:x}, activity count {act} priority {prio} state {state} {name}\n"


def test_sminfo_master() -> None:
    info = parse_sminfo(sminfo_line(1, 0x2C903000A1B2, 4711, 14, 3))
    assert info is not None
    assert (info.lid, info.guid, info.activity_count, info.priority) == (1, "0x00002c903000a1b2", 4711, 14)
    assert (info.state, info.state_name, info.error) == (3, "SMINFO_MASTER", None)
    out_of_range = parse_sminfo(sminfo_line(7, 1, 0, 0, 5))
    assert out_of_range is not None and (out_of_range.state, out_of_range.state_name) == (5, None)


@pytest.mark.parametrize(
    "text", ["sminfo: iberror: failed: query\n", "sminfo: iberror: [pid 4242] main: failed: query\r\n"]
)
def test_sminfo_without_sm_gives_the_reason(text: str) -> None:
    info = parse_sminfo("ibwarn: [4242] _do_madrpc: recv failed: Connection timed out\n" + text)
    assert info is not None
    assert info.error == "query"
    assert info.lid is None and info.state is None


@pytest.mark.parametrize("text", ["", "garbage", "sminfo: sm lid x sm guid 0x1", "\x00\ufeff", "state 3"])
def test_sminfo_garbage_is_none(text: str) -> None:
    assert parse_sminfo(text) is None


@settings(max_examples=examples(60), deadline=None)
@given(
    st.integers(0, 0xBFFF),
    st.integers(0, 2**64 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(0, 15),
    st.integers(0, 3),
)
def test_sminfo_round_trip(lid: int, guid: int, act: int, prio: int, state: int) -> None:
    info = parse_sminfo(sminfo_line(lid, guid, act, prio, state))
    assert info is not None
    assert (info.lid, info.guid, info.activity_count, info.priority, info.state) == (
        lid,
        f"0x{guid:016x}",
        act,
        prio,
        state,
    )


MASTER_LINE = sminfo_line(1, 0x248A0703005A52B2, 170277, 15, 3)
MASTER = (1, "0x248a0703005a52b2", 170277, 15, 3, "SMINFO_MASTER")


def figures(info: Any) -> tuple[Any, ...]:
    return (info.lid, info.guid, info.activity_count, info.priority, info.state, info.state_name)


def test_sminfo_wrapped_anywhere_by_a_terminal_reads_as_one_line() -> None:
    line = MASTER_LINE.rstrip("\n")
    start = len("sminfo: sm lid 1")
    for cut in range(start, len(line)):
        for newline in ("\n", "\r\n"):
            wrapped = parse_sminfo(line[:cut] + newline + line[cut:] + newline)
            assert wrapped is not None and figures(wrapped) == MASTER, cut
            assert wrapped.warnings == []
        if line[cut] == " ":  # fold -s: the space becomes the line break
            folded = parse_sminfo(line[:cut] + "\n" + line[cut + 1 :] + "\n")
            assert folded is not None and figures(folded) == MASTER, cut
    # Over three lines, the continuation indented, with a tool's message after it.
    three = (
        "sminfo: sm lid 1 sm guid 0x248a0703005a52b2,\n   activity count 170277\n  priority 15 state 3 SMINFO_MASTER\n"
    )
    info = parse_sminfo(three + "ibwarn: [12] mad_rpc: _do_madrpc failed; dport (DR path slid 0; dlid 0; 0)\n")
    assert info is not None and figures(info) == MASTER and info.warnings == []


@pytest.mark.parametrize("guid", ["0xXXXXXXXXXXXXXXXX", "0x248a07…52b2", "0x248a07...52b2", "<masked>", "********"])
def test_sminfo_with_a_masked_or_shortened_guid_gives_the_rest_and_says_the_guid_is_unknown(guid: str) -> None:
    info = parse_sminfo(MASTER_LINE.replace("0x248a0703005a52b2", guid))
    assert info is not None
    assert figures(info) == (1, None, 170277, 15, 3, "SMINFO_MASTER")
    assert info.error is None
    assert len(info.warnings) == 1 and "masked or cut short" in info.warnings[0] and guid[:6] in info.warnings[0]


def test_sminfo_cut_short_says_what_it_did_not_give() -> None:
    info = parse_sminfo("sminfo: sm lid 7 sm guid 0x2c903000a1b2, activity cou")
    assert info is not None
    assert figures(info) == (7, "0x00002c903000a1b2", None, None, None, None)
    assert info.warnings == [
        "sminfo did not give the subnet manager's activity count",
        "sminfo did not give the subnet manager's priority",
        "sminfo did not give the subnet manager's state",
    ]
    bare = parse_sminfo("sminfo: sm lid 7\n")
    assert bare is not None and bare.lid == 7 and "sminfo did not give the subnet manager's GUID" in bare.warnings


# --------------------------------------------------------------------------- saquery SMIR


def smir_block(lid: int, guid: int, key: int, act: int, prio: int, state: int) -> str:
    """``dump_sm_info_record`` in rdma-core saquery.c."""
    return (
        "SMInfoRecord dump:\n"
        "\t\tRID\n"
        f"\t\tLID...................{lid}\n"
        "\t\tSMInfo dump:\n"
        f"\t\tGUID..................0x{guid:016x}\n"
        f"\t\tSM_Key................0x{key:016x}\n"
        f"\t\tActCount..............{act}\n"
        f"\t\tPriority..............{prio}\n"
        f"\t\tSMState...............{state}\n"
    )


def test_saquery_smir_two_sms() -> None:
    text = smir_block(1, 0x0002C9030010B250, 0, 123456, 15, 3) + smir_block(12, 0x0002C9030010D840, 0, 98, 13, 2)
    records = parse_saquery_smir(text)
    assert records == [
        SmRecord("0x0002c9030010b250", 1, "0x0000000000000000", 123456, 15, 3, "SMINFO_MASTER"),
        SmRecord("0x0002c9030010d840", 12, "0x0000000000000000", 98, 13, 2, "SMINFO_STANDBY"),
    ]
    assert fabric_identity(records) == "0x0002c9030010b250"
    assert fabric_identity(reversed(records)) == "0x0002c9030010b250"
    assert master_sm(records) == records[0]
    assert parse_saquery_smir(text.replace("\n", "\r\n")) == records
    assert parse_saquery_smir(text.replace("......", ".").replace("\t\t", "  ")) == records


def test_saquery_smir_truncated_and_invented_forms() -> None:
    text = smir_block(1, 0x10, 0, 5, 1, 3)
    truncated = (
        text
        + "SMInfoRecord dump:\n\t\tRID\n\t\tLID...................7\n\t\tSMInfo dump:\n"
        + "\t\tGUID.......0x0000000000000009\n\t\tSM_K"
    )
    records = parse_saquery_smir(truncated)
    assert [(r.guid, r.lid, r.state) for r in records] == [
        ("0x0000000000000010", 1, 3),
        ("0x0000000000000009", 7, None),
    ]
    assert fabric_identity(records) == "0x0000000000000009"
    invented = (
        "SMInfoRecord dump:\n    SM_GUID..... 0x0002c9030010b250\n    Priority.... 15\n    SMState..... MASTER (3)\n"
    )
    (record,) = parse_saquery_smir(invented)
    assert (record.guid, record.priority, record.state, record.lid) == ("0x0002c9030010b250", 15, 3, None)
    assert parse_saquery_smir("SMInfoRecord dump:\n\t\tLID....1\n") == []  # no GUID: nothing to identify
    assert parse_saquery_smir("saquery: iberror: failed: Query SA failed") == []
    assert fabric_identity([]) is None


@settings(max_examples=examples(60), deadline=None)
@given(st.text(max_size=400))
def test_sminfo_and_saquery_fuzzed_never_raise(text: str) -> None:
    parse_sminfo("sminfo: sm lid " + text)
    parse_sminfo(text)
    records = parse_saquery_smir("SMInfoRecord dump:\n\t\tGUID..0x1\n" + text)
    assert records and records[0].guid == "0x0000000000000001"
    fabric_identity(records)


# --------------------------------------------------------------------------- perftest fixtures


@pytest.mark.parametrize("path", fixture_files(PERFTEST))
def test_perftest_fixture_parses(path: Path) -> None:
    result = parse_perftest(read_text(path))
    assert result.columns[:2] == ["bytes", "iterations"]
    assert result.rows, result.warnings
    assert result.device and result.test
    for row in result.rows:
        assert set(result.columns) <= set(row)
        assert row["bytes"] >= 2 and row["iterations"] == 20000
    assert result.largest is not None and result.largest["bytes"] == max(r["bytes"] for r in result.rows)
    if "bw_average" in result.columns:
        assert result.unit in ("Gb/sec", "MB/sec", "MiB/sec")
        assert result.bw_average_gbps is not None and 0 < result.bw_average_gbps < 1000
        assert all(r["bw_average_gbps"] > 0 for r in result.rows)
    else:
        assert result.unit is None and result.bw_average_gbps is None
        assert "t_avg" in result.columns and "p99_9" in result.columns
    assert not any(w.startswith("skipped") for w in result.warnings)


def test_perftest_oci_roce_100g_gbits() -> None:
    r = parse_perftest(fixture_text(PERFTEST, "ib_write_bw-report-gbits-roce-q4-rdma-cm-oci-100g.txt"))
    assert (r.test, r.device, r.link_type, r.qps, r.bidirectional) == (
        "RDMA_Write BW Test",
        "mlx5_5",
        "Ethernet",
        4,
        False,
    )
    assert (r.settings["gid_index"], r.settings["rdma_cm_qps"], r.settings["tos"]) == ("3", "ON", "41")
    assert r.unit == "Gb/sec"
    assert r.rows == [
        {
            "bytes": 65536.0,
            "iterations": 20000.0,  # 5000 default x 4 QPs
            "bw_peak": 98.01,
            "bw_average": 98.01,
            "msg_rate": 0.186932,
            "bw_average_gbps": 98.01,
            "bw_peak_gbps": 98.01,
        }
    ]
    assert (r.bw_average_gbps, r.bw_peak_gbps, r.msg_rate_mpps, r.peak_measured) == (98.01, 98.01, 0.186932, True)
    assert r.warnings == []


def test_perftest_bidirectional_server_sweep_with_prompt_glued_warning() -> None:
    r = parse_perftest(fixture_text(PERFTEST, "ib_write_bw-report-gbits-bidir-q4-a-server-amd-pollara-400g-roce.txt"))
    assert (r.test, r.device, r.qps, r.bidirectional) == ("RDMA_Write Bidirectional BW Test", "ionic_7", 4, True)
    assert r.settings["gid_index"] == "1" and r.settings["cpu_freq"] == "3295[MHz]"
    assert len(r.rows) == 23
    assert [row["bytes"] for row in r.rows] == [2.0**n for n in range(1, 24)]
    assert r.rows[0]["bw_average"] == 0.146472
    assert r.rows[13] == pytest.approx(
        {
            "bytes": 16384,
            "iterations": 20000,
            "bw_peak": 773.59,
            "bw_average": 773.21,
            "msg_rate": 5.899086,
            "bw_average_gbps": 773.21,
            "bw_peak_gbps": 773.59,
        }
    )
    assert r.largest is r.rows[-1]
    assert r.bw_average_gbps == 779.21  # sum of both directions
    assert r.warnings == ["perftest: Using sampled CPU speed 3295 MHz over reported speed 5037 MHz"]


def test_perftest_old_mbytes_sweep_is_mib() -> None:
    r = parse_perftest(fixture_text(PERFTEST, "ib_write_bw-a-cx3-mlx4-fdr-mbytes-sweep.txt"))
    assert (r.test, r.device, r.link_type, r.unit) == ("RDMA_Write BW Test", "mlx4_0", "IB", "MB/sec")
    assert len(r.rows) == 23
    assert {row["bytes"]: row["bw_average"] for row in r.rows}[65536] == 3636.20
    assert r.largest is not None and r.largest["bw_average"] == 3665.25
    # perftest's MB is 0x100000 bytes: 3665.25 x 2**20 x 8 / 1e9
    assert r.bw_average_gbps == pytest.approx(30.746345, rel=1e-6)
    assert r.bw_peak_gbps == pytest.approx(3665.51 * 2**20 * 8 / 1e9)
    send = parse_perftest(fixture_text(PERFTEST, "ib_send_bw-cx3-mlx4.txt"))
    assert (send.test, len(send.rows), send.largest and send.largest["bw_average"]) == ("Send BW Test", 23, 3661.76)
    assert send.bw_average_gbps == pytest.approx(30.717069, rel=1e-6)


def test_perftest_warning_inside_bandwidth_table() -> None:
    r = parse_perftest(fixture_text(PERFTEST, "ib_atomic_bw-cx3-with-cpu-freq-warning-inside-table.txt"))
    assert r.test == "Atomic FETCH_AND_ADD BW Test"
    mib = 2**20 * 8 / 1e9
    expected = {"bytes": 8, "iterations": 20000, "bw_peak": 18.79, "bw_average": 18.67, "msg_rate": 2.446776}
    expected |= {"bw_average_gbps": 18.67 * mib, "bw_peak_gbps": 18.79 * mib}
    assert r.rows == [pytest.approx(expected)]
    assert r.warnings == [
        "perftest: Conflicting CPU frequency values detected: 2300.000000 != 2394.296000. CPU Frequency is not max."
    ]


def test_perftest_latency_tables() -> None:
    lat = parse_perftest(fixture_text(PERFTEST, "ib_write_lat-a-cx3-mlx4-latency-table.txt"))
    assert lat.columns == ["bytes", "iterations", "t_min", "t_max", "t_typical", "t_avg", "t_stdev", "p99", "p99_9"]
    assert lat.units["t_avg"] == "usec" and lat.units["p99_9"] == "usec" and "bytes" not in lat.units
    assert len(lat.rows) == 23
    assert lat.rows[0]["t_min"] == 0.88
    assert lat.largest == {
        "bytes": 8388608.0,
        "iterations": 20000.0,
        "t_min": 2296.01,
        "t_max": 2345.48,
        "t_typical": 2302.01,
        "t_avg": 2304.98,
        "t_stdev": 6.43,
        "p99": 2327.01,
        "p99_9": 2335.48,
    }
    assert (lat.unit, lat.bw_average_gbps, lat.warnings) == (None, None, [])
    atomic = parse_perftest(fixture_text(PERFTEST, "ib_atomic_lat-cx3-with-cpu-freq-warnings.txt"))
    assert [(row["bytes"], row["t_avg"], row["p99_9"]) for row in atomic.rows] == [(8.0, 2.37, 10.20)]
    assert len(atomic.warnings) == 2 and all("Conflicting CPU frequency" in w for w in atomic.warnings)


# --------------------------------------------------------------------------- perftest variants

DURATION_RUN = """\
 WARNING: BW peak won't be measured in this run.
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Device         : mlx5_0
 Number of qps   : 2\t\tTransport type : IB
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]    CPU_Util[%]
 65536      1400000          0.00               23358.24\t\t   0.373732\t\t 99.51
---------------------------------------------------------------------------------------
"""


def test_perftest_duration_run_has_no_peak_and_new_mib_unit() -> None:
    r = parse_perftest(DURATION_RUN)
    assert r.columns == ["bytes", "iterations", "bw_peak", "bw_average", "msg_rate", "cpu_util"]
    assert (r.unit, r.units["cpu_util"], r.peak_measured, r.bw_peak_gbps, r.qps) == ("MiB/sec", "%", False, None, 2)
    (row,) = r.rows
    assert "bw_peak" not in row and row["cpu_util"] == 99.51
    assert r.bw_average_gbps == pytest.approx(23358.24 * 2**20 * 8 / 1e9)  # about 196 Gb/s
    assert r.warnings == ["perftest: WARNING: BW peak won't be measured in this run."]


def test_perftest_columns_are_found_by_heading_not_position() -> None:
    text = " #bytes  BW average[Gb/sec]  #iterations  MsgRate[Mpps]  BW peak[Gb/sec]\n 4096  45.5  5000  1.39  46.0\n"
    r = parse_perftest(text)
    expected = {"bytes": 4096, "bw_average": 45.5, "iterations": 5000, "msg_rate": 1.39, "bw_peak": 46.0}
    assert r.rows == [pytest.approx(expected | {"bw_average_gbps": 45.5, "bw_peak_gbps": 46.0})]
    assert r.bw_average_gbps == 45.5


@pytest.mark.parametrize("path", fixture_files(PERFTEST))
def test_perftest_truncated_crlf_and_corrupted_never_raise(path: Path) -> None:
    text = read_text(path)
    full = parse_perftest(text)
    assert parse_perftest(text.replace("\n", "\r\n")).rows == full.rows
    for cut in range(0, len(text), max(1, len(text) // 25)):
        part = parse_perftest(text[:cut])
        assert len(part.rows) <= len(full.rows)
        assert part.rows == full.rows[: len(part.rows)] or part.rows[:-1] == full.rows[: len(part.rows) - 1]
    corrupted = parse_perftest(text.replace("0.", "0.x").replace("#iterations", "#iter ations"))
    assert isinstance(corrupted.warnings, list)
    assert parse_perftest(text.replace("-----", "")).rows == full.rows


def test_perftest_without_a_table() -> None:
    r = parse_perftest("ib_write_bw: command not found\n")
    assert (r.rows, r.largest, r.bw_average_gbps) == ([], None, None)
    assert r.warnings == ["no perftest result table (no #bytes heading)"]
    bad_unit = parse_perftest(" #bytes  #iterations  BW average[furlongs]\n 2 10 3.0\n")
    assert bad_unit.bw_average_gbps is None and bad_unit.rows == [{"bytes": 2, "iterations": 10, "bw_average": 3.0}]
    assert bad_unit.warnings == ["unknown bandwidth unit 'furlongs'; no Gb/s values"]


@settings(max_examples=examples(80), deadline=None)
@given(st.text(max_size=400))
def test_perftest_fuzzed_never_raises(text: str) -> None:
    parse_perftest(text)
    parse_perftest(" #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n" + text)


# --------------------------------------------------------------------------- sysfs fuzzing

_FUZZ_KEYS = [
    "sys/class/infiniband/mlx5_0/node_guid",
    "sys/class/infiniband/mlx5_0/ports/1/state",
    "sys/class/infiniband/mlx5_0/ports/1/phys_state",
    "sys/class/infiniband/mlx5_0/ports/1/rate",
    "sys/class/infiniband/mlx5_0/ports/1/link_layer",
    "sys/class/infiniband/mlx5_0/ports/1/lid",
    "sys/class/infiniband/mlx5_0/ports/1/lid_mask_count",
    "sys/class/infiniband/mlx5_0/ports/1/gids/0",
    "sys/class/infiniband/mlx5_0/ports/1/gids/3",
    "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/3",
    "sys/class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs/3",
    "sys/class/infiniband/mlx5_0/ports/1/counters/port_rcv_data",
    "sys/class/infiniband/mlx5_0/ports/x/state",
    "sys/class/infiniband/mlx5_0/device/net/eth0/dev_port",
]
_FUZZ_VALUES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        ["Ethernet", "InfiniBand", "4: ACTIVE", "0x1f", "RoCE v2", "0000:0000:0000:0000:0000:ffff:0a00:0001"]
    ),
)


@settings(max_examples=examples(80), deadline=None)
@given(st.dictionaries(st.sampled_from(_FUZZ_KEYS), _FUZZ_VALUES, max_size=len(_FUZZ_KEYS)))
def test_read_ports_fuzzed_never_raises(tree: dict[str, str]) -> None:
    report = read_ports(tree)
    for port in report.ports:
        describe_state(port)
        port_is_up(port)
        assert all(isinstance(v, int) for v in port.counters.values())
        assert all(isinstance(g, RoceGid) for g in port.roce_gids)
    expected_rate_mismatch(report.ports)
