"""Placement by facility: nothing new in a held domain (no Django).

Each node's snapshot carries `extra["facility"]` (apps.facility.services.contribute_snapshots):

    {"location": {"site": "dc1", "room": None, "row": "r", "rack": "r12", "pdu": "r12-a"},
     "held": [{"domain": "rack=r12", "reason": "PDU swap"}]}

A node in a held domain takes no new shard; explain says which hold, and shows each node's rack
and PDU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apps.cluster.placement import (
    REGISTRY,
    Inventory,
    NodeSnapshot,
    PlacementContext,
    PreFilterResult,
    Reason,
    Registry,
    gettext_noop,
)

__all__ = ["SNAPSHOT_FIELD", "FacilityIndex", "build_index", "register"]

SNAPSHOT_FIELD = "facility"


@dataclass(slots=True)
class FacilityIndex:
    held: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    notes: dict[int, dict[str, str]] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)


def build_index(inventory: Inventory) -> FacilityIndex:
    index = FacilityIndex()
    for node_id, node in inventory.nodes.items():
        value = node.extra.get(SNAPSHOT_FIELD)
        facility = value if isinstance(value, dict) else {}
        place: dict[str, Any] = facility["location"] if isinstance(facility.get("location"), dict) else {}
        if any(place.values()):
            index.notes[node_id] = {"rack": str(place.get("rack") or "-"), "pdu": str(place.get("pdu") or "-")}
        held = [h for h in facility.get("held") or [] if isinstance(h, dict)]
        if held:
            index.held[node_id] = held
        else:
            index.free.add(node_id)
    return index


def refusal(node: NodeSnapshot, index: FacilityIndex) -> Reason:
    hold = index.held[node.id][0]
    return Reason(
        "facility_held",
        gettext_noop("node %(node)s is in %(domain)s, which is held: %(reason)s"),
        {"node": node.name, "domain": str(hold.get("domain")), "reason": str(hold.get("reason") or "-")},
    )


def prefilter(ctx: PlacementContext, index: FacilityIndex) -> PreFilterResult:
    notes = index.notes
    return PreFilterResult(
        nodes=index.free if index.held else None,
        refuse=lambda node: refusal(node, index),
        notes=lambda node_id: notes.get(node_id, {}),
    )


def register(registry: Registry = REGISTRY) -> None:
    registry.register_snapshot_field(SNAPSHOT_FIELD, None)
    registry.register_prefilter(prefilter, name="facility.hold", order=15, index=build_index, static=True)
