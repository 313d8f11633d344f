"""NVLink topology (``nvidia-smi topo -m``) and IMEX (``nvidia-imex-ctl -q / -N``) parsers."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from fixturefiles import fixture_files, fixture_text, read_text
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.probes.nvlink import (
    IMEX_STATES,
    ImexDomain,
    ImexNode,
    TopoGpu,
    Topology,
    imex_channels,
    nvlink_groups,
    parse_imex_nodes,
    parse_imex_state,
    parse_topo_matrix,
)
from tests.budget import examples

TOPO = "nvidia-smi-topo"
IMEX = "nvidia-imex-ctl"
A100_NICS = "m-a100-sxm-8gpu-nv12-10nic-pxb-tabs-nic-legend.txt"
A100_REALIGNED = "m-a100-8gpu-nv12-realigned.txt"
H100_NV18 = "m-h100-8gpu-nv18-ht-cpu-affinity.txt"
NV2 = "m-2gpu-nv2-nvlink-bridge.txt"
PHB = "m-2gpu-phb-consumer-pcie.txt"
ANSI = "m-h100-single-gpu-vm-drv590-with-ansi-underline.txt"
WINDOWS = "m-rtx2080super-windows-drv610.txt"

ALL_FILES = fixture_files(TOPO) + fixture_files(IMEX)


# --------------------------------------------------------------------------- invariants


def assert_topology(topology: Topology) -> None:
    """The shape every parse must have, whatever the input."""
    assert isinstance(topology, Topology)
    assert all(isinstance(w, str) for w in topology.warnings)
    assert all(isinstance(n, str) for n in topology.nics)
    indices = [gpu.index for gpu in topology.gpus]
    assert len(indices) == len(set(indices))
    for gpu in topology.gpus:
        assert isinstance(gpu, TopoGpu)
        assert gpu.index not in gpu.paths
        assert set(gpu.links) <= set(gpu.paths)
        for peer, count in gpu.links.items():
            assert gpu.paths[peer] == f"NV{count}" or re.fullmatch(r"NV0*" + str(count), gpu.paths[peer])
        assert all(not token.startswith("NV") for peer, token in gpu.paths.items() if peer not in gpu.links)
        assert set(gpu.nearest_nics) <= set(gpu.nics)
        assert (gpu.nearest_path is None) == (gpu.nearest_nics == [])
        assert gpu.nearest_path != "SYS"
        for name in gpu.nearest_nics:
            assert gpu.nics[name] == gpu.nearest_path
        assert gpu.numa_node is None or isinstance(gpu.numa_node, int)
        assert gpu.cpu_affinity is None or re.fullmatch(r"[0-9,\-]+", gpu.cpu_affinity)
    groups = nvlink_groups(topology)
    assert set(groups) == set(indices)
    for index, group in groups.items():
        assert group == f"nvl{min(i for i, g in groups.items() if g == group)}"
        assert int(group[3:]) <= index


def assert_domain(domain: ImexDomain) -> None:
    assert isinstance(domain, ImexDomain)
    assert isinstance(domain.configured, bool)
    assert domain.domain_state is None or isinstance(domain.domain_state, str)
    assert all(isinstance(w, str) for w in domain.warnings)
    for node in domain.nodes:
        assert isinstance(node, ImexNode)
        assert isinstance(node.index, int) and isinstance(node.address, str) and isinstance(node.state, str)
        assert node.version is None or isinstance(node.version, str)
    for source, row in domain.connectivity.items():
        assert isinstance(source, int)
        assert all(isinstance(k, int) and isinstance(v, str) for k, v in row.items())


def parse_everything(text: str) -> None:
    assert_topology(parse_topo_matrix(text))
    state = parse_imex_state(text)
    assert state is None or isinstance(state, str)
    assert_domain(parse_imex_nodes(text))


# --------------------------------------------------------------------------- every fixture file


@pytest.mark.parametrize("path", fixture_files(TOPO))
def test_every_topo_file(path: Path) -> None:
    text = read_text(path)
    topology = parse_topo_matrix(text)
    assert_topology(topology)
    assert parse_topo_matrix(text.replace("\n", "\r\n")) == topology
    # GPU rows hold their own "X"; the header does not.
    rows = [line for line in text.splitlines() if re.match(r"^\s*GPU[0-9]+\s.*(\s|^)X(\s|$)", line)]
    if path.name.startswith("p2p-"):
        # `topo -p2p r`: P2P statuses, no link types; never GPUs that look NVLink-less.
        assert topology.gpus == [] and topology.nics == []
        assert any("-p2p" in w for w in topology.warnings)
        assert nvlink_groups(topology) == {}
    else:
        assert len(topology.gpus) == len(rows) > 0
        assert topology.warnings == []
        nv_cells = sum(len(re.findall(r"\bNV[0-9]+\b", line)) for line in rows)
        assert sum(len(gpu.links) for gpu in topology.gpus) == nv_cells


@pytest.mark.parametrize("path", fixture_files(IMEX))
def test_every_imex_file(path: Path) -> None:
    text = read_text(path)
    domain = parse_imex_nodes(text)
    assert_domain(domain)
    node_lines = [line for line in text.splitlines() if line.startswith("Node #")]
    assert len(domain.nodes) == len(node_lines)
    if path.name.startswith("N-"):
        assert domain.configured and domain.domain_state in ("UP", "DOWN", "DEGRADED")
        indices = [node.index for node in domain.nodes]
        assert sorted(domain.connectivity) == indices
        assert all(sorted(row) == indices for row in domain.connectivity.values())
        # The legend ("C - Connected ...", "D - Disconnected ... triggreed") is never a node or a row.
        assert all(re.fullmatch(r"[0-9.]+", node.address) for node in domain.nodes)
        assert parse_imex_state(text) is None
        assert domain.warnings == []
    else:
        assert parse_imex_state(text) in IMEX_STATES


# --------------------------------------------------------------------------- topo -m content


def test_a100_with_ten_nics_in_tabs_and_a_nic_legend() -> None:
    topology = parse_topo_matrix(fixture_text(TOPO, A100_NICS))
    assert topology.warnings == []
    assert [gpu.index for gpu in topology.gpus] == list(range(8))
    assert topology.nics == [f"mlx5_{n}" for n in range(10)]
    for gpu in topology.gpus:
        assert gpu.paths == {peer: "NV12" for peer in range(8) if peer != gpu.index}
        assert gpu.links == {peer: 12 for peer in range(8) if peer != gpu.index}
        pair = gpu.index // 2 * 2
        assert gpu.nearest_nics == [f"mlx5_{pair}", f"mlx5_{pair + 1}"]
        assert gpu.nearest_path == "PXB"
        assert gpu.nics["mlx5_8"] == gpu.nics["mlx5_9"] == "SYS"
    gpu0 = topology.gpus[0]
    assert (gpu0.numa_node, gpu0.cpu_affinity) == (3, "48-63,176-191")
    assert gpu0.nics["mlx5_0"] == "PXB" and gpu0.nics["mlx5_2"] == "SYS"
    assert {gpu.index: gpu.numa_node for gpu in topology.gpus} == {0: 3, 1: 3, 2: 1, 3: 1, 4: 7, 5: 7, 6: 5, 7: 5}
    assert topology.gpus[4].cpu_affinity == "112-127,240-255"
    assert set(nvlink_groups(topology).values()) == {"nvl0"}


def test_h100_nv18_is_one_group_with_hyperthread_affinity() -> None:
    topology = parse_topo_matrix(fixture_text(TOPO, H100_NV18))
    assert len(topology.gpus) == 8 and topology.nics == []
    assert all(set(gpu.links.values()) == {18} and len(gpu.links) == 7 for gpu in topology.gpus)
    assert nvlink_groups(topology) == {i: "nvl0" for i in range(8)}
    assert (topology.gpus[0].cpu_affinity, topology.gpus[0].numa_node) == ("0-51,104-155", 0)
    assert (topology.gpus[7].cpu_affinity, topology.gpus[7].numa_node) == ("52-103,156-207", 1)
    assert all(gpu.nearest_nics == [] and gpu.nearest_path is None for gpu in topology.gpus)


def test_realigned_a100_reads_like_the_tab_one() -> None:
    topology = parse_topo_matrix(fixture_text(TOPO, A100_REALIGNED))
    assert len(topology.gpus) == 8
    assert all(len(gpu.links) == 7 and set(gpu.links.values()) == {12} for gpu in topology.gpus)
    assert [(g.cpu_affinity, g.numa_node) for g in topology.gpus] == [("0-23", 0)] * 4 + [("24-47", 1)] * 4


def test_two_gpus_on_an_nv2_bridge_are_one_group_without_numa() -> None:
    topology = parse_topo_matrix(fixture_text(TOPO, NV2))
    assert [(g.index, g.links, g.numa_node, g.cpu_affinity) for g in topology.gpus] == [
        (0, {1: 2}, None, "0-23"),
        (1, {0: 2}, None, "0-23"),
    ]
    assert nvlink_groups(topology) == {0: "nvl0", 1: "nvl0"}


def test_consumer_gpus_over_phb_have_no_nvlink() -> None:
    topology = parse_topo_matrix(fixture_text(TOPO, PHB))
    assert [(g.paths, g.links) for g in topology.gpus] == [({1: "PHB"}, {}), ({0: "PHB"}, {})]
    assert nvlink_groups(topology) == {0: "nvl0", 1: "nvl1"}


def test_ansi_header_with_one_extra_empty_cell() -> None:
    # The header is "\tESC[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA IDESC[0m" and the row
    # "GPU0\t X \t0-19\t0\t\tN/A": NUMA Affinity 0, GPU NUMA ID N/A.
    text = fixture_text(TOPO, ANSI)
    assert "\x1b[4m" in text
    topology = parse_topo_matrix(text)
    assert topology.warnings == []
    (gpu,) = topology.gpus
    assert (gpu.index, gpu.paths, gpu.links, gpu.numa_node, gpu.cpu_affinity) == (0, {}, {}, 0, "0-19")
    assert nvlink_groups(topology) == {0: "nvl0"}


def test_windows_has_empty_affinity_cells() -> None:
    topology = parse_topo_matrix(fixture_text(TOPO, WINDOWS))
    (gpu,) = topology.gpus
    assert (gpu.numa_node, gpu.cpu_affinity) == (None, None)


def test_old_style_nic_columns_and_a_nearer_path() -> None:
    # Drivers before the NIC legend named the NIC columns after the device itself.
    text = (
        "\tGPU0\tGPU1\tmlx5_0\tmlx5_1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV4\tPIX\tNODE\t0-7\t0\n"
        "GPU1\tNV4\t X \tNODE\tSYS\t0-7\t0\n"
        "mlx5_0\tPIX\tNODE\t X \tNODE\t\t\n"
        "mlx5_1\tNODE\tSYS\tNODE\t X \t\t\n"
    )
    topology = parse_topo_matrix(text)
    assert topology.warnings == []
    assert topology.nics == ["mlx5_0", "mlx5_1"]
    assert (topology.gpus[0].nearest_nics, topology.gpus[0].nearest_path) == (["mlx5_0"], "PIX")
    assert (topology.gpus[1].nearest_nics, topology.gpus[1].nearest_path) == (["mlx5_0"], "NODE")


def test_topology_without_a_header_or_with_nonsense() -> None:
    for text in ("", "garbage\n", "nvidia-smi: command not found\n", "Legend:\n  X = Self\n"):
        topology = parse_topo_matrix(text)
        assert topology.gpus == [] and topology.warnings
    shifted = parse_topo_matrix("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \t\tNV2\t0-3\nGPU1\tNV2\t X \t0-3\n")
    assert any("empty device cell" in w for w in shifted.warnings)
    assert shifted.gpus[0].links == {1: 2} and shifted.gpus[1].links == {0: 2}


# --------------------------------------------------------------------------- nvlink_groups


def test_two_nv2_pairs_are_two_groups() -> None:
    gpus = [
        TopoGpu(0, paths={1: "NV2", 2: "SYS", 3: "SYS"}, links={1: 2}),
        TopoGpu(1, paths={0: "NV2", 2: "SYS", 3: "SYS"}, links={0: 2}),
        TopoGpu(2, paths={0: "SYS", 1: "SYS", 3: "NV2"}, links={3: 2}),
        TopoGpu(3, paths={0: "SYS", 1: "SYS", 2: "NV2"}, links={2: 2}),
    ]
    assert nvlink_groups(Topology(gpus=gpus, nics=[], warnings=[])) == {0: "nvl0", 1: "nvl0", 2: "nvl2", 3: "nvl2"}


def test_groups_follow_chains_one_sided_links_and_ignore_absent_gpus() -> None:
    gpus = [
        TopoGpu(5, links={6: 1}),
        TopoGpu(6),  # its row lost the link: the other side still reports it
        TopoGpu(7, links={6: 2, 9: 4}),  # GPU 9 has no row
        TopoGpu(8, links={7: 0}),  # zero links are no link
    ]
    assert nvlink_groups(Topology(gpus=gpus)) == {5: "nvl5", 6: "nvl5", 7: "nvl5", 8: "nvl8"}
    assert nvlink_groups(Topology()) == {}


# --------------------------------------------------------------------------- IMEX


def test_imex_two_node_domain() -> None:
    domain = parse_imex_nodes(fixture_text(IMEX, "N-gh200-2node-domain-up-drv570.txt"))
    assert domain.nodes == [
        ImexNode(0, "10.136.206.47", "READY", None),
        ImexNode(1, "10.136.206.48", "READY", None),
    ]
    assert domain.domain_state == "UP" and domain.configured
    assert domain.connectivity == {0: {0: "C", 1: "C"}, 1: {0: "C", 1: "C"}}
    assert domain.warnings == []


def test_imex_one_node_domain() -> None:
    domain = parse_imex_nodes(fixture_text(IMEX, "N-gh200-1node-domain-up-drv570.txt"))
    assert domain.nodes == [ImexNode(0, "10.136.206.48", "READY", None)]
    assert (domain.domain_state, domain.connectivity) == ("UP", {0: {0: "C"}})


def test_imex_state_words() -> None:
    assert parse_imex_state(fixture_text(IMEX, "q-ready.txt")) == "READY"
    assert parse_imex_state(fixture_text(IMEX, "s-t2000-subscribe-ready.txt")) == "READY"
    assert parse_imex_state("WAITING_FOR_PEERS stopAtReady: 0\nkeepGoing: 1\nINIT_GPU\n") == "INIT_GPU"
    assert parse_imex_state("  ready \n") == "READY"
    assert parse_imex_state("SOME_NEW_STATE\n") == "SOME_NEW_STATE"
    assert parse_imex_state("SOME_NEW_STATE\nREADY\nOTHER_WORD\n") == "READY"
    for text in ("", "\n\n", "Query Status returned error code: 14\n", "nvidia-imex-ctl: not found", "ready now?"):
        assert parse_imex_state(text) is None


# Built from the newer (570.172+) layout SOURCES.md describes (legend rows !V! / !M!, a Version
# column): no such capture is in a citable repository file.
NEWER_DEGRADED = """Connectivity Table Legend:
I - Invalid - Node wasn't reachable, no connection status available
N - Never Connected
R - Recovering - Connection was lost, but clean up has not yet been triggered.
D - Disconnected - Connection was lost, and clean up has been triggreed.
A - Authenticating - If GSSAPI enabled, client has initiated mutual authentication.
!V! - Version mismatch, communication disabled.
!M! - Node map mismatch, communication disabled.
C - Connected - Ready for operation

6/1/2025 10:00:00.000
Nodes:
Node #0   - 10.0.0.1        - READY                - Version: 570.172
Node #1   - 10.0.0.2        - READY                - Version: 570.172
Node #2   - imex-node-03    - UNAVAILABLE          - Version: 570.148

 Nodes From\\To  0    1    2
       0        C    C    N
       1        C    C    !V!
       2        N    !V!  C
Domain State: DEGRADED
"""


def test_imex_newer_layout_degraded_with_marks() -> None:
    domain = parse_imex_nodes(NEWER_DEGRADED)
    assert domain.warnings == []
    assert domain.nodes == [
        ImexNode(0, "10.0.0.1", "READY", "570.172"),
        ImexNode(1, "10.0.0.2", "READY", "570.172"),
        ImexNode(2, "imex-node-03", "UNAVAILABLE", "570.148"),
    ]
    assert domain.domain_state == "DEGRADED"
    assert domain.connectivity[0] == {0: "C", 1: "C", 2: "N"}
    assert domain.connectivity[1][2] == "!V!" and domain.connectivity[2] == {0: "N", 1: "!V!", 2: "C"}
    assert parse_imex_state(NEWER_DEGRADED) is None


def test_imex_down_domain() -> None:
    text = NEWER_DEGRADED.replace("DEGRADED", "DOWN").replace(
        "10.0.0.2        - READY", "10.0.0.2        - UNAVAILABLE"
    )
    domain = parse_imex_nodes(text)
    assert domain.domain_state == "DOWN"
    assert [n.state for n in domain.nodes] == ["READY", "UNAVAILABLE", "UNAVAILABLE"]


def test_imex_not_configured() -> None:
    for text in ("Failed to read node configuration file\n", "ERROR: failed to read node configuration file /x\n"):
        domain = parse_imex_nodes(text)
        assert domain.configured is False
        assert domain.nodes == [] and domain.connectivity == {} and domain.domain_state is None


def test_imex_json() -> None:
    text = json.dumps(
        {
            "nodes": {
                "1": {
                    "status": "READY",
                    "host": "10.1.0.2",
                    "version": "580.30",
                    "connections": {"0": {"host": "10.1.0.1", "status": "CONNECTED"}, "1": {"status": "CONNECTED"}},
                },
                "0": {"status": "UNAVAILABLE", "host": "10.1.0.1", "connections": {"1": {"status": "DISCONNECTED"}}},
            },
            "timestamp": "5/22/2025 19:46:40.891",
            "status": "degraded",
        },
        indent=1,
    )
    domain = parse_imex_nodes(text)
    assert domain.domain_state == "DEGRADED" and domain.configured
    assert domain.nodes == [ImexNode(0, "10.1.0.1", "UNAVAILABLE", None), ImexNode(1, "10.1.0.2", "READY", "580.30")]
    assert domain.connectivity == {1: {0: "C", 1: "C"}, 0: {1: "D"}}
    listed = parse_imex_nodes(json.dumps({"status": "UP", "nodes": [{"ip": "10.2.0.1", "state": "READY"}]}))
    assert listed.domain_state == "UP" and listed.nodes == [ImexNode(0, "10.2.0.1", "READY", None)]
    assert parse_imex_nodes('{"status":"DOWN","other":"field"}').domain_state == "DOWN"
    for broken in ('{"status":}', "[1, 2]", '{"nodes": 3}', '{"nodes": {"x": 1}}'):
        assert_domain(parse_imex_nodes(broken))
        assert parse_imex_nodes(broken).warnings


# --------------------------------------------------------------------------- imex_channels


def test_imex_channels(tmp_path: Path) -> None:
    assert imex_channels(str(tmp_path)) is None
    directory = tmp_path / "dev" / "nvidia-caps-imex-channels"
    directory.mkdir(parents=True)
    assert imex_channels(str(tmp_path)) == []
    for name in ("channel3", "channel0", "README", "channelX", "channel", "xchannel1"):
        (directory / name).write_text("")
    assert imex_channels(str(tmp_path)) == [0, 3]
    (tmp_path / "file-root").write_text("")
    assert imex_channels(str(tmp_path / "file-root")) is None


# --------------------------------------------------------------------------- mutated fixtures


def mutations(text: str, seed: int) -> list[str]:
    """Fixed-seed damage of a fixture: truncations, dropped, duplicated and swapped lines,
    flipped bytes, replaced digits, inserted garbage and NULs, a huge line, other line ends."""
    rng = random.Random(seed)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    for step in range(1, 8):
        out.append(text[: len(text) * step // 8])
    out += [text[: rng.randrange(len(text) + 1)] for _ in range(4)]
    for _ in range(6):
        kept = [line for line in lines if rng.random() > 0.25]
        out.append("".join(kept))
    for _ in range(4):
        chars = list(text)
        for _ in range(max(1, len(chars) // 40)):
            if chars:
                chars[rng.randrange(len(chars))] = chr(rng.randrange(256))
        out.append("".join(chars))
    for _ in range(3):
        copy = list(lines)
        for _ in range(3):
            if copy:
                i = rng.randrange(len(copy))
                copy.insert(i, copy[i])
        out.append("".join(copy))
    if len(lines) > 1:
        copy = list(lines)
        i, j = rng.randrange(len(copy)), rng.randrange(len(copy))
        copy[i], copy[j] = copy[j], copy[i]
        out.append("".join(copy))
    out.append(re.sub(r"[0-9]", lambda _: str(rng.randrange(10)), text))
    out.append(re.sub(r"[0-9]+", "99999999999999999999999999", text))
    out.append(re.sub(r"[0-9]", "", text))
    garbage = ["\x00", "\x00\x00\x00", "\x1b[31m", "\ufffd", "{", "}", "-", "#", "GPU0", "NV", "Node #", "\t\t"]
    for _ in range(4):
        copy = list(lines)
        for _ in range(5):
            copy.insert(rng.randrange(len(copy) + 1), rng.choice(garbage) + rng.choice(["", "\n"]))
        out.append("".join(copy))
    middle = len(lines) // 2
    out.append("".join(lines[:middle]) + "NV12\t" * 20000 + "\n" + "".join(lines[middle:]))
    out.append("".join(lines[:middle]) + "x" * 200_000 + "".join(lines[middle:]))
    out.append(text.replace("\n", "\r\n"))
    out.append(text.replace("\n", "\r"))
    out.append(text.replace("\t", "    "))
    out.append(re.sub(r" {2,}", "\t", text))
    out.append("\ufeff" + text)
    return out


@pytest.mark.parametrize("path", ALL_FILES)
def test_mutated_fixtures_never_raise(path: Path) -> None:
    text = read_text(path)
    for variant in mutations(text, seed=sum(map(ord, path.name))):
        parse_everything(variant)


@pytest.mark.parametrize("path", fixture_files(TOPO, "p2p-*"))
def test_mutated_p2p_matrices_never_gain_nvlinks(path: Path) -> None:
    for variant in mutations(read_text(path), seed=7):
        assert all(gpu.links == {} for gpu in parse_topo_matrix(variant).gpus)


@settings(max_examples=examples(150), deadline=None)
@given(st.text(max_size=300))
def test_fuzzed_text_never_raises(text: str) -> None:
    parse_everything(text)
    parse_everything("\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\n" + text)
    parse_everything(" Nodes From\\To  0  1\n" + text)
    parse_everything("{" + text)
