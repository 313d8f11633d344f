"""Locations and holds: what the facility pages, the API and `llmgw ctl facility` read and change."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.db import IntegrityError, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.accounts import audit
from apps.cluster.placement import NodeSnapshot
from apps.facility import power
from apps.facility.locations import LEVELS, location
from apps.facility.models import Hold
from apps.facility.placement import FACILITY, FacilityPart, HeldDomain
from llmgw.errors import ServiceError

if TYPE_CHECKING:
    from apps.cluster.models import Node

__all__ = [
    "HoldError",
    "active_holds",
    "contribute_snapshots",
    "draining_nodes",
    "facility_overview",
    "hold",
    "hold_dict",
    "node_location",
    "release",
]


class HoldError(ServiceError, ValueError):
    """A hold that cannot be made or released, and why."""

    code = "hold_refused"


def node_location(node: Any) -> dict[str, str | None]:
    return location(node.placement_labels)


def active_holds() -> list[Hold]:
    return list(Hold.objects.filter(released_at__isnull=True).select_related("created_by").order_by("level", "name"))


def _held(place: dict[str, str | None], holds: Iterable[Hold]) -> list[HeldDomain]:
    return [{"domain": h.domain, "reason": h.reason} for h in holds if place.get(h.level) == h.name]


def contribute_snapshots(snapshots: dict[int, NodeSnapshot], nodes: dict[int, Node] | None = None) -> None:
    """Give each node of a placement snapshot its location, the holds on it, and where power caps
    are set its draw now and the caps of its domains (`extra["facility"]`)."""
    holds = active_holds()
    budgets = power.caps()
    draws = power.node_draws(nodes) if budgets and nodes else {}
    for node_id, snapshot in snapshots.items():
        place = location(snapshot.labels)
        if not any(place.values()) and not holds:
            continue
        facility: FacilityPart = {"location": place, "held": _held(place, holds)}
        capped = {
            f"{level}={place[level]}": budgets[f"{level}={place[level]}"]
            for level in LEVELS
            if place[level] and f"{level}={place[level]}" in budgets
        }
        if capped:
            facility["caps"] = capped
            facility["draw_w"] = draws.get(node_id)
        FACILITY.put(snapshot, facility)


def hold(level: str, name: str, *, reason: str, actor: Any, drain: bool = False, address: str | None = None) -> Hold:
    """Hold a domain: no new replica is placed on its nodes until it is released; with `drain`, the
    replicas on them are moved out too, each replaced elsewhere first."""
    from apps.cluster.reconciler import request_reconcile

    if level not in LEVELS:
        raise HoldError(
            _("no such level %(level)s (one of %(levels)s)") % {"level": level, "levels": ", ".join(LEVELS)}
        )
    try:
        with transaction.atomic():
            row = Hold.objects.create(level=level, name=name, reason=reason[:500], drain=drain, created_by=actor)
            audit.record(
                actor,
                "facility.hold",
                row,
                changes={"held": [False, True]},
                reason=reason or None,
                drain=drain or None,
                address=address,
            )
    except IntegrityError:
        raise HoldError(_("%(domain)s is already held") % {"domain": f"{level}={name}"}) from None
    request_reconcile()
    return row


def release(level: str, name: str, *, actor: Any, address: str | None = None) -> Hold:
    """End the active hold on a domain."""
    from apps.cluster.reconciler import request_reconcile

    with transaction.atomic():
        row = Hold.objects.select_for_update().filter(level=level, name=name, released_at__isnull=True).first()
        if row is None:
            raise HoldError(_("%(domain)s is not held") % {"domain": f"{level}={name}"})
        row.released_at = timezone.now()
        row.released_by = actor
        row.save(update_fields=["released_at", "released_by"])
        audit.record(actor, "facility.release", row, changes={"held": [True, False]}, address=address)
    request_reconcile()
    return row


def hold_dict(row: Hold) -> dict[str, Any]:
    return {
        "id": row.pk,
        "domain": row.domain,
        "level": row.level,
        "name": row.name,
        "reason": row.reason,
        "drain": row.drain,
        "held_at": row.created_at.isoformat(),
        "held_by": getattr(row.created_by, "email", None),
        "released_at": row.released_at.isoformat() if row.released_at else None,
    }


def draining_nodes() -> list[Any]:
    """The nodes in a domain held with drain: the reconciler moves their replicas out as from a
    drained node (never forced, the server's drain grace)."""
    from apps.cluster.choices import NodeStatus
    from apps.cluster.models import Node

    holds = [h for h in active_holds() if h.drain]
    if not holds:
        return []
    found = []
    for node in Node.objects.exclude(status=NodeStatus.REVOKED):
        place = node_location(node)
        if any(place.get(h.level) == h.name for h in holds):
            node.drain_force = False
            node.drain_grace = None
            found.append(node)
    return found


def facility_overview() -> dict[str, Any]:
    """Every domain some node names, level by level, with its nodes and its hold; the nodes that
    name no location; and the active holds (a hold may name a domain no node is in yet)."""
    from apps.cluster.choices import NodeStatus
    from apps.cluster.models import Node
    from apps.facility.selectors import power_rows

    holds = active_holds()
    by_domain = {h.domain: h for h in holds}
    domains: dict[tuple[str, str], list[str]] = {}
    unplaced: list[str] = []
    nodes = list(Node.objects.exclude(status=NodeStatus.REVOKED).only("name", "labels", "hardware").order_by("name"))
    for node in nodes:
        place = node_location(node)
        if not any(place.values()):
            unplaced.append(node.name)
        for level in LEVELS:
            if place[level]:
                domains.setdefault((level, str(place[level])), []).append(node.name)
    # Each cap with what its nodes draw, from what the facility page draws too: the known draw (None
    # when no node's is known) and how many of its nodes' draw is unknown.
    caps = power_rows(nodes)
    rows = []
    for level in LEVELS:
        for (lvl, name), members in sorted(domains.items()):
            if lvl != level:
                continue
            held = by_domain.get(f"{level}={name}")
            cap = caps.get(f"{level}={name}") or {}
            rows.append(
                {
                    "domain": f"{level}={name}",
                    "level": level,
                    "name": name,
                    "nodes": members,
                    "hold": hold_dict(held) if held else None,
                    "cap_watts": cap.get("cap_watts"),
                    "drawn_watts": cap.get("drawn_watts"),
                    "draw_unknown": cap.get("draw_unknown"),
                }
            )
    budget_keys = ("domain", "watts", "feeds", "redundant", "cap_watts", "source")
    return {
        "levels": list(LEVELS),
        "domains": rows,
        "unplaced": unplaced,
        "holds": [hold_dict(h) for h in holds],
        "budgets": [{key: row[key] for key in budget_keys} for row in caps.values()],
    }
