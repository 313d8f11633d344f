"""Placement by facility: nothing new in a held domain (no Django).

Each node's snapshot carries `extra["facility"]` (FACILITY, a FacilityPart; filled by
apps.facility.services.contribute_snapshots, and by the simulator):

    {"location": {"site": "dc1", "room": None, "row": "r", "rack": "r12", "pdu": "r12-a"},
     "held": [{"domain": "rack=r12", "reason": "PDU swap"}]}

A node in a held domain takes no new shard; explain says which hold, and shows each node's rack
and PDU. A replica across nodes whose profile says `keep_within: rack` (or site, room, row, pdu) is
formed among the nodes of one rack only, on top of the fabric it needs: a node that does not say
its rack takes no shard of it.

A model's replicas spread across racks and PDUs: a node scores 1/(1 + the model's shards already
in its rack), averaged with the same for its PDU (nodes that say no rack count as one rack of
their own). The count is read per placement from the inventory's claims by model, so a batch of
placements spreads as it goes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NotRequired, TypedDict

from apps.cluster.placement import (
    REGISTRY,
    Claim,
    Inventory,
    NodeSnapshot,
    PlacementContext,
    PreFilterResult,
    ProfileField,
    Reason,
    Registry,
    SnapshotField,
    gettext_noop,
)
from apps.facility.draw import derived_watts, shard_watts
from apps.facility.locations import LEVELS

__all__ = [
    "FACILITY",
    "KEEP_WITHIN",
    "POWER_WATTS",
    "FacilityIndex",
    "FacilityPart",
    "HeldDomain",
    "build_index",
    "register",
    "renew_draws",
]


class HeldDomain(TypedDict):
    """A hold on one of a node's domains (apps.facility.models.Hold)."""

    domain: str  # "rack=r12"
    reason: str  # why it is held, in the operator's words


class FacilityPart(TypedDict):
    """Where a node is, what holds it, and where power caps are set what it and its domains may draw."""

    location: dict[str, str | None]  # each level (site ... pdu) -> the node's value there; None: not said
    held: list[HeldDomain]  # the holds on its domains, [] when none
    caps: NotRequired[Mapping[str, float]]  # its capped domains ("rack=r12") -> cap (W); only where caps are set
    draw_w: NotRequired[float | None]  # what it draws now (W), None when unknown; only with caps


FACILITY: SnapshotField[FacilityPart] = SnapshotField("facility")
SPREAD_WEIGHT = 1.5  # above binpack's 1: a model's second replica in another rack before a tighter fit
SPREAD = "facility.spread"
POWER = "facility.power"
INDEX = "facility.hold"  # the pre-filter whose index (every node's location and holds) both share

# The profile fields these rules read, declared here and registered with placement: the catalog
# reads them from a model spec, stores them in its columns of the same names and shows them.
KEEP_WITHIN = ProfileField(
    "keep_within",
    str,
    default="",
    choices=LEVELS,
    label=gettext_noop("keep within"),
    help=gettext_noop("A replica across nodes is formed within one of these: its nodes' llmgw.io/<level> label."),
)
POWER_WATTS = ProfileField(
    "power_watts",
    int,
    low=1,
    high=1_000_000,
    label=gettext_noop("power per shard (W)"),
    help=gettext_noop(
        "What one shard draws, as you know it: a power cap counts the highest of this, its cards' TDP and "
        "what they were measured at."
    ),
)


@dataclass(slots=True)
class FacilityIndex:
    held: dict[int, list[HeldDomain]] = field(default_factory=dict)
    # Power: domain -> cap (W); node id -> its capped domains; domain -> (known draw W, nodes unknown)
    caps: dict[str, int] = field(default_factory=dict)
    capped: dict[int, tuple[str, ...]] = field(default_factory=dict)
    drawn: dict[str, tuple[float, int]] = field(default_factory=dict)
    first_claims: frozenset[int] = frozenset()  # ids of the claims the snapshot's draws already count
    kept: tuple[object, ...] = ()  # those claims, held so that no later claim can reuse an id
    notes: dict[int, dict[str, str]] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)
    places: dict[int, dict[str, Any]] = field(default_factory=dict)
    # level -> node id -> (its domain at that level,), built when a profile first asks
    within: dict[str, dict[int, tuple[str, ...]]] = field(default_factory=dict)
    # What the rules read of a node per candidate, worked out once: node id -> (its rack, its PDU) as
    # its location says them, for the nodes that say a location (spread); node id -> (domain, cap W,
    # known draw W) for each of its capped domains, renewed with the draws (power_cap).
    spots: dict[int, tuple[Any, Any]] = field(default_factory=dict)
    budgets: dict[int, tuple[tuple[str, int, float], ...]] = field(default_factory=dict)

    def level_of(self, level: str) -> dict[int, Any]:
        """Node id -> its domain's name at the level, for the nodes that say one."""
        return {node_id: place[level] for node_id, place in self.places.items() if place.get(level)}

    def groups_at(self, level: str) -> dict[int, tuple[str, ...]]:
        found = self.within.get(level)
        if found is None:
            found = self.within[level] = {
                node_id: (f"{level}={place[level]}",) for node_id, place in self.places.items() if place.get(level)
            }
        return found


def build_index(inventory: Inventory) -> FacilityIndex:
    index = FacilityIndex()
    for node_id, node in inventory.nodes.items():
        value = FACILITY.get(node)
        facility: FacilityPart = value if isinstance(value, dict) else {"location": {}, "held": []}
        place: dict[str, Any] = facility["location"] if isinstance(facility.get("location"), dict) else {}
        if any(place.values()):
            index.places[node_id] = place
            index.spots[node_id] = (place.get("rack"), place.get("pdu"))
            index.notes[node_id] = {"rack": str(place.get("rack") or "-"), "pdu": str(place.get("pdu") or "-")}
        caps = facility.get("caps") if isinstance(facility.get("caps"), dict) else {}
        if caps:
            index.capped[node_id] = tuple(str(d) for d in caps)
            for domain, cap in caps.items():
                index.caps[str(domain)] = int(cap)
        held = [h for h in facility.get("held") or [] if isinstance(h, dict)]
        if held:
            index.held[node_id] = held
        else:
            index.free.add(node_id)
    return renew_draws(inventory, index)


def renew_draws(inventory: Inventory, index: FacilityIndex) -> FacilityIndex:
    """The index with its capped nodes' draws read (again: each node's report now counts the claims
    there are, as a simulated fleet's does after its claims change); the rest of it (locations,
    holds, caps) is as built."""
    claims = tuple(inventory.claims)
    drawn: dict[str, tuple[float, int]] = {}
    for node_id, domains in index.capped.items():
        node = inventory.nodes.get(node_id)
        facility = FACILITY.get(node) if node is not None else None
        draw = facility.get("draw_w") if isinstance(facility, dict) else None
        for domain in domains:
            known, unknown = drawn.get(domain, (0.0, 0))
            drawn[domain] = (known + float(draw), unknown) if isinstance(draw, int | float) else (known, unknown + 1)
    caps = index.caps
    budgets = {
        node_id: tuple((domain, caps[domain], drawn.get(domain, (0.0, 0))[0]) for domain in domains)
        for node_id, domains in index.capped.items()
    }
    return replace(index, drawn=drawn, budgets=budgets, first_claims=frozenset(id(c) for c in claims), kept=claims)


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


def keep_within(ctx: PlacementContext, _index: object) -> PreFilterResult:
    index: FacilityIndex = ctx.inventory.plugin_index(INDEX, build_index)
    level = str(ctx.profile.extra.get(KEEP_WITHIN.name) or "")
    profile = ctx.profile.name

    def refuse(node: NodeSnapshot) -> Reason:
        return Reason(
            "keep_within_unknown",
            gettext_noop(
                "node %(node)s does not say its %(level)s, and profile %(profile)s keeps a replica within one %(level)s"
            ),
            {"node": node.name, "level": level, "profile": profile},
        )

    return PreFilterResult(groups=index.groups_at(level), refuse=refuse, label=lambda group: group)


def spread(ctx: PlacementContext, node: NodeSnapshot) -> float:
    """1 where the model has no shard in the node's rack or PDU yet, less the more it has there."""
    counts = ctx.scratch.get(SPREAD)
    if counts is None:
        counts = ctx.scratch[SPREAD] = _spread_counts(ctx)
    spots, racks, pdus = counts
    if not racks:
        return 1.0
    rack, pdu = spots.get(node.id, _NOWHERE)
    return 0.5 / (1 + racks.get(rack, 0)) + 0.5 / (1 + pdus.get(pdu, 0))


_NOWHERE = (None, None)  # a node that says no location counts with the others that say none


def _spread_counts(ctx: PlacementContext) -> tuple[Mapping[int, tuple[Any, Any]], Mapping[Any, int], Mapping[Any, int]]:
    """The nodes' racks and PDUs, and the model's shards counted by rack and by PDU (kept by the
    inventory as claims are applied and released): read once per profile, as they do not change
    while its nodes are walked."""
    index: FacilityIndex = ctx.inventory.plugin_index(INDEX, build_index)
    if not index.places:
        return index.spots, {}, {}
    inventory, model = ctx.inventory, ctx.request.model
    racks = inventory.model_tally("facility.rack", model, lambda: index.level_of("rack"))
    pdus = inventory.model_tally("facility.pdu", model, lambda: index.level_of("pdu"))
    return index.spots, racks, pdus


def _kw(watts: float) -> str:
    return f"{watts / 1000:.1f} kW"


def _batch_draws(ctx: PlacementContext, index: FacilityIndex) -> Mapping[str, float]:
    """Domain -> what the claims made since the snapshot add (their cards' TDP), kept by the
    inventory as claims are applied and released."""
    inventory = ctx.inventory
    capped, first = index.capped, index.first_claims

    def weigh(claim: Claim) -> dict[str, float] | None:
        domains = capped.get(claim.node_id)
        if not domains or not claim.gpu_indices:
            return None
        node = inventory.nodes.get(claim.node_id)
        slot = next((g for g in node.gpus if g.index == claim.gpu_indices[0]), None) if node is not None else None
        watts = derived_watts(slot.gpu_class if slot is not None else None, len(claim.gpu_indices)) or 0
        return dict.fromkeys(domains, float(watts)) if watts else None

    return inventory.claim_sum(f"{POWER}:{id(index)}", weigh, lambda claim: id(claim) not in first)


PowerBound = tuple[Mapping[int, tuple[tuple[str, int, float], ...]], float | None, Mapping[str, float]]


def _power_bound(ctx: PlacementContext) -> PowerBound:
    """What power_cap reads for one profile, the same for every node it is tried on: each capped
    node's domains with their caps and known draws, what the replica adds (None: unknown, or no
    cap anywhere) and what the claims made since the snapshot add per domain."""
    bound: PowerBound | None = ctx.scratch.get(POWER)
    if bound is None:
        index: FacilityIndex = ctx.inventory.plugin_index(INDEX, build_index)
        adds = shard_watts(ctx.profile.extra.get(POWER_WATTS.name), derived_watts(ctx.gpu_class, ctx.gpus))
        if adds is None or not index.capped:
            bound = (index.budgets, None, {})
        else:
            bound = (index.budgets, adds * ctx.nodes, _batch_draws(ctx, index))
        ctx.scratch[POWER] = bound
    return bound


def _caps_apply(ctx: PlacementContext) -> bool:
    """Whether power_cap can refuse any node for this profile: some node is capped and what the
    replica adds is known (otherwise it passes every node, and placement need not ask it)."""
    return _power_bound(ctx)[1] is not None


def power_cap(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """Refuse a shard that would take one of the node's domains past its power cap, with the numbers.
    A shard whose draw is unknown (nothing declared, cards of no known TDP) is not refused. A replica
    across nodes is counted whole against each domain (every shard may land in it, and with
    keep_within every shard does): a domain short of room for all of them takes none."""
    bound = ctx.scratch.get(POWER)
    if bound is None:
        bound = _power_bound(ctx)
    budgets, adds, batch = bound
    if adds is None:
        return None
    found = budgets.get(node.id)
    if not found:
        return None
    for domain, cap, known in found:
        drawn = known + batch.get(domain, 0.0)
        if drawn + adds > cap:
            return Reason(
                "power_cap",
                gettext_noop("%(domain)s: %(drawn)s of %(cap)s drawn, this replica adds %(adds)s"),
                {"domain": domain, "drawn": _kw(drawn), "cap": _kw(cap), "adds": _kw(adds)},
            )
    return None


def register(registry: Registry = REGISTRY) -> None:
    FACILITY.register(registry)
    registry.register_profile_field(KEEP_WITHIN)
    registry.register_profile_field(POWER_WATTS)
    registry.register_prefilter(prefilter, name=INDEX, order=15, index=build_index, static=True)
    registry.register_prefilter(
        keep_within,
        name="facility.keep_within",
        order=85,
        applies=lambda ctx: ctx.multi_node and bool(ctx.profile.extra.get(KEEP_WITHIN.name)),
        static=True,
    )
    registry.register_scorer(spread, name=SPREAD, weight=SPREAD_WEIGHT)
    registry.register_filter(power_cap, name=POWER, order=90, applies=_caps_apply)
