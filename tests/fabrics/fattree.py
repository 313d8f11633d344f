"""Synthetic rail-optimised fat trees written as ``ibnetdiscover`` text.

The fabric is built from scalable units (SUs): each SU holds ``hosts_per_su`` hosts with
``rails`` adapters each (``mlx5_0`` … named as rdma-core names them), and one leaf per rail, so
adapter N of every host in the SU is cabled to the SU's rail-N leaf. A pod is ``sus_per_pod`` SUs
and ``spines_per_pod`` spines, every leaf cabled to every spine of its pod with ``uplinks /
spines_per_pod`` parallel cables. With ``cores_per_group`` > 0, spine j of every pod is cabled to
each core of group j (a third tier, as in a SuperPOD); with 0 the tree stops at the spines. Every
switch also carries a SHARP aggregation node on its last port, as Quantum switches do.

The text follows rdma-core ``ibnetdiscover.c`` byte for byte in layout: switches first, then
adapters, every cable printed from both ends, tabs where the tool puts them.

``swap_host`` swaps that host's first two adapters between their rail leaves (a cabling mistake);
``slow`` runs one cable below the rate of the rest: ``"spine"`` (the first leaf's first uplink at
4xEDR) or ``"adapter"`` (the first host's first adapter at 2xHDR).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FatTree", "fat_tree"]

QUANTUM_DEVID = 0xD2F0
CX6_DEVID = 0x101B
SWITCH_BASE = 0x0C42A10300000000
ADAPTER_BASE = 0xB8599F0300000000
AN_BASE = 0x043F720300000000


@dataclass
class _Node:
    guid: int
    desc: str
    switch: bool
    nports: int
    lid: int
    devid: int
    ports: dict[int, tuple[int, int, str]] = field(default_factory=dict)


@dataclass
class FatTree:
    """The text and what it is known to contain."""

    text: str
    hosts: list[str]
    rails: int
    #: (host, rail) -> port GUID and leaf GUID, as ``"0x%016x"``.
    port_guid: dict[tuple[str, int], str]
    leaf: dict[tuple[str, int], str]
    #: Switch GUID -> "leaf", "spine" or "core".
    tiers: dict[str, str]
    #: The slow cable as (a GUID, a port, b GUID, b port), or None.
    slow: tuple[str, int, str, int] | None
    #: Connected ports (each cable counts twice), aggregation nodes included.
    ports: int
    cables: int


def _g(value: int) -> str:
    return f"0x{value:016x}"


def fat_tree(
    *,
    pods: int = 2,
    sus_per_pod: int = 1,
    hosts_per_su: int = 4,
    rails: int = 4,
    spines_per_pod: int = 2,
    uplinks: int = 4,
    cores_per_group: int = 2,
    swap_host: str | None = None,
    slow: str | None = None,
) -> FatTree:
    nodes: dict[int, _Node] = {}
    lid = 1
    cables = 0

    def add(guid: int, desc: str, *, switch: bool, nports: int) -> _Node:
        nonlocal lid
        node = _Node(guid, desc, switch, nports, lid, QUANTUM_DEVID if switch else CX6_DEVID)
        nodes[guid] = node
        lid += 1
        return node

    def cable(a: _Node, ap: int, b: _Node, bp: int, rate: str = "4xHDR") -> None:
        nonlocal cables
        assert ap not in a.ports and bp not in b.ports, (a.desc, ap, b.desc, bp)
        a.ports[ap] = (b.guid, bp, rate)
        b.ports[bp] = (a.guid, ap, rate)
        cables += 1

    per_spine = uplinks // spines_per_pod
    leaves_per_pod = sus_per_pod * rails
    spine_down = leaves_per_pod * per_spine
    per_pair = spine_down // cores_per_group if cores_per_group else 0
    leaf_ports = hosts_per_su + uplinks
    spine_ports = spine_down + cores_per_group * per_pair
    core_ports = pods * per_pair
    switch_count = 0

    def new_switch(desc: str, radix: int) -> _Node:
        nonlocal switch_count
        switch_count += 1
        return add(SWITCH_BASE + switch_count * 0x10, desc, switch=True, nports=radix + 1)

    tiers: dict[str, str] = {}
    leaf_grid: dict[tuple[int, int, int], _Node] = {}
    spines: dict[tuple[int, int], _Node] = {}
    cores: dict[tuple[int, int], _Node] = {}
    for p in range(pods):
        for su in range(sus_per_pod):
            for r in range(rails):
                node = new_switch(f"lf-p{p + 1}-su{su + 1}-r{r}", leaf_ports)
                leaf_grid[(p, su, r)] = node
                tiers[_g(node.guid)] = "leaf"
        for j in range(spines_per_pod):
            node = new_switch(f"sp-p{p + 1}-{j + 1:02d}", spine_ports)
            spines[(p, j)] = node
            tiers[_g(node.guid)] = "spine"
    if cores_per_group:
        for j in range(spines_per_pod):
            for c in range(cores_per_group):
                node = new_switch(f"core-g{j + 1}-{c + 1:02d}", core_ports)
                cores[(j, c)] = node
                tiers[_g(node.guid)] = "core"

    slow_cable: tuple[str, int, str, int] | None = None
    for (p, _su, _r), leaf in leaf_grid.items():
        position = sorted(k for k in leaf_grid if k[0] == p).index((p, _su, _r))
        for j in range(spines_per_pod):
            spine = spines[(p, j)]
            for k in range(per_spine):
                leaf_port = hosts_per_su + j * per_spine + k + 1
                spine_port = position * per_spine + k + 1
                rate = "4xHDR"
                if slow == "spine" and slow_cable is None:
                    rate = "4xEDR"
                    slow_cable = (_g(leaf.guid), leaf_port, _g(spine.guid), spine_port)
                cable(leaf, leaf_port, spine, spine_port, rate)
    if cores_per_group:
        for (p, j), spine in spines.items():
            for c in range(cores_per_group):
                core = cores[(j, c)]
                for k in range(per_pair):
                    spine_port = spine_down + c * per_pair + k + 1
                    core_port = p * per_pair + k + 1
                    cable(spine, spine_port, core, core_port)

    hosts: list[str] = []
    port_guids: dict[tuple[str, int], str] = {}
    leaf_of: dict[tuple[str, int], str] = {}
    adapter_count = 0
    for p in range(pods):
        for su in range(sus_per_pod):
            for h in range(hosts_per_su):
                host = f"gpu{len(hosts) + 1:04d}"
                hosts.append(host)
                order = list(range(rails))
                if host == swap_host and rails >= 2:
                    order[0], order[1] = order[1], order[0]
                for r in range(rails):
                    adapter_count += 1
                    adapter = add(ADAPTER_BASE + adapter_count, f"{host} mlx5_{r}", switch=False, nports=1)
                    leaf = leaf_grid[(p, su, order[r])]
                    rate = "4xHDR"
                    if slow == "adapter" and slow_cable is None:
                        rate = "2xHDR"
                        slow_cable = (_g(leaf.guid), h + 1, _g(adapter.guid), 1)
                    cable(leaf, h + 1, adapter, 1, rate)
                    port_guids[(host, r)] = _g(adapter.guid)
                    leaf_of[(host, r)] = _g(leaf.guid)
    for switch in [n for n in nodes.values() if n.switch]:
        an = add(
            AN_BASE + switch.guid - SWITCH_BASE + 8, "Mellanox Technologies Aggregation Node", switch=False, nports=1
        )
        cable(switch, switch.nports, an, 1)

    text = _write(nodes)
    return FatTree(
        text=text,
        hosts=hosts,
        rails=rails,
        port_guid=port_guids,
        leaf=leaf_of,
        tiers=tiers,
        slow=slow_cable,
        ports=2 * cables,
        cables=cables,
    )


def _write(nodes: dict[int, _Node]) -> str:
    first = next(n for n in nodes.values() if not n.switch)
    out = [
        "#",
        "# Topology file: generated on Mon Sep 28 10:00:00 2026",
        "#",
        f"# Initiated from node {first.guid:016x} port {first.guid:016x}",
    ]
    for node in sorted(nodes.values(), key=lambda n: not n.switch):
        out.append("")
        out.append("vendid=0x2c9")
        out.append(f"devid=0x{node.devid:x}")
        out.append(f"sysimgguid=0x{node.guid:x}")
        if node.switch:
            out.append(f"switchguid=0x{node.guid:x}({node.guid:x})")
            out.append(
                f'Switch\t{node.nports} "S-{node.guid:016x}"\t\t# "{node.desc}" enhanced port 0 lid {node.lid} lmc 0'
            )
            for port in sorted(node.ports):
                peer_guid, peer_port, rate = node.ports[port]
                peer = nodes[peer_guid]
                if peer.switch:
                    out.append(f'[{port}]\t"S-{peer.guid:016x}"[{peer_port}]\t\t# "{peer.desc}" lid {peer.lid} {rate}')
                else:
                    out.append(
                        f'[{port}]\t"H-{peer.guid:016x}"[{peer_port}]({peer.guid:x}) '
                        f'\t\t# "{peer.desc}" lid {peer.lid} {rate}'
                    )
        else:
            out.append(f"caguid=0x{node.guid:x}")
            out.append(f'Ca\t{node.nports} "H-{node.guid:016x}"\t\t# "{node.desc}"')
            for port in sorted(node.ports):
                peer_guid, peer_port, rate = node.ports[port]
                peer = nodes[peer_guid]
                out.append(
                    f'[{port}]({node.guid:x}) \t"S-{peer.guid:016x}"[{peer_port}]'
                    f'\t\t# lid {node.lid} lmc 0 "{peer.desc}" lid {peer.lid} {rate}'
                )
    out.append("")
    return "\n".join(out)
