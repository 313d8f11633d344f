"""Dry runs on a copy of the inventory: room for more replicas, and what to stop to make room."""

from __future__ import annotations

from dataclasses import dataclass

from .context import PlacementContext
from .model import Inventory, Placement, PreemptionPlan, ReplicaRequest
from .pipeline import ordered_profiles, place, static_prefilters
from .registry import REGISTRY, Registry

DEFAULT_CAPACITY_RANK: dict[str, int] = {"opportunistic": 0, "standard": 1, "critical": 2}

# Filters that do not depend on what is claimed: a node they refuse stays refused whatever is stopped.
# Pre-filters registered as static count as well.
_STATIC_FILTERS = frozenset({"ready", "cordon", "node_selector", "gpu_class", "engine"})


@dataclass(frozen=True, slots=True)
class _Candidate:
    replica: str
    rank: int
    gpus: int
    memory: int
    seq: int
    nodes: frozenset[int]
    owner: frozenset[str]


def _class_rank(capacity_rank: dict[str, int], name: str) -> int:
    """A class the table does not name ranks as "standard" (or 0 if that is not named either)."""
    if name in capacity_rank:
        return capacity_rank[name]
    return capacity_rank.get("standard", 0)


def preemption_candidates(
    inventory: Inventory, request: ReplicaRequest, *, capacity_rank: dict[str, int] | None = None
) -> list[str]:
    """Replicas the request may stop, cheapest first: every replica of a lower class, and of the same
    class only those marked above_minimum (grown above their model's minimum under load); never one
    of the request's own model. Cheapest: lowest class, then fewest GPUs, then least memory, then newest."""
    return [c.replica for c in _candidates(inventory, request, capacity_rank or DEFAULT_CAPACITY_RANK)]


def _candidates(inventory: Inventory, request: ReplicaRequest, capacity_rank: dict[str, int]) -> list[_Candidate]:
    mine = _class_rank(capacity_rank, request.capacity_class)
    found = []
    for replica in inventory.replica_ids():
        claims = inventory.replica_claims(replica)
        if not claims or any(c.model == request.model for c in claims):
            continue
        rank = min(_class_rank(capacity_rank, c.capacity_class) for c in claims)
        above = all(c.above_minimum for c in claims)
        if rank > mine or (rank == mine and not above):
            continue
        found.append(
            _Candidate(
                replica,
                rank,
                sum(len(c.gpu_indices) for c in claims),
                sum(c.memory_bytes for c in claims),
                inventory.replica_seq(replica),
                frozenset(c.node_id for c in claims),
                frozenset(k for c in claims for k in c.owner),
            )
        )
    found.sort(key=lambda c: (c.rank, c.gpus, c.memory, -c.seq, c.replica))
    return found


def _useful_nodes(inventory: Inventory, request: ReplicaRequest, registry: Registry) -> set[int]:
    """Nodes some profile could use if they had room (only the claim-independent filters asked)."""
    static = [e.fn for e in registry.filters() if e.name in _STATIC_FILTERS]
    useful: set[int] = set()
    for profile in ordered_profiles(request.profiles):
        ctx = PlacementContext(inventory, request, profile, registry)
        pre = static_prefilters(ctx)
        checks = static + pre
        for node_id, node in inventory.nodes.items():
            if node_id not in useful and all(fn(ctx, node) is None for fn in checks):
                useful.add(node_id)
    return useful


def _fits(inventory: Inventory, request: ReplicaRequest, victims: list[str], registry: Registry) -> Placement | None:
    trial = inventory.copy()
    for replica in victims:
        trial.release(replica)
    return place(trial, request, registry=registry, collect=False).placement


def plan_preemption(
    inventory: Inventory,
    request: ReplicaRequest,
    *,
    capacity_rank: dict[str, int] | None = None,
    registry: Registry | None = None,
) -> PreemptionPlan | None:
    """What to stop so that the request (a model below its minimum) fits, and where it then goes.

    Victims (see preemption_candidates) are released whole on a copy, cheapest first, until the
    request fits; then any victim the room turns out not to need is given back, the dearest
    first. Returns None when even stopping every candidate makes no room: then nothing is
    stopped. When the request fits already, the plan has no victims. The inventory is not changed.
    """
    registry = registry or REGISTRY
    capacity_rank = capacity_rank or DEFAULT_CAPACITY_RANK
    now = place(inventory, request, registry=registry, collect=False).placement
    if now is not None:
        return PreemptionPlan([], now)
    useful = _useful_nodes(inventory, request, registry)
    owners = set(request.owner)
    candidates = [c for c in _candidates(inventory, request, capacity_rank) if c.nodes & useful or c.owner & owners]
    trial = inventory.copy()
    victims: list[str] = []
    placement = None
    for candidate in candidates:
        trial.release(candidate.replica)
        victims.append(candidate.replica)
        placement = place(trial, request, registry=registry, collect=False).placement
        if placement is not None:
            break
    if placement is None:
        return None
    # Give back what the room did not need, trying the dearest victim first.
    for replica in reversed(victims[:-1]):
        fewer = [v for v in victims if v != replica]
        smaller = _fits(inventory, request, fewer, registry)
        if smaller is not None:
            victims, placement = fewer, smaller
    return PreemptionPlan(victims, placement)


def headroom(
    inventory: Inventory,
    request: ReplicaRequest,
    *,
    preempt: bool = False,
    limit: int = 1000,
    capacity_rank: dict[str, int] | None = None,
    registry: Registry | None = None,
) -> int:
    """How many more replicas of the request fit, placing them one after another on a copy (at most
    `limit`). With preempt=True a replica that does not fit may stop what its class outranks."""
    registry = registry or REGISTRY
    trial = inventory.copy()
    base = request.replica_id or request.model
    count = 0
    while count < limit:
        placement = place(trial, request, registry=registry, collect=False).placement
        if placement is None:
            if not preempt:
                break
            plan = plan_preemption(trial, request, capacity_rank=capacity_rank, registry=registry)
            if plan is None:
                break
            for victim in plan.victims:
                trial.release(victim)
            placement = plan.placement
        trial.apply(
            placement,
            f"{base}#headroom-{count}",
            model=request.model,
            owner=request.owner,
            capacity_class=request.capacity_class,
        )
        count += 1
    return count
