"""ibnetdiscover topology: parsing real captures, tiers, degraded cables, bundles and rails."""

from __future__ import annotations

import json
import random
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.fabrics.topology import (
    KIND_AGGREGATION,
    KIND_CA,
    Topology,
    analyse,
    guess_host,
    link_rate,
    normalise_guid,
    parse,
    to_dict,
)
from tests.agent.fixturefiles import fixture_files, fixture_text, read_text
from tests.budget import examples
from tests.fabrics.fattree import (
    CX2_DEVID,
    CX4_DEVID,
    INFINISCALE4_DEVID,
    SWITCHIB_DEVID,
    fat_tree,
)

FOLDER = "ibnetdiscover"
SUPERPOD = "hdr-qm8790-3tier-fattree-206sw-1336ca-superpod-crlf-bom-prompt.txt"
LID0 = "hdr-quantum-60sw-2ca-with-lid0-links-crlf.txt"
CS8500 = "ibdiagnet-db-format-hdr-cs8500-192sw-1182ca.txt"
IBM = "ibm-doc-example-2hca-1sw-2009.txt"
MANPAGE = "manpage-example-voltaire-sdr-2007.txt"
KB = "nvidia-kb-example-edr-fdr-qdr-mixed-with-stderr-line.txt"
ORACLE = "oracle-doc-example-sun-dcs36-qdr.txt"
ROWS = "ports-p-infiniband-exporter-test.txt"
ROWS2 = "ports-p-infiniband-exporter-test2.txt"

VARIANTS = ("as-is", "cut-3", "cut-41", "cut-77", "cut-99", "crlf", "bom", "bytes", "shuffled", "duplicated")


def check(topo: Topology) -> dict[str, Any]:
    """Invariants every map holds, however bad its input; returns ``to_dict``."""
    data = to_dict(topo)
    json.dumps(data)
    assert all(isinstance(w, str) and w for w in topo.warnings)
    assert not any(w.startswith(("the parser failed", "the analysis failed")) for w in topo.warnings)
    nodes: dict[str, Any] = {**topo.switches, **topo.adapters}
    assert len(nodes) == len(topo.switches) + len(topo.adapters)
    if any(not n.declared for n in nodes.values()):
        assert any("never declared" in w for w in topo.warnings)
    ends: set[tuple[str, int]] = set()
    neighbours: dict[str, set[str]] = defaultdict(set)
    compute_on: set[str] = set()
    for link in topo.links:
        assert link.a in nodes and link.b in nodes
        for end in ((link.a, link.a_port), (link.b, link.b_port)):
            assert end not in ends, f"{end} is in two cables"
            ends.add(end)
        if link.kind == "switch":
            assert link.a in topo.switches and link.b in topo.switches and link.a != link.b
            neighbours[link.a].add(link.b)
            neighbours[link.b].add(link.a)
        elif link.kind == "loop":
            assert link.a == link.b and link.a in topo.switches
        elif link.kind == "adapter":
            assert link.a in topo.switches and link.b in topo.adapters
            if topo.adapters[link.b].kind == KIND_CA:
                compute_on.add(link.a)
        if link.degraded:
            assert link.rate_gbps is not None and link.expected_gbps is not None
            assert link.rate_gbps < link.expected_gbps
        if link.rate_gbps is not None:
            assert link.rate_gbps == link_rate(link.width, link.speed)
    names = {None: None, 0: "leaf", 1: "spine"}
    for switch in topo.switches.values():
        assert (switch.level is None) == (switch.tier is None)
        assert switch.tier == names.get(switch.level, "core")
        if switch.level == 0:
            # A leaf has a compute adapter, or is cabled as leaves are: only to spines.
            around = neighbours[switch.guid]
            assert switch.guid in compute_on or (around and {topo.switches[n].level for n in around} == {1})
        elif switch.level is not None:
            assert any(topo.switches[n].level == switch.level - 1 for n in neighbours[switch.guid])
    for adapter in topo.adapters.values():
        for port in adapter.ports.values():
            if port.leaf is not None:
                assert port.leaf in topo.switches
            if port.port_guid is not None and port.link is not None:
                assert topo.port(port.port_guid) is not None
    assert topo.rails.aligned == (not topo.rails.breaks)
    counts = data["counts"]
    assert counts["leaves"] + counts["spines"] + counts["cores"] <= counts["switches"] == len(data["switches"])
    assert counts["links"] == len(data["links"])
    assert sum(b["count"] for b in data["bundles"]) == sum(1 for x in topo.links if x.kind == "switch")
    return data


def variant(text: str, name: str, seed: str) -> str:
    rng = random.Random(f"{seed}/{name}")
    if name.startswith("cut-"):
        return text[: len(text) * int(name[4:]) // 100]
    if name == "crlf":
        return text.replace("\r\n", "\n").replace("\n", "\r\n")
    if name == "bom":
        return "\ufeff" + text
    if name == "bytes":
        chars = list(text)
        pool = '[]()"#0123456789abcdefSHx \t\n\r\x00\ufffd\ufeff=-'
        for _ in range(max(5, len(chars) // 500) if chars else 0):
            chars[rng.randrange(len(chars))] = rng.choice(pool)
        return "".join(chars)
    lines = text.splitlines()
    if name == "shuffled":
        for _ in range(max(3, len(lines) // 50) if lines else 0):
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
        return "\n".join(lines)
    if name == "duplicated":
        out: list[str] = []
        for line in lines:
            out.append(line)
            if rng.random() < 0.05:
                out.append(line)
        return "\n".join(out)
    return text


def port_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*\[\d+\]", line) and '"' in line)


# Every fixture, as stored and mangled


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("path", fixture_files(FOLDER))
def test_every_fixture_and_its_variants_parse_to_a_consistent_map(path: Path, name: str) -> None:
    text = variant(read_text(path), name, path.name)
    topo = parse(text)
    data = check(topo)
    if name == "as-is" and not path.name.startswith("ports-p"):
        assert data["switches"] and data["links"]
        assert topo.source in ("ibnetdiscover", "ibdiagnet")
        # A complete capture reports each cable from both ends.
        assert 2 * len(topo.links) == port_lines(text)
        assert all(x.reports == 2 for x in topo.links)


@pytest.mark.parametrize("path", fixture_files(FOLDER))
def test_line_endings_and_bom_do_not_change_the_map(path: Path) -> None:
    text = read_text(path)
    plain = to_dict(parse(text.replace("\ufeff", "").replace("\r\n", "\n")))
    assert to_dict(parse(variant(text, "crlf", ""))) == plain
    assert to_dict(parse("\ufeff" + text)) == plain


def test_analyse_again_gives_the_same_map() -> None:
    topo = parse(fixture_text(FOLDER, KB))
    first = to_dict(topo)
    assert to_dict(analyse(topo)) == first


# The 206-switch HDR SuperPOD capture


@pytest.fixture(scope="module")
def superpod() -> Topology:
    return parse(fixture_text(FOLDER, SUPERPOD))


def test_superpod_tiers_match_the_switch_names(superpod: Topology) -> None:
    counts = to_dict(superpod)["counts"]
    # The reference counts 56 leaves, 78 spines, 70 super-spines and 206 aggregation nodes.
    # The file has 80 ``sp`` switches: 78 with no adapter, and sp79/sp80, which also carry the
    # ten management and UFM hosts; they are spines (each is cabled to 14 leaves).
    assert counts["switches"] == 206
    assert counts["leaves"] == 56
    assert counts["spines"] == 80
    assert counts["cores"] == 70
    assert counts["aggregation_nodes"] == 206
    by_tier: dict[str | None, set[str]] = defaultdict(set)
    for switch in superpod.switches.values():
        by_tier[switch.tier].add(switch.desc[:2])
    assert by_tier == {"leaf": {"lf"}, "spine": {"sp"}, "core": {"ss"}}
    with_hosts = {x.a for x in superpod.links if x.kind == "adapter" and superpod.adapters[x.b].kind == KIND_CA}
    spines = [s for s in superpod.switches.values() if s.tier == "spine"]
    assert sorted(s.desc[:4] for s in spines if s.guid in with_hosts) == ["sp79", "sp80"]
    assert sum(1 for s in spines if s.guid not in with_hosts) == 78


def test_superpod_adapters_hosts_and_cables(superpod: Topology) -> None:
    counts = to_dict(superpod)["counts"]
    assert counts["adapters"] == 1130
    assert counts["hosts"] == 150
    assert counts["links"] == 3572
    assert counts["degraded"] == 0
    assert superpod.warnings == []
    assert superpod.generated == "Wed Aug 10 17:02:44 2022"
    assert superpod.initiated_from == "0xb8599f0300ab8338"
    per_host = Counter(a.host for a in superpod.adapters.values() if a.kind == KIND_CA)
    assert Counter(n for h, n in per_host.items() if h and h.startswith("pg-spd")) == {8: 140}
    ans = [a for a in superpod.adapters.values() if a.kind == KIND_AGGREGATION]
    assert {(p.leaf, p.peer_port) for a in ans for p in a.ports.values()} == {(g, 41) for g in superpod.switches}
    assert all(a.host is None for a in ans)
    assert {(x.width, x.speed, x.rate_gbps) for x in superpod.links} == {("4x", "HDR", 200.0)}
    # Each leaf-spine pair is two cables.
    assert Counter((b.count, b.rate_gbps) for b in superpod.bundles) == {(1, 200.0): 1122, (2, 400.0): 557}


def test_superpod_rails_find_the_host_whose_cables_are_crossed(superpod: Topology) -> None:
    rails = superpod.rails
    assert not rails.aligned
    assert [(b.host, b.desc, b.rail, superpod.switches[b.leaf].desc[:4], b.leaf_rails) for b in rails.breaks] == [
        ("pg-spd071", "pg-spd071 mlx5_1", 1, "lf25", [2]),
        ("pg-spd071", "pg-spd071 mlx5_2", 2, "lf30", [1]),
    ]
    # The ten management and UFM hosts (one adapter each, on sp79/sp80) are not rail members.
    assert [r.hosts for r in rails.rails] == [140] * 8
    assert (rails.members, rails.not_members) == (140, {"one_adapter": 0, "storage": 0, "management": 10})
    plan = to_dict(superpod)["rails"]["plan"]
    assert plan == {"adapters": 8, "leaves": 8, "planes": [[r] for r in range(8)], "rails_per_leaf": 1, "hosts": 140}


def test_superpod_lookups_for_placement(superpod: Topology) -> None:
    assert superpod.leaf_of("0x0c42a103008dc858") == "0x043f720300ce5132"
    assert superpod.leaf_of("0c42:a103:008d:c858") == "0x043f720300ce5132"
    info = superpod.port("0C42A103008DC858")
    assert info is not None
    assert (info.host, info.desc, info.device, info.leaf_desc) == (
        "pg-spd001",
        "pg-spd001 mlx5_0",
        "mlx5_0",
        "lf05.cn.a0103.qm8790.krskp",
    )
    assert (info.rate_gbps, info.degraded, info.rail) == (200.0, False, 0)
    assert superpod.leaf_of("0x0000000000000001") is None
    assert superpod.port("not a guid") is None
    assert [p.device for p in superpod.host_ports("pg-spd001")] == [f"mlx5_{i}" for i in (0, 1, 2, 3, 6, 7, 8, 9)]


# The 60-switch Quantum capture with lid-0 switches and self-loop cables


def test_lid0_capture() -> None:
    topo = parse(fixture_text(FOLDER, LID0))
    check(topo)
    assert topo.warnings == []
    assert len(topo.switches) == 60
    assert {s.desc for s in topo.switches.values()} == {"Quantum Mellanox Technologies"}
    unswept = topo.switches["0x98039b030087668e"]
    assert unswept.lid == 0
    assert unswept.tier == "spine"
    assert sum(1 for x in topo.links if unswept.guid in (x.a, x.b)) == 40
    assert Counter((x.kind, x.width, x.speed) for x in topo.links) == {
        ("switch", "4x", "HDR"): 786,
        ("loop", "4x", "HDR"): 19,
        ("adapter", "4x", "SDR"): 2,
    }
    # Both adapter cables run 4xSDR: the leaves run HDR on their other ports and the adapters are
    # ConnectX-5 (EDR), so both are degraded against EDR although no adapter cable runs faster.
    degraded = sorted((x.b, x.rate_gbps, x.expected_gbps) for x in topo.links if x.degraded)
    assert [(topo.adapters[b].desc, rate, expected) for b, rate, expected in degraded] == [
        ("fit101 HCA-1", 10.0, 100.0),
        ("fit26 HCA-3", 10.0, 100.0),
    ]
    adapters = sorted((a.host, a.device, a.desc) for a in topo.adapters.values())
    assert adapters == [("fit101", None, "fit101 HCA-1"), ("fit26", None, "fit26 HCA-3")]
    # A two-tier fabric of 40 leaves and 20 spines: 38 leaves carry no host yet, but each is cabled
    # to the same spines as the two that do, so none is above the spines.
    assert Counter(s.tier for s in topo.switches.values()) == {"leaf": 40, "spine": 20}
    assert topo.rails.plan is None and topo.rails.not_members["one_adapter"] == 2


# The CS8500 director fabric, written by ibdiagnet


def test_cs8500_ibdiagnet_variant() -> None:
    topo = parse(fixture_text(FOLDER, CS8500))
    check(topo)
    assert topo.warnings == []
    assert topo.source == "ibdiagnet"
    assert topo.generated == "2021-09-16 20:04:46 KST +0900"
    assert len(topo.switches) == 192
    # switchguid= holds the chassis GUID; the node is known by its "S-…" name.
    line_asic = topo.switches["0xb8cef6030019c882"]
    assert "0xb8cef603008fbe36" not in topo.switches
    assert (line_asic.sysimgguid, line_asic.chassis, line_asic.slot) == ("0xb8cef603008fbe36", "switch-33fd6e", "L01")
    roles: dict[str, list[Any]] = defaultdict(list)
    for switch in topo.switches.values():
        roles[switch.slot[0] if switch.slot else "-"].append(switch)
    assert Counter(s.chassis for s in topo.switches.values()) == {None: 72, "switch-33fd6e": 60, "switch-33fd4e": 60}
    assert (len(roles["L"]), len(roles["S"]), len(roles["-"])) == (80, 40, 72)
    # Line ASICs face the Quantum leaves, spine ASICs only the line ASICs: one director, two tiers.
    assert {s.level for s in roles["L"]} == {1}
    assert {s.level for s in roles["S"]} == {2}
    assert max(s.level for s in roles["L"]) < min(s.level for s in roles["S"])
    leaves = [s for s in topo.switches.values() if s.tier == "leaf"]
    assert len(leaves) == 72 and all(s.chassis is None for s in leaves)
    # 15 Quantum switches carry no adapter but their aggregation node, cabled only to line ASICs as
    # the 57 host leaves are: leaves without hosts, not core switches two hops up.
    assert Counter(s.level for s in roles["-"]) == {0: 72}
    with_hosts = {x.a for x in topo.links if x.kind == "adapter" and topo.adapters[x.b].kind == KIND_CA}
    assert sum(1 for s in leaves if s.guid not in with_hosts) == 15
    counts = to_dict(topo)["counts"]
    assert (counts["leaves"], counts["spines"], counts["cores"], counts["unknown"]) == (72, 80, 40, 0)
    assert (counts["adapters"], counts["aggregation_nodes"], counts["hosts"]) == (990, 192, 264)
    # The storage nodes' ConnectX-5 cables run EDR, which is all that adapter does: not degraded.
    edr = [x for x in topo.links if x.speed == "EDR"]
    assert len(edr) == 64 and {topo.adapters[x.b].devid for x in edr} == {0x1017}
    assert counts["degraded"] == 0
    anonymous = [a for a in topo.adapters.values() if a.desc.startswith("MT4123 ConnectX6")]
    assert len(anonymous) == 4 and all(a.host is None for a in anonymous)


def test_cs8500_rails_follow_each_family_of_hosts_and_find_the_one_crossed_host() -> None:
    topo = parse(fixture_text(FOLDER, CS8500))
    rails = to_dict(topo)["rails"]
    # 214 GPU hosts give each of their four adapters a leaf; six GPU hosts (agpu1535-1540) and the
    # ten ion hosts put two rails on each of two leaves. The 32 st21scr storage nodes (two ports
    # on the same two leaves, half of them crossed, by design) and ufm1 are not rail members, nor
    # is agpu1055 with a single adapter.
    assert rails["plan"] == {
        "adapters": 4,
        "leaves": 4,
        "planes": [[0], [1], [2], [3]],
        "rails_per_leaf": 1,
        "hosts": 214,
    }
    assert rails["plans"][1:] == [
        {"adapters": 4, "leaves": 2, "planes": [[0, 1], [2, 3]], "rails_per_leaf": 2, "hosts": 15}
    ]
    assert (rails["members"], rails["not_members"]) == (230, {"one_adapter": 1, "storage": 32, "management": 1})
    # ion2102 alone of the ion hosts has HCA-3 and HCA-5 the other way round.
    assert [(b["host"], b["desc"], b["rail"], b["leaf_rails"]) for b in rails["breaks"]] == [
        ("ion2102", "ion2102 HCA-3", 1, [2, 3]),
        ("ion2102", "ion2102 HCA-5", 2, [0, 1]),
    ]


# The short historic examples


def test_ibm_example() -> None:
    topo = parse(fixture_text(FOLDER, IBM))
    check(topo)
    assert topo.warnings == []
    (switch,) = topo.switches.values()
    assert (switch.guid, switch.desc, switch.nports, switch.lid, switch.tier) == (
        "0x000b8cffff0053ee",
        "MT43132 Mellanox Technologies",
        8,
        3,
        "leaf",
    )
    assert sorted((a.host, a.nports) for a in topo.adapters.values()) == [("compute-00-00", 2), ("compute-00-01", 2)]
    assert [(x.a_port, x.b_port, x.rate_gbps) for x in topo.links] == [(1, 1, 10.0), (2, 2, 10.0)]
    assert topo.leaf_of("0x0002c902002789ad") == switch.guid
    info = topo.port("0x0002c9030002847e")
    assert info is not None and (info.host, info.port, info.adapter) == ("compute-00-00", 2, "0x0002c9030002847c")
    # One adapter port per host: no rails to line up.
    assert topo.rails.aligned and topo.rails.rails == [] and topo.rails.plan is None
    assert topo.rails.not_members == {"one_adapter": 2, "storage": 0, "management": 0}


def test_manpage_example() -> None:
    topo = parse(fixture_text(FOLDER, MANPAGE))
    check(topo)
    assert len(topo.switches) == 2 and len(topo.adapters) == 4 and len(topo.links) == 7
    assert {s.tier for s in topo.switches.values()} == {"leaf"}
    # The vendor's default node description names no host.
    assert {a.host for a in topo.adapters.values()} == {None}
    # The two ends of the 1x cable disagree in this text (4x from one side): kept the lower.
    assert any("4xSDR and as 1xSDR" in w for w in topo.warnings)
    slow = sorted((x.a_port, x.b_port, x.rate_gbps, x.expected_gbps) for x in topo.links if x.degraded)
    assert slow == [(1, 10, 2.5, 10.0), (12, 1, 2.5, 10.0)]
    bundle = topo.bundles[0]
    assert (bundle.count, bundle.rate_gbps, bundle.degraded) == (2, 12.5, 1)
    two_port = topo.adapters["0x0008f10403960558"]
    assert sorted(p.port_guid for p in two_port.ports.values()) == ["0x0008f10403960559", "0x0008f1040396055a"]


def test_nvidia_kb_example() -> None:
    topo = parse(fixture_text(FOLDER, KB))
    check(topo)
    tool_messages = [w for w in topo.warnings if "the tool reported" in w]
    assert len(tool_messages) == 1 and "bad status 110" in tool_messages[0]
    assert len(topo.switches) == 2 and len(topo.adapters) == 6 and len(topo.links) == 10
    assert sum(1 for x in topo.links if x.kind == "loop") == 3
    sx6012 = topo.switches["0xf4521403005764b0"]
    assert (sx6012.enhanced, sx6012.chassis, sx6012.slot) == (True, "switch-de779e", None)
    rates = Counter(x.speed for x in topo.links)
    assert rates == {"EDR": 4, "FDR": 3, "QDR": 2, "SDR": 1}
    # r-ufm96's ConnectX-4 (EDR) trained at 4xSDR on the SX6012, whose fastest port runs FDR.
    (slow,) = [x for x in topo.links if x.degraded]
    assert (topo.adapters[slow.b].desc, slow.rate_gbps, slow.expected_gbps) == ("r-ufm96 HCA-1", 10.0, 56.0)
    # The ConnectX-2 cables of r-ufm101 run QDR, all that adapter does: not degraded.
    assert {x.speed for x in topo.links if topo.adapters.get(x.b) and topo.adapters[x.b].host == "r-ufm101"} == {"QDR"}
    # The r-ufm hosts are UFM (management) machines, not rail members: r-ufm101's two adapters on
    # the SX6012 are no break.
    assert topo.rails.aligned and topo.rails.not_members["management"] == 5


def test_oracle_example_with_a_one_space_line() -> None:
    topo = parse(fixture_text(FOLDER, ORACLE))
    check(topo)
    assert topo.warnings == []
    (switch,) = topo.switches.values()
    assert (switch.desc, switch.nports, switch.lid, switch.enhanced) == (
        "Sun DCS 36 QDR switch localhost",
        36,
        15,
        True,
    )
    (link,) = topo.links
    assert (link.a_port, link.b_port, link.width, link.speed, link.rate_gbps) == (23, 2, "4x", "QDR", 40.0)
    info = topo.port("0x0003ba000100e38a")
    assert info is not None and (info.host, info.leaf) == ("nsn33-43", switch.guid)


def test_ports_report_rows() -> None:
    topo = parse(fixture_text(FOLDER, ROWS))
    check(topo)
    assert topo.source == "ports"
    assert len(topo.links) == 4
    assert sorted(a.host for a in topo.adapters.values()) == ["o0001", "o0002", "p0001"]
    assert topo.leaf_of("0x7cfe9003003b4bde") == "0x7cfe9003009ce5b0"
    unconnected = topo.switches["0x08c0eb0300add20e"]
    assert (unconnected.desc, unconnected.lid, unconnected.tier) == ("ib-i7l2s01", 1781, None)


def test_ports_report_rows_keep_raw_descriptions_and_catch_a_port_cabled_twice() -> None:
    topo = parse(fixture_text(FOLDER, ROWS2))
    check(topo)
    descs = {s.desc for s in topo.switches.values()}
    assert {"5FB0405-leaf-IB01 ", " 5FB0406-spine-IB02 ", " 5FB0406-spine-IB03 "} <= descs
    worker = [a for a in topo.adapters.values() if a.host == "worker20"]
    assert [(a.device, a.kind) for a in worker] == [("mlx5_3", KIND_CA)]
    assert any("cabled to both" in w and "0x946dae0300630bfe port 1" in w for w in topo.warnings)


@pytest.mark.parametrize("name", [ROWS, ROWS2])
def test_ports_report_rows_without_quotes_read_as_the_quoted_ones(name: str) -> None:
    text = fixture_text(FOLDER, name)
    quoted = to_dict(parse(text))
    bare = parse(text.replace("'", ""))
    data = check(bare)
    assert not any("not understood" in w for w in bare.warnings)
    assert data["links"] == quoted["links"]
    assert [(a["guid"], a["desc"].strip(), a["host"]) for a in data["adapters"]] == [
        (a["guid"], a["desc"].strip(), a["host"]) for a in quoted["adapters"]
    ]
    assert sorted((s["guid"], s["desc"].strip()) for s in data["switches"]) == sorted(
        (s["guid"], s["desc"].strip()) for s in quoted["switches"]
    )


def test_unquoted_rows_whose_descriptions_hold_a_dash_are_split_where_a_known_name_fits() -> None:
    text = (
        "SW    10  2 0x0000000000000010 4x SDR                                    leaf - row 3\n"
        "CA    20  1 0x0000000000000020 4x HDR - SW    10  1 0x0000000000000010 ( node7 mlx5_0 - leaf - row 3 )\n"
        'SW    10  1 0x0000000000000010 4x HDR - CA    20  1 0x0000000000000020 ( "leaf - row 3" - "node7 mlx5_0" )\n'
    )
    topo = parse(text)
    check(topo)
    assert topo.warnings == []
    assert topo.switches["0x0000000000000010"].desc == "leaf - row 3"
    adapter = topo.adapters["0x0000000000000020"]
    assert (adapter.desc, adapter.host, adapter.device) == ("node7 mlx5_0", "node7", "mlx5_0")
    (link,) = topo.links
    assert (link.reports, link.rate_gbps) == (2, 200.0)


# Files that lie


LIES = """\
#
# Topology file: generated on Tue Sep 29 10:00:00 2026
#
switchguid=0x10(10)
Switch\t4 "S-0000000000000010"\t\t# "leaf-a" base port 0 lid 1 lmc 0
[1]\t"H-0000000000000100"[1](100) \t\t# "n1 mlx5_0" lid 5 4xNDR
[1]\t"H-0000000000000200"[1](200) \t\t# "n2 mlx5_0" lid 6 4xNDR
[2]\t"S-0000000000000020"[1]\t\t# "spine-a" lid 2 4xNDR
[3]\t"S-00000000000000ff"[1]\t\t# "ghost" lid 9 4xNDR
[9]\t"H-0000000000000300"[1](300) \t\t# "n3 mlx5_0" lid 7 4xNDR

Switch\t4 "S-0000000000000020"\t\t# "spine-a" base port 0 lid 2 lmc 0
[1]\t"S-0000000000000010"[2]\t\t# "leaf-a" lid 1 4xNDR
[4]\t"R-0000000000000400"[1](400) \t\t# "router-1" lid 8 4xNDR

Switch\t36 "S-0000000000000030"\t\t# "lonely" base port 0 lid 3 lmc 0

Mystery\t1 "H-0000000000000500"\t\t# "n5 mlx5_0"
[1](500) \t"S-0000000000000020"[3]\t\t# lid 10 lmc 0 "spine-a" lid 2 4xNDR

Rt\t1 "R-0000000000000400"\t\t# "router-1"
[1](400) \t"S-0000000000000020"[4]\t\t# lid 8 lmc 0 "spine-a" lid 2 4xNDR

Ca\t1 "H-0000000000000100"\t\t# "n1 mlx5_0"
[1](100) \t"S-0000000000000010"[1]\t\t# lid 5 lmc 0 "leaf-a" lid 1 4xN
"""


def test_a_file_that_lies_gives_a_partial_map_and_says_why() -> None:
    topo = parse(LIES)
    check(topo)
    text = "\n".join(topo.warnings)
    assert "0x0000000000000010 port 1 is reported cabled to both" in text
    assert "0x0000000000000030 (lonely) is declared with no connected port" in text
    assert "unknown node type 'Mystery'" in text
    assert "never declared" in text and "0x00000000000000ff" in text
    assert "has 4 ports but reports port 9" in text
    assert topo.adapters["0x0000000000000400"].kind == "router"
    assert topo.adapters["0x0000000000000500"].raw_type == "Mystery"
    assert topo.switches["0x00000000000000ff"].declared is False
    # n1's cable, whose last line is cut short, still has its rate from the switch side.
    n1 = topo.port("0x0000000000000100")
    assert n1 is not None and (n1.leaf, n1.rate_gbps) == ("0x0000000000000010", 400.0)
    # n2 lost port 1 of leaf-a to n1: known, but cabled to nothing.
    n2 = topo.port("0x0000000000000200")
    assert n2 is not None and n2.leaf is None and n2.rail is None
    # Both switches with adapters are leaves (neither is cabled to two busier leaves); the
    # undeclared one hangs off leaf-a; the one with no port is unreachable.
    tiers = {g: s.tier for g, s in topo.switches.items()}
    assert tiers == {
        "0x0000000000000010": "leaf",
        "0x0000000000000020": "leaf",
        "0x00000000000000ff": "spine",
        "0x0000000000000030": None,
    }
    assert "analysis: 1 switches are not connected to any leaf" in text
    assert "reported from one end only" in text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\ufeff",
        " \r\n \n",
        "[root@node ~]# ibnetdiscover\n",
        '[1]\t"S-0000000000000010"[1]\t\t# "x" lid 1 4xHDR\n',
        'Switch\t41 "S-00000000000000000000000000000001"\t\t# "too long" base port 0 lid 1 lmc 0\n',
        'Switch\t41 "S-1"\t\t# "cut',
        'Switch\t1 "S-1"\n[1]\t"S-1"[1]\n',
        "CA 1 1 0x1 4x HDR - SW 2 2 0x2 ( 'a' - 'b' )\nSW 2 2 0x2 4x HDR - SW 3 3 0x3 ( 'b' - 'c' )\n",
        '\x00\x01\x02[[[]]]"""###',
        "CA 1 1 0x1 4x HDR - CA 1 1 0x1 ( '" + "' - '" * 3000 + "\n",
        "[" + "9" * 5000 + ']\t"S-1"[1]\n',
        '[1]\t"S-1"[' + "9" * 1500 + "]\n",
    ],
)
def test_odd_inputs_do_not_raise(text: str) -> None:
    check(parse(text))


# Synthetic rail-optimised fat trees


def test_fat_tree_rails_line_up_and_tiers_are_right() -> None:
    tree = fat_tree()
    topo = parse(tree.text)
    data = check(topo)
    assert topo.warnings == []
    assert {g: s.tier for g, s in topo.switches.items()} == tree.tiers
    assert topo.rails.aligned and data["rails"]["aligned"]
    assert [len(r.leaves) for r in topo.rails.rails] == [2] * tree.rails
    for (host, rail), port_guid in tree.port_guid.items():
        assert topo.leaf_of(port_guid) == tree.leaf[(host, rail)]
        info = topo.port(port_guid)
        assert info is not None
        assert (info.host, info.device, info.rail, info.rate_gbps) == (host, f"mlx5_{rail}", rail, 200.0)
    assert data["counts"]["aggregation_nodes"] == len(topo.switches)
    assert data["counts"]["links"] == tree.cables


def test_fat_tree_rails_follow_device_numbers_not_spelling() -> None:
    tree = fat_tree(pods=1, hosts_per_su=2, rails=12, spines_per_pod=2, uplinks=2, cores_per_group=0)
    topo = parse(tree.text)
    check(topo)
    assert topo.rails.aligned
    for (_host, rail), port_guid in tree.port_guid.items():
        info = topo.port(port_guid)
        assert info is not None and info.device == f"mlx5_{rail}" and info.rail == rail


def test_fat_tree_with_two_crossed_cables_names_the_host() -> None:
    tree = fat_tree(swap_host="gpu0003")
    topo = parse(tree.text)
    data = check(topo)
    assert not topo.rails.aligned
    assert [(b.host, b.rail, b.leaf_rail) for b in topo.rails.breaks] == [("gpu0003", 0, 1), ("gpu0003", 1, 0)]
    assert {b["host"] for b in data["rails"]["breaks"]} == {"gpu0003"}


@pytest.mark.parametrize("where", ["spine", "adapter"])
def test_fat_tree_with_one_slow_cable_marks_exactly_that_one(where: str) -> None:
    tree = fat_tree(slow=where)
    topo = parse(tree.text)
    data = check(topo)
    degraded = [(x.a, x.a_port, x.b, x.b_port) for x in topo.links if x.degraded]
    assert degraded == [tree.slow]
    (slow,) = [x for x in data["links"] if x["degraded"]]
    assert (slow["rate_gbps"], slow["expected_gbps"]) == (100.0, 200.0)
    assert data["counts"]["degraded"] == 1
    if where == "spine":
        assert sorted((b.count, b.rate_gbps, b.degraded) for b in topo.bundles if b.degraded) == [(2, 300.0, 1)]
    else:
        assert tree.slow is not None
        info = topo.port(tree.slow[2])
        assert info is not None and info.degraded and info.expected_gbps == 200.0


def test_fat_tree_cut_short_keeps_the_switches_it_read() -> None:
    tree = fat_tree()
    cut = tree.text[: tree.text.index("Ca\t")]
    topo = parse(cut)
    check(topo)
    assert len(topo.switches) == len(tree.tiers)
    assert any("never declared" in w for w in topo.warnings)
    # The adapters are known from the switch side, port GUIDs included.
    for (host, rail), port_guid in tree.port_guid.items():
        assert topo.leaf_of(port_guid) == tree.leaf[(host, rail)]
    assert topo.rails.aligned


# The project's generated fabrics: designs met on real clusters


def _plan(adapters: int, planes: list[list[int]], rails_per_leaf: int, hosts: int) -> dict[str, Any]:
    return {
        "adapters": adapters,
        "leaves": len(planes),
        "planes": planes,
        "rails_per_leaf": rails_per_leaf,
        "hosts": hosts,
    }


FOUR_BY_FOUR = _plan(4, [[0], [1], [2], [3]], 1, 8)
TWO_PLANES = {
    "pods": 1,
    "sus_per_pod": 4,
    "hosts_per_su": 8,
    "planes": 2,
    "director": True,
    "spines_per_pod": 4,
    "cores_per_group": 2,
    "rate": "4xEDR",
    "switch_devid": SWITCHIB_DEVID,
    "adapter_devid": CX4_DEVID,
}
TWO_PER_LEAF = {"rails": 8, "rails_per_leaf": 2, "hosts_per_su": 6}
QDR_ONE_ADAPTER = {
    "rails": 1,
    "sus_per_pod": 4,
    "hosts_per_su": 8,
    "cores_per_group": 0,
    "rate": "4xQDR",
    "switch_devid": INFINISCALE4_DEVID,
    "adapter_devid": CX2_DEVID,
}
GENERATED: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {
    "rail-optimised": ({}, FOUR_BY_FOUR),
    # Crossed cables keep the host's shape (four adapters on four leaves): all eight follow the plan.
    "rail-optimised, one host crossed": ({"swap_host": "gpu0003"}, FOUR_BY_FOUR),
    # Adapters 1 and 3 of every host on one leaf, 2 and 4 on another, on a director's line cards.
    "four adapters over two planes, EDR director": (TWO_PLANES, _plan(4, [[0, 2], [1, 3]], 2, 32)),
    "four adapters over two planes, one host crossed": (
        {**TWO_PLANES, "swap_host": "gpu0010"},
        _plan(4, [[0, 2], [1, 3]], 2, 31),
    ),
    "two rails per leaf": (TWO_PER_LEAF, _plan(8, [[0, 1], [2, 3], [4, 5], [6, 7]], 2, 12)),
    "two rails per leaf, one host crossed": (
        {**TWO_PER_LEAF, "swap_host": "gpu0002"},
        _plan(8, [[0, 1], [2, 3], [4, 5], [6, 7]], 2, 11),
    ),
    "leaves without hosts beside director line cards": (
        {"pods": 1, "sus_per_pod": 2, "director": True, "hostless_leaves": 3, "spines_per_pod": 4},
        FOUR_BY_FOUR,
    ),
    "leaves without hosts in a three-tier tree": ({"hostless_leaves": 2}, FOUR_BY_FOUR),
    "every host cable slow": ({"host_rate": "4xSDR"}, FOUR_BY_FOUR),
    "one slow uplink": ({"slow": "spine"}, FOUR_BY_FOUR),
    "one slow adapter cable": ({"slow": "adapter"}, FOUR_BY_FOUR),
    "storage node on a spine, one adapter per host": ({**QDR_ONE_ADAPTER, "storage_on_spine": "nfs01"}, None),
    "unnamed dual-port node on a spine, one adapter per host": (
        {**QDR_ONE_ADAPTER, "storage_on_spine": "node-s01"},
        None,
    ),
}


@pytest.mark.parametrize("design", list(GENERATED))
def test_the_analysis_is_right_on_every_generated_fabric(design: str) -> None:
    options, plan = GENERATED[design]
    tree = fat_tree(**options)
    topo = parse(tree.text)
    data = check(topo)
    assert topo.warnings == []
    assert {g: s.tier for g, s in topo.switches.items()} == tree.tiers
    assert sorted((x.a, x.a_port, x.b, x.b_port) for x in topo.links if x.degraded) == tree.slow_cables
    assert sorted((b.host, b.rail) for b in topo.rails.breaks) == tree.crossed
    assert data["rails"]["plan"] == plan
    for (host, rail), port_guid in tree.port_guid.items():
        assert topo.leaf_of(port_guid) == tree.leaf[(host, rail)]


def test_four_adapters_over_two_planes_break_only_where_a_host_is_crossed() -> None:
    tree = fat_tree(**TWO_PLANES, swap_host="gpu0010")
    rails = to_dict(parse(tree.text))["rails"]
    # gpu0010 has mlx5_0 and mlx5_1 the other way round: on each leaf it puts a rail the other
    # seven hosts of its unit put on the other leaf.
    assert [(b["host"], b["desc"], b["rail"], b["leaf_rails"]) for b in rails["breaks"]] == [
        ("gpu0010", "gpu0010 mlx5_0", 0, [1, 3]),
        ("gpu0010", "gpu0010 mlx5_1", 1, [0, 2]),
    ]
    assert rails["members"] == 32 and rails["plans"] == [rails["plan"]]


def test_leaves_without_hosts_are_peers_of_the_leaves_not_cores() -> None:
    tree = fat_tree(pods=1, sus_per_pod=2, director=True, hostless_leaves=3, spines_per_pod=4)
    topo = parse(tree.text)
    counts = to_dict(topo)["counts"]
    assert (counts["leaves"], counts["spines"], counts["cores"], counts["unknown"]) == (11, 4, 2, 0)
    assert {topo.switches[g].level for g in tree.hostless} == {0}
    # The director's spine ASICs, cabled to every line ASIC, stay above them.
    assert {s.level for s in topo.switches.values() if s.desc.startswith("MF0;dir1:CS7500/S")} == {2}


def test_a_switch_that_shares_some_spines_with_a_leaf_has_an_unknown_tier() -> None:
    tree = fat_tree(pods=3, hosts_per_su=2, rails=1, spines_per_pod=4, uplinks=4, cores_per_group=0)
    spines = sorted(g for g, tier in tree.tiers.items() if tier == "spine")
    assert len(spines) == 12
    # A switch cabled to two spines of each of the three pods: a leaf takes all four of its pod's
    # spines and a core one of each pod, so this one is neither, as far as the cabling tells.
    odd = "0x0000000000000abc"
    block = ["", "vendid=0x2c9", "devid=0xd2f0", f'Switch\t37 "S-{odd[2:]}"\t\t# "odd" enhanced port 0 lid 99 lmc 0']
    chosen = [g for pod in range(3) for g in spines[pod * 4 : pod * 4 + 2]]
    block += [f'[{i + 1}]\t"S-{g[2:]}"[30]\t\t# "sp" lid 3 4xHDR' for i, g in enumerate(chosen)]
    topo = parse(tree.text + "\n".join(block) + "\n")
    data = check(topo)
    assert (topo.switches[odd].tier, topo.switches[odd].level) == (None, None)
    assert data["counts"]["unknown"] == 1
    assert any("cannot be told whether they are leaves without hosts or core switches" in w for w in topo.warnings)
    # Everything else keeps its tier.
    assert {g: s.tier for g, s in topo.switches.items() if g != odd} == tree.tiers


def test_every_slow_host_cable_is_degraded_against_what_both_ends_run() -> None:
    tree = fat_tree(host_rate="4xSDR")
    topo = parse(tree.text)
    host_cables = [x for x in topo.links if x.kind == "adapter" and topo.adapters[x.b].kind == KIND_CA]
    assert len(host_cables) == 32
    # The leaves run HDR to the spines and the adapters are ConnectX-6 (HDR).
    assert {(x.rate_gbps, x.expected_gbps, x.degraded) for x in host_cables} == {(10.0, 200.0, True)}
    info = topo.port(tree.port_guid[("gpu0001", 0)])
    assert info is not None and (info.degraded, info.expected_gbps) == (True, 200.0)


def test_an_adapter_slower_than_the_switch_by_design_is_not_degraded() -> None:
    # ConnectX-4 (EDR) hosts on an HDR fabric: every host cable at 4xEDR is all those adapters do.
    tree = fat_tree(host_rate="4xEDR", adapter_devid=CX4_DEVID)
    topo = parse(tree.text)
    host_cables = [x for x in topo.links if x.kind == "adapter" and topo.adapters[x.b].kind == KIND_CA]
    assert {(x.rate_gbps, x.expected_gbps, x.degraded) for x in host_cables} == {(100.0, 100.0, False)}


@pytest.mark.parametrize("name", ["nfs01", "node-s01"])
def test_a_node_with_both_ports_on_a_spine_is_no_rail_break(name: str) -> None:
    tree = fat_tree(**QDR_ONE_ADAPTER, storage_on_spine=name)
    topo = parse(tree.text)
    rails = to_dict(topo)["rails"]
    assert rails["aligned"] and rails["breaks"] == [] and rails["members"] == 0
    reason = "storage" if name == "nfs01" else "one_adapter"
    assert rails["not_members"][reason] == (65 if reason == "one_adapter" else 1)
    info = topo.host_ports(name)
    assert [(p.port, p.rail, topo.switches[str(p.leaf)].tier) for p in info] == [(1, None, "spine"), (2, None, "spine")]


# Helpers


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0x2c9", "0x00000000000002c9"),
        ("0002C9030002847E", "0x0002c9030002847e"),
        ("b859:9f03:00ab:8338", "0xb8599f0300ab8338"),
        (0x10, "0x0000000000000010"),
        ("0x" + "f" * 17, None),
        ("xyz", None),
        ("", None),
        (None, None),
        (-1, None),
    ],
)
def test_normalise_guid(value: str | int | None, expected: str | None) -> None:
    assert normalise_guid(value) == expected


@pytest.mark.parametrize(
    ("width", "speed", "rate"),
    [
        ("4x", "HDR", 200.0),
        ("2x", "HDR", 100.0),
        ("4x", "NDR", 400.0),
        ("2x", "NDR", 200.0),
        ("1x", "SDR", 2.5),
        ("12x", "QDR", 120.0),
        ("4x", "FDR", 56.0),
        ("4x", "FDR10", 40.0),
        ("8x", "XDR", 1600.0),
        ("4x", "???", None),
        ("??", "HDR", None),
        (None, "HDR", None),
    ],
)
def test_link_rate(width: str | None, speed: str | None, rate: float | None) -> None:
    assert link_rate(width, speed) == rate


@pytest.mark.parametrize(
    ("desc", "host", "device"),
    [
        ("node01 HCA-1", "node01", None),
        ("dgx01 mlx5_0", "dgx01", "mlx5_0"),
        ("  dgx01 mlx5_10 ", "dgx01", "mlx5_10"),
        ("ufm1", "ufm1", None),
        ("MT4123 ConnectX6   Mellanox Technologies", None, None),
        ("MT23108 InfiniHost Mellanox Technologies", None, None),
        ("Mellanox Technologies Aggregation Node", None, None),
        ("localhost HCA-1", None, None),
        ("", None, None),
    ],
)
def test_guess_host(desc: str, host: str | None, device: str | None) -> None:
    assert guess_host(desc) == (host, device)


# Fuzz: lines put together from pieces of the grammar

GUIDS = [f"{n:016x}" for n in (0x10, 0x20, 0x30, 0x100, 0x200, 0x2C9030002847E)]
guid = st.sampled_from(GUIDS)
port = st.integers(min_value=0, max_value=70)
desc = st.text(alphabet=st.sampled_from('ab01 -_"#;:/\t'), max_size=12)
rate = st.sampled_from(["4xHDR", "2xNDR", "1xSDR", "4xFDR10", "12xEDR", "??", "4x???", "8xXDR", "4x", ""])
prefix = st.sampled_from("SHR")
fragment = st.one_of(
    st.builds(lambda g: f"switchguid=0x{g}({g})", guid),
    st.builds(lambda g: f"caguid=0x{g}", guid),
    st.sampled_from(["vendid=0x2c9", "devid=0xd2f0", "sysimgguid=", "#", "# Topology file: generated on x", " ", ""]),
    st.builds(
        lambda t, n, p, g, d, lid: f'{t}\t{n} "{p}-{g}"\t\t# "{d}" enhanced port 0 lid {lid} lmc 0',
        st.sampled_from(["Switch", "Ca", "Rt", "???", "Foo"]),
        port,
        prefix,
        guid,
        desc,
        port,
    ),
    st.builds(
        lambda a, own, p, g, b, d, r: f'[{a}]{own}\t"{p}-{g}"[{b}](2c9) \t\t# "{d}" lid 3 {r}',
        port,
        st.sampled_from(["", "(1)", "(2c9030002847e)"]),
        prefix,
        guid,
        port,
        desc,
        rate,
    ),
    st.builds(
        lambda a, g, b, d, r: f'[{a}](2c9)\t"S-{g}"[{b}]\t\t# lid 1 lmc 0 "{d}" lid 3 {r}',
        port,
        guid,
        port,
        desc,
        rate,
    ),
    st.builds(
        lambda t, g, p, h, d: f"{t} 1 {p} 0x{g} 4x HDR - SW 2 3 0x{h} ( '{d}' - 'x' )",
        st.sampled_from(["CA", "SW", "RT"]),
        guid,
        port,
        guid,
        desc,
    ),
    st.text(max_size=30),
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(fragment, max_size=40), st.sampled_from(["\n", "\r\n", "\r"]))
def test_fuzzed_grammar_never_raises(lines: list[str], newline: str) -> None:
    topo = parse(newline.join(lines))
    check(topo)
    assert to_dict(analyse(topo)) == to_dict(topo)


CHASSIS_AND_FULL = """\
#
# Topology file: generated on Tue Sep 29 10:00:00 2026
#
# Initiated from node 0000000000000100 port 0000000000000100
Chassis 1 (guid 0x10)

# Spine Nodes
vendid=0x2c9
devid=0xd2f0
sysimgguid=0x10\t\t# Chassis 1 (MCS8500) slot 1
switchguid=0x11(11)
Switch\t41 "S-0000000000000011"\t\t# "MF0;dir-1:MCS8500/S01/U1" base port 0 lid 2 lmc 0
[1][ext 1]\t"S-0000000000000012"[9][ext 9]\t\t# "MF0;dir-1:MCS8500/L01/U1" lid 3 4xNDR s=4 w=2 v=4 e=64

# Line Nodes
switchguid=0x12(12)
Switch\t41 "S-0000000000000012"\t\t# "MF0;dir-1:MCS8500/L01/U1" base port 0 lid 3 lmc 0
[9][ext 9]\t"S-0000000000000011"[1][ext 1]\t\t# "MF0;dir-1:MCS8500/S01/U1" lid 2 4xNDR s=4 w=2 v=4 e=64
[1][ext 1]\t"H-0000000000000100"[1](100) \t\t# "h1 mlx5_0" lid 5 2xNDR s=4 w=16 v=4 e=64

Non-Chassis Nodes

vendid=0x2c9
caguid=0x100
Ca\t1 "H-0000000000000100"\t\t# "h1 mlx5_0"
[1](100) \t"S-0000000000000012"[1][ext 1]\t\t# lid 5 lmc 0 "MF0;dir-1:MCS8500/L01/U1" lid 3 2xNDR s=4 w=16 v=4 e=64
"""


def test_chassis_sections_and_full_info_suffixes() -> None:
    topo = parse(CHASSIS_AND_FULL)
    check(topo)
    assert topo.warnings == []
    assert [(s.slot, s.tier) for s in topo.switches.values()] == [("S01", "spine"), ("L01", "leaf")]
    assert sorted((x.width, x.speed, x.rate_gbps) for x in topo.links) == [("2x", "NDR", 200.0), ("4x", "NDR", 400.0)]
    assert topo.leaf_of("0x0000000000000100") == "0x0000000000000012"
