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


@dataclass(frozen=True)
class _Design:
    """The options of ``fat_tree`` (see the module docstring)."""

    pods: int
    sus_per_pod: int
    hosts_per_su: int
    rails: int
    spines_per_pod: int
    uplinks: int
    cores_per_group: int
    swap_host: str | None
    slow: str | None
    planes: int
    rails_per_leaf: int
    hostless_leaves: int
    director: bool
    rate: str
    host_rate: str | None
    switch_devid: int
    adapter_devid: int
    storage_on_spine: str | None

    @property
    def slots(self) -> int:
        """Leaves per unit."""
        return self.planes if self.planes else -(-self.rails // self.rails_per_leaf)

    def slot(self, rail: int) -> int:
        """The leaf of the unit that adapter ``rail`` of every host goes to."""
        return rail % self.planes if self.planes else rail // self.rails_per_leaf


class _Tree:
    """One fabric being built: switches first, then the cables in the order ports are numbered
    (hosts, uplinks, the storage node, cores, aggregation nodes)."""

    def __init__(self, design: _Design) -> None:
        self.d = design
        self.build = _Builder()
        self.tiers: dict[str, str] = {}
        self.leaf_grid: dict[tuple[int, int, int], _Node] = {}
        self.hostless: list[_Node] = []
        self.spines: dict[tuple[int, int], _Node] = {}
        self.cores: dict[tuple[int, int], _Node] = {}
        self.hosts: list[str] = []
        self.port_guids: dict[tuple[str, int], str] = {}
        self.leaf_of: dict[tuple[str, int], str] = {}
        self.slow_cables: list[Cable] = []
        self.crossed: list[tuple[str, int]] = []
        self.slow_cable: Cable | None = None
        self.storage: list[str] = []

    def switch(self, desc: str, tier: str) -> _Node:
        node = self.build.switch(desc, self.d.switch_devid)
        self.tiers[_g(node.guid)] = tier
        return node

    def switches(self) -> None:
        d = self.d
        for p in range(d.pods):
            for su in range(d.sus_per_pod):
                for slot in range(d.slots):
                    self.leaf_grid[(p, su, slot)] = self.switch(f"lf-p{p + 1}-su{su + 1}-r{slot}", "leaf")
            self.hostless += [self.switch(f"lf-p{p + 1}-x{x + 1}", "leaf") for x in range(d.hostless_leaves)]
            for j in range(d.spines_per_pod):
                name = f"MF0;dir{p + 1}:CS7500/L{j + 1:02d}/U1" if d.director else f"sp-p{p + 1}-{j + 1:02d}"
                self.spines[(p, j)] = self.switch(name, "spine")
        if d.director:
            for p in range(d.pods):
                for c in range(d.cores_per_group):
                    self.cores[(p, c)] = self.switch(f"MF0;dir{p + 1}:CS7500/S{c + 1:02d}/U1", "core")
        else:
            for j in range(d.spines_per_pod if d.cores_per_group else 0):
                for c in range(d.cores_per_group):
                    self.cores[(j, c)] = self.switch(f"core-g{j + 1}-{c + 1:02d}", "core")

    def host(self, p: int, su: int) -> None:
        """One host of unit ``su`` of pod ``p``, its adapters cabled to the unit's leaves."""
        d = self.d
        host = f"gpu{len(self.hosts) + 1:04d}"
        self.hosts.append(host)
        order = [d.slot(r) for r in range(d.rails)]
        if host == d.swap_host:
            other = next((r for r in range(1, d.rails) if order[r] != order[0]), None)
            if other is not None:
                order[0], order[other] = order[other], order[0]
                self.crossed += [(host, 0), (host, other)]
        for r in range(d.rails):
            adapter = self.build.add(
                ADAPTER_BASE + len(self.port_guids) + 1, f"{host} mlx5_{r}", switch=False, devid=d.adapter_devid
            )
            leaf = self.leaf_grid[(p, su, order[r])]
            slow = d.slow == "adapter" and self.slow_cable is None
            made = self.build.cable(leaf, adapter, "2xHDR" if slow else d.host_rate or d.rate, b_port=1)
            if slow:
                self.slow_cable = made
            if d.host_rate:
                self.slow_cables.append(made)
            self.port_guids[(host, r)] = _g(adapter.guid)
            self.leaf_of[(host, r)] = _g(leaf.guid)

    def uplinks(self) -> None:
        """Every leaf of a pod (hosts or not) to every spine of it, ``uplinks / spines`` cables each."""
        d = self.d
        for p in range(d.pods):
            pod_leaves = [node for (lp, _su, _slot), node in self.leaf_grid.items() if lp == p]
            pod_leaves += self.hostless[p * d.hostless_leaves : (p + 1) * d.hostless_leaves]
            for leaf in pod_leaves:
                for j in range(d.spines_per_pod):
                    for _k in range(d.uplinks // d.spines_per_pod):
                        slow = d.slow == "spine" and self.slow_cable is None
                        made = self.build.cable(leaf, self.spines[(p, j)], "4xEDR" if slow else d.rate)
                        if slow:
                            self.slow_cable = made

    def storage_node(self) -> None:
        """A node with one dual-port adapter, both ports on the first spine."""
        d = self.d
        if not d.storage_on_spine:
            return
        self.storage.append(d.storage_on_spine)
        node = self.build.add(STORAGE_BASE + 0x10, f"{d.storage_on_spine} mlx4_0", switch=False, devid=d.adapter_devid)
        node.port_guids = {1: node.guid + 1, 2: node.guid + 2}
        for port in (1, 2):
            self.build.cable(self.spines[(0, 0)], node, d.host_rate or d.rate, b_port=port)

    def core_cables(self) -> None:
        """A director: each line ASIC (spine) to each spine ASIC (core) of its chassis. Otherwise
        spine j of every pod to each core of group j."""
        d = self.d
        if d.director:
            for (p, _c), core in self.cores.items():
                for j in range(d.spines_per_pod):
                    self.build.cable(self.spines[(p, j)], core, d.rate)
            return
        if not d.cores_per_group:
            return
        leaves_per_pod = d.sus_per_pod * d.slots
        per_pair = max(leaves_per_pod * (d.uplinks // d.spines_per_pod) // d.cores_per_group, 1)
        for (_p, j), spine in self.spines.items():
            for c in range(d.cores_per_group):
                for _k in range(per_pair):
                    self.build.cable(spine, self.cores[(j, c)], d.rate)

    def aggregation_nodes(self) -> None:
        """A SHARP aggregation node on each switch's last port, as Quantum switches have."""
        for switch in [n for n in self.build.nodes.values() if n.switch]:
            switch.nports = len(switch.ports) + 1
            an = self.build.add(
                AN_BASE + switch.guid - SWITCH_BASE + 8,
                "Mellanox Technologies Aggregation Node",
                switch=False,
                devid=0xCF09,
            )
            self.build.cable(switch, an, self.d.rate, a_port=switch.nports, b_port=1)
        for node in self.build.nodes.values():
            if not node.switch:
                node.nports = max(node.ports)

    def result(self) -> FatTree:
        slow_cables = self.slow_cables + ([self.slow_cable] if self.slow_cable is not None else [])
        return FatTree(
            text=_write(self.build.nodes),
            hosts=self.hosts,
            rails=self.d.rails,
            port_guid=self.port_guids,
            leaf=self.leaf_of,
            tiers=self.tiers,
            slow=self.slow_cable,
            ports=2 * self.build.cables,
            cables=self.build.cables,
            slow_cables=sorted(slow_cables),
            crossed=sorted(self.crossed),
            hostless=[_g(n.guid) for n in self.hostless],
            storage=self.storage,
        )


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
    """The fabric the options describe (see the module docstring), and what it is known to hold."""
    tree = _Tree(
        _Design(
            pods=pods,
            sus_per_pod=sus_per_pod,
            hosts_per_su=hosts_per_su,
            rails=rails,
            spines_per_pod=spines_per_pod,
            uplinks=uplinks,
            cores_per_group=cores_per_group,
            swap_host=swap_host,
            slow=slow,
            planes=planes,
            rails_per_leaf=rails_per_leaf,
            hostless_leaves=hostless_leaves,
            director=director,
            rate=rate,
            host_rate=host_rate,
            switch_devid=switch_devid,
            adapter_devid=adapter_devid,
            storage_on_spine=storage_on_spine,
        )
    )
    tree.switches()
    # Hosts first, so that leaf ports 1 … carry the hosts and the uplinks follow.
    for p in range(pods):
        for su in range(sus_per_pod):
            for _h in range(hosts_per_su):
                tree.host(p, su)
    tree.uplinks()
    tree.storage_node()
    tree.core_cables()
    tree.aggregation_nodes()
    return tree.result()


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
