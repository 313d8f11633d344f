"""Placement by physical fabric: the pre-filter and scorer the fabrics app registers (no Django).

Each node's snapshot carries `extra["fabrics"]` (FABRICS, a list of FabricAttachment): one
attachment per fabric name it declares, as the control plane last worked it out from the node's
ports (apps.fabrics.services) or the simulator describes it:

    {"name": "ib-a", "kind": "ib", "identity": "ib:0x0002c90300a1b2c3" | None,
     "problem": "" | why the node cannot be placed on it,
     "hcas": ["mlx5_0", "mlx5_1"], "netdevs": ["ib0"], "leaf": "0x..." | None,
     "leaf_name": "lf01", "short": False}

A replica across nodes is formed inside one physical fabric (`identity`), whatever names the
nodes give it: two names of one fabric are one group, one name over two fabrics two groups. A
node whose identity is unknown (its ports are up but no subnet manager answered it yet) is
grouped with the other unknown nodes of that name only, never with nodes that could say. An
attachment with a `problem` (its adapters for the name sit on two fabrics) is no group at all.
Inside a fabric the nodes of one leaf are preferred when the whole replica fits in it, and a
node whose cable trained below its kind's rate scores lower than one that did not.

A multi-node NVLink domain (`extra["nvlink"]`: NVLINK, an NvlinkPart, apps.fabrics.nvlink) is a
fabric of its own, of a lower tier: a replica that fits whole among a domain's ready nodes (every card joined, IMEX up)
is formed there before any InfiniBand fabric is tried, and its shards are told to use NVLink. A
domain's node that is not ready can still take a shard over InfiniBand; explain says what kept
it out of its domain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NotRequired, TypedDict

from apps.cluster.placement import (
    REGISTRY,
    Inventory,
    NodeSnapshot,
    PlacementContext,
    PreFilterResult,
    Reason,
    Registry,
    SnapshotField,
    gettext_noop,
    reasons,
)

__all__ = [
    "FABRICS",
    "NVLINK",
    "FabricAttachment",
    "FabricIndex",
    "NvlinkPart",
    "attachments",
    "build_index",
    "register",
    "unverified",
]


class FabricAttachment(TypedDict):
    """A node's attachment to one fabric name it declares."""

    name: str  # the fabric's name, as the node declares it
    kind: str  # "ib" or "roce"
    identity: str | None  # the physical fabric ("ib:<subnet prefix>"), None while no subnet manager answered
    problem: str  # why a shard may not use it (its adapters sit on two fabrics), "" when none
    leaf: str | None  # the leaf switch (or rails' leaves, comma-separated) its ports are cabled to; None: unknown
    hcas: list[str]  # its adapters on the fabric (mlx5_0, ...)
    netdevs: list[str]  # their network interfaces (for RoCE and NCCL's socket), [] when none
    short: bool  # a cable trained below the fabric's rate, or a degraded link on the map
    leaf_name: NotRequired[str | None]  # the leaf's name on the map; only with a known leaf


class NvlinkPart(TypedDict):
    """A node's multi-node NVLink domain (apps.fabrics.nvlink)."""

    domain: str  # the domain's id (cluster UUID and clique)
    label: str  # how people name it
    ready: bool  # every card joined and IMEX up: a replica may form inside it
    problems: list[str]  # what keeps it out when not ready, in words


FABRICS: SnapshotField[list[FabricAttachment]] = SnapshotField("fabrics", [])
NVLINK: SnapshotField[NvlinkPart] = SnapshotField("nvlink")
CABLE = "fabric.cable"
CABLE_WEIGHT = 3.0  # above binpack's 1 and weights' 2: a short cable slows every collective of the replica
UNVERIFIED = "unverified:"
NVLINK_PREFIX = "nvlink:"  # apps.fabrics.nvlink.GROUP_PREFIX


def unverified(name: str) -> str:
    return f"{UNVERIFIED}{name}"


def attachments(node: NodeSnapshot) -> list[FabricAttachment]:
    value = FABRICS.get(node)
    return [a for a in value if isinstance(a, dict)] if isinstance(value, list) else []


@dataclass(slots=True)
class FabricIndex:
    """The fabrics of every node of one snapshot (nodes never change within one)."""

    groups: dict[int, tuple[str, ...]] = field(default_factory=dict)
    prefer: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    short: set[int] = field(default_factory=set)
    notes: dict[int, dict[str, str]] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    problems: dict[int, str] = field(default_factory=dict)
    # node id -> (domain label, what keeps it out) for nodes of an NVLink domain that are not ready
    nvlink_out: dict[int, tuple[str, str]] = field(default_factory=dict)
    tiered: bool = False


def build_index(inventory: Inventory) -> FabricIndex:
    index = FabricIndex()
    for node_id, node in inventory.nodes.items():
        found = attachments(node)
        domain = _nvlink(node)
        if not found and domain is None:
            continue
        groups: list[str] = []
        nvlink_note = "-"
        if domain is not None:
            label = str(domain.get("label") or domain["domain"])
            if domain.get("ready"):
                group = NVLINK_PREFIX + str(domain["domain"])
                groups.append(group)
                index.labels.setdefault(group, f"NVLink {label}")
                index.tiered = True
                nvlink_note = label
            else:
                problems_text = "; ".join(str(p) for p in domain.get("problems") or []) or "-"
                index.nvlink_out[node_id] = (label, problems_text)
                nvlink_note = f"{label}: {problems_text}"
        prefer: list[tuple[str, str]] = []
        leaves: list[str] = []
        problems: list[str] = []
        for att in found:
            name = str(att.get("name") or "")
            problem = str(att.get("problem") or "")
            if problem:
                problems.append(problem)
                continue
            identity = att.get("identity")
            group = str(identity) if identity else unverified(name)
            if group not in groups:
                groups.append(group)
            index.labels.setdefault(group, _label(name, identity))
            leaf = att.get("leaf")
            if identity and leaf and (group, str(leaf)) not in prefer:
                prefer.append((group, str(leaf)))
                leaves.append(str(att.get("leaf_name") or leaf))
            if att.get("short"):
                index.short.add(node_id)
        if groups:
            index.groups[node_id] = tuple(groups)
        if prefer:
            index.prefer[node_id] = tuple(prefer)
        if problems:
            index.problems[node_id] = "; ".join(problems)
        notes = {"fabric": ", ".join(index.labels[g] for g in groups) if groups else "-"}
        notes["leaf"] = ", ".join(leaves) if leaves else "-"
        if domain is not None:
            notes["nvlink"] = nvlink_note
        index.notes[node_id] = notes
    return index


def _label(name: str, identity: object) -> str:
    if not identity:
        return f"{name} (unverified)"
    return f"{name} ({identity})"


def _nvlink(node: NodeSnapshot) -> NvlinkPart | None:
    value = NVLINK.get(node)
    return value if isinstance(value, dict) and value.get("domain") else None


def tier(group: str) -> int:
    """NVLink domains first (0), then InfiniBand and RoCE fabrics (1)."""
    return 0 if group.startswith(NVLINK_PREFIX) else 1


def refusal(node: NodeSnapshot, index: FabricIndex, need: int) -> Reason:
    out = index.nvlink_out.get(node.id)
    if out is not None and node.id not in index.groups:
        return Reason(
            "nvlink_out",
            gettext_noop(
                "node %(node)s is kept out of NVLink domain %(domain)s (%(problem)s) and is on no other fabric"
            ),
            {"node": node.name, "domain": out[0], "problem": out[1]},
        )
    problem = index.problems.get(node.id)
    if problem:
        return Reason(
            "fabric_split",
            gettext_noop("node %(node)s cannot take a shard of a replica across nodes: %(problem)s"),
            {"node": node.name, "problem": problem},
        )
    return reasons.no_fabric(node.name, need)


def prefilter(ctx: PlacementContext, index: FabricIndex) -> PreFilterResult:
    need = ctx.nodes
    notes = index.notes
    return PreFilterResult(
        groups=index.groups,
        prefer=index.prefer,
        refuse=lambda node: refusal(node, index, need),
        notes=lambda node_id: notes.get(node_id, {"fabric": "-", "leaf": "-"}),
        label=lambda group: index.labels.get(group, group),
        tier=tier if index.tiered else None,
    )


def cable(ctx: PlacementContext, node: NodeSnapshot) -> float:
    """1 unless the node is to take a shard of a replica across nodes over a cable that trained short."""
    if not ctx.multi_node:
        return 1.0
    short = ctx.scratch.get(CABLE)
    if short is None:  # the index's short cables, looked up once per profile rather than once per node
        index: FabricIndex = ctx.inventory.plugin_index("fabric", build_index)
        short = ctx.scratch[CABLE] = index.short
    return 0.0 if node.id in short else 1.0


def register(registry: Registry = REGISTRY) -> None:
    """Replace the built-in grouping by declared fabric with the physical one (same name)."""
    FABRICS.register(registry)
    NVLINK.register(registry)
    registry.register_prefilter(
        prefilter, name="fabric", order=80, index=build_index, applies=lambda ctx: ctx.multi_node, static=True
    )
    registry.register_scorer(cable, name=CABLE, weight=CABLE_WEIGHT)
