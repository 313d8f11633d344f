"""Synthetic fabrics written as ``ibnetdiscover`` text: the project's own generated fabrics.

The fabric is built from scalable units (SUs): each SU holds ``hosts_per_su`` hosts with
``rails`` adapters each (``mlx5_0`` … named as rdma-core names them) and its leaves. A pod is
``sus_per_pod`` SUs and ``spines_per_pod`` spines, every leaf cabled to every spine of its pod with
``uplinks / spines_per_pod`` parallel cables. With ``cores_per_group`` > 0, spine j of every pod is
cabled to each core of group j (a third tier, as in a SuperPOD); with 0 the tree stops at the
spines. Every switch also carries a SHARP aggregation node on its last port, as Quantum switches do.

How hosts meet their leaves is the site's plan, and each SU follows it:

- by default each adapter has its own leaf: adapter N of every host in the SU on the SU's rail-N
  leaf (rail-optimised);
- ``planes=2``: the adapters spread over two leaves, adapter N on leaf N mod 2 (adapters 1 and 3
  of ``mlx5_0 … mlx5_3`` on one leaf, 2 and 4 on the other: four adapters over two planes);
- ``rails_per_leaf=2``: adapters 2k and 2k+1 share leaf k, so each leaf carries two rails of the
  same hosts half-and-half.

Other designs met on real fabrics:

- ``director=True``: the spines are a director's line-card ASICs and the cores its spine ASICs
  (``MF0;dirN:CS7500/L01/U1``), every line ASIC of a pod cabled to every spine ASIC of it;
- ``hostless_leaves=N``: N more stand-alone switches per pod at the leaf layer with no host,
  cabled to the spines exactly as the host leaves are;
- ``host_rate="4xSDR"``: every host cable trained at that rate (the rest run ``rate``);
- ``storage_on_spine="nfs01"``: a host of that name with one dual-port adapter, both ports on
  the first spine of the first pod;
- ``rate``, ``switch_devid`` and ``adapter_devid`` for other generations (QDR, EDR …).

The text follows rdma-core ``ibnetdiscover.c`` byte for byte in layout: switches first, then
adapters, every cable printed from both ends, tabs where the tool puts them.

``swap_host`` swaps that host's first adapter with the next one that goes to another leaf (a
cabling mistake); ``slow`` runs one cable below the rate of the rest: ``"spine"`` (the first
leaf's first uplink at 4xEDR) or ``"adapter"`` (the first host's first adapter at 2xHDR).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CX2_DEVID",
    "CX4_DEVID",
    "CX6_DEVID",
    "INFINISCALE4_DEVID",
    "QUANTUM_DEVID",
    "SWITCHIB_DEVID",
    "FatTree",
    "fat_tree",
]

QUANTUM_DEVID = 0xD2F0
SWITCHIB_DEVID = 0xCB20
INFINISCALE4_DEVID = 0xBD36
CX6_DEVID = 0x101B
CX4_DEVID = 0x1013
CX2_DEVID = 0x673C
SWITCH_BASE = 0x0C42A10300000000
ADAPTER_BASE = 0xB8599F0300000000
STORAGE_BASE = 0xE41D2D0300000000
AN_BASE = 0x043F720300000000

Cable = tuple[str, int, str, int]


@dataclass
class _Node:
    guid: int
    desc: str
    switch: bool
    lid: int
    devid: int
    nports: int = 0
    #: Port -> (peer GUID, peer port, rate).
    ports: dict[int, tuple[int, int, str]] = field(default_factory=dict)
    #: Port -> port GUID, for an adapter port whose GUID is not the node's.
    port_guids: dict[int, int] = field(default_factory=dict)

    def port_guid(self, port: int) -> int:
        return self.port_guids.get(port, self.guid)


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
    slow: Cable | None
    #: Connected ports (each cable counts twice), aggregation nodes included.
    ports: int
    cables: int
    #: Every cable that runs below what its ends can, as (switch GUID, port, other GUID, port).
    slow_cables: list[Cable] = field(default_factory=list)
    #: (host, rail) of each adapter cabled to a leaf its peers put another rail on.
    crossed: list[tuple[str, int]] = field(default_factory=list)
    #: GUIDs of the leaves without hosts.
    hostless: list[str] = field(default_factory=list)
    #: Hosts that are not compute nodes (the storage node).
    storage: list[str] = field(default_factory=list)


def _g(value: int) -> str:
    return f"0x{value:016x}"


class _Builder:
    """Nodes and cables; ports are numbered in the order cables are added."""

    def __init__(self) -> None:
        self.nodes: dict[int, _Node] = {}
        self.lid = 1
        self.cables = 0
        self.switch_count = 0

    def add(self, guid: int, desc: str, *, switch: bool, devid: int) -> _Node:
        node = _Node(guid, desc, switch, self.lid, devid)
        self.nodes[guid] = node
        self.lid += 1
        return node

    def switch(self, desc: str, devid: int) -> _Node:
        self.switch_count += 1
        return self.add(SWITCH_BASE + self.switch_count * 0x10, desc, switch=True, devid=devid)

    def cable(self, a: _Node, b: _Node, rate: str, *, a_port: int | None = None, b_port: int | None = None) -> Cable:
        ap = a_port if a_port is not None else len(a.ports) + 1
        bp = b_port if b_port is not None else len(b.ports) + 1
        assert ap not in a.ports and bp not in b.ports, (a.desc, ap, b.desc, bp)
        a.ports[ap] = (b.guid, bp, rate)
        b.ports[bp] = (a.guid, ap, rate)
        self.cables += 1
        return (_g(a.guid), ap, _g(b.guid), bp)


def _leaf_slot(rail: int, planes: int, rails_per_leaf: int) -> int:
    return rail % planes if planes else rail // rails_per_leaf


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
    planes: int = 0,
    rails_per_leaf: int = 1,
    hostless_leaves: int = 0,
    director: bool = False,
    rate: str = "4xHDR",
    host_rate: str | None = None,
    switch_devid: int = QUANTUM_DEVID,
    adapter_devid: int = CX6_DEVID,
    storage_on_spine: str | None = None,
) -> FatTree:
    build = _Builder()
    tiers: dict[str, str] = {}
    slots = planes if planes else -(-rails // rails_per_leaf)
    per_spine = uplinks // spines_per_pod

    leaf_grid: dict[tuple[int, int, int], _Node] = {}
    hostless: list[_Node] = []
    spines: dict[tuple[int, int], _Node] = {}
    cores: dict[tuple[int, int], _Node] = {}
    for p in range(pods):
        for su in range(sus_per_pod):
            for slot in range(slots):
                leaf_grid[(p, su, slot)] = build.switch(f"lf-p{p + 1}-su{su + 1}-r{slot}", switch_devid)
        hostless += [build.switch(f"lf-p{p + 1}-x{x + 1}", switch_devid) for x in range(hostless_leaves)]
        for j in range(spines_per_pod):
            name = f"MF0;dir{p + 1}:CS7500/L{j + 1:02d}/U1" if director else f"sp-p{p + 1}-{j + 1:02d}"
            spines[(p, j)] = build.switch(name, switch_devid)
    if director:
        for p in range(pods):
            for c in range(cores_per_group):
                cores[(p, c)] = build.switch(f"MF0;dir{p + 1}:CS7500/S{c + 1:02d}/U1", switch_devid)
    elif cores_per_group:
        for j in range(spines_per_pod):
            for c in range(cores_per_group):
                cores[(j, c)] = build.switch(f"core-g{j + 1}-{c + 1:02d}", switch_devid)
    for node in leaf_grid.values():
        tiers[_g(node.guid)] = "leaf"
    for node in hostless:
        tiers[_g(node.guid)] = "leaf"
    for node in spines.values():
        tiers[_g(node.guid)] = "spine"
    for node in cores.values():
        tiers[_g(node.guid)] = "core"

    # Hosts first, so that leaf ports 1 … carry the hosts and the uplinks follow.
    hosts: list[str] = []
    port_guids: dict[tuple[str, int], str] = {}
    leaf_of: dict[tuple[str, int], str] = {}
    slow_cables: list[Cable] = []
    crossed: list[tuple[str, int]] = []
    slow_cable: Cable | None = None
    adapter_count = 0
    for p in range(pods):
        for su in range(sus_per_pod):
            for _h in range(hosts_per_su):
                host = f"gpu{len(hosts) + 1:04d}"
                hosts.append(host)
                order = [_leaf_slot(r, planes, rails_per_leaf) for r in range(rails)]
                if host == swap_host:
                    other = next((r for r in range(1, rails) if order[r] != order[0]), None)
                    if other is not None:
                        order[0], order[other] = order[other], order[0]
                        crossed += [(host, 0), (host, other)]
                for r in range(rails):
                    adapter_count += 1
                    adapter = build.add(
                        ADAPTER_BASE + adapter_count, f"{host} mlx5_{r}", switch=False, devid=adapter_devid
                    )
                    leaf = leaf_grid[(p, su, order[r])]
                    cable_rate = host_rate or rate
                    if slow == "adapter" and slow_cable is None:
                        cable_rate = "2xHDR"
                    made = build.cable(leaf, adapter, cable_rate, b_port=1)
                    if slow == "adapter" and slow_cable is None:
                        slow_cable = made
                    if host_rate:
                        slow_cables.append(made)
                    port_guids[(host, r)] = _g(adapter.guid)
                    leaf_of[(host, r)] = _g(leaf.guid)
    for p in range(pods):
        pod_leaves = [node for (lp, _su, _slot), node in leaf_grid.items() if lp == p]
        pod_leaves += hostless[p * hostless_leaves : (p + 1) * hostless_leaves]
        for leaf in pod_leaves:
            for j in range(spines_per_pod):
                for _k in range(per_spine):
                    cable_rate = rate
                    if slow == "spine" and slow_cable is None:
                        cable_rate = "4xEDR"
                    made = build.cable(leaf, spines[(p, j)], cable_rate)
                    if slow == "spine" and slow_cable is None:
                        slow_cable = made
    storage: list[str] = []
    if storage_on_spine:
        storage.append(storage_on_spine)
        node = build.add(STORAGE_BASE + 0x10, f"{storage_on_spine} mlx4_0", switch=False, devid=adapter_devid)
        node.port_guids = {1: node.guid + 1, 2: node.guid + 2}
        for port in (1, 2):
            build.cable(spines[(0, 0)], node, host_rate or rate, b_port=port)
    if director:
        for (p, _c), core in cores.items():
            for j in range(spines_per_pod):
                build.cable(spines[(p, j)], core, rate)
    elif cores_per_group:
        per_pair = len([n for (lp, _s, _r), n in leaf_grid.items() if lp == 0]) * per_spine // cores_per_group
        per_pair = max(per_pair, 1)
        for (_p, j), spine in spines.items():
            for c in range(cores_per_group):
                for _k in range(per_pair):
                    build.cable(spine, cores[(j, c)], rate)
    for switch in [n for n in build.nodes.values() if n.switch]:
        switch.nports = len(switch.ports) + 1
        an = build.add(
            AN_BASE + switch.guid - SWITCH_BASE + 8,
            "Mellanox Technologies Aggregation Node",
            switch=False,
            devid=0xCF09,
        )
        build.cable(switch, an, rate, a_port=switch.nports, b_port=1)
    for node in build.nodes.values():
        if not node.switch:
            node.nports = max(node.ports)
    if slow_cable is not None:
        slow_cables.append(slow_cable)

    return FatTree(
        text=_write(build.nodes),
        hosts=hosts,
        rails=rails,
        port_guid=port_guids,
        leaf=leaf_of,
        tiers=tiers,
        slow=slow_cable,
        ports=2 * build.cables,
        cables=build.cables,
        slow_cables=sorted(slow_cables),
        crossed=sorted(crossed),
        hostless=[_g(n.guid) for n in hostless],
        storage=storage,
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
                        f'[{port}]\t"H-{peer.guid:016x}"[{peer_port}]({peer.port_guid(peer_port):x}) '
                        f'\t\t# "{peer.desc}" lid {peer.lid} {rate}'
                    )
        else:
            out.append(f"caguid=0x{node.guid:x}")
            out.append(f'Ca\t{node.nports} "H-{node.guid:016x}"\t\t# "{node.desc}"')
            for port in sorted(node.ports):
                peer_guid, peer_port, rate = node.ports[port]
                peer = nodes[peer_guid]
                out.append(
                    f'[{port}]({node.port_guid(port):x}) \t"S-{peer.guid:016x}"[{peer_port}]'
                    f'\t\t# lid {node.lid} lmc 0 "{peer.desc}" lid {peer.lid} {rate}'
                )
    out.append("")
    return "\n".join(out)
