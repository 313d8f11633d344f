"""What the facility page (templates/facility/facility.html) shows: every node's place as a tree of
sites, rooms, rows and racks, each rack with its nodes, the models running there and the holds on it.

Seven queries whatever the number of nodes: the nodes, their GPUs, the shards of replicas that claim
resources on them, the active holds, the power budgets, and (where budgets are set) the capped
nodes' samples and the shards whose draw counts against them; plus one round trip to the sample
history for the measured draw.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from django.db.models import Prefetch

from apps.facility.locations import LEVELS
from apps.facility.models import Hold
from apps.facility.services import active_holds, node_location

__all__ = ["UNSAID", "facility_page"]

# How a level a node does not say is shown (its group in the tree).
UNSAID = "-"
# The levels the tree is made of, top down; a hold on one of them holds every rack below it.
TREE = ("site", "room", "row", "rack")


def _hold_row(hold: Hold, *, nodes: int = 0) -> dict[str, Any]:
    who = hold.created_by
    return {
        "id": hold.pk,
        "domain": hold.domain,
        "level": hold.level,
        "name": hold.name,
        "reason": hold.reason,
        "drain": hold.drain,
        "held_at": hold.created_at,
        "held_by": (who.name or who.email) if who is not None else None,
        "nodes": nodes,
    }


def _holds_on(place: dict[str, str | None], holds: list[Hold], levels: tuple[str, ...] = LEVELS) -> list[Hold]:
    """The holds on a place, top down (site first)."""
    found = [h for h in holds if h.level in levels and place.get(h.level) == h.name]
    return sorted(found, key=lambda h: LEVELS.index(h.level))


def _slot_state(status: str, cordoned: bool, held: bool) -> str:
    """The colour of a node's slot in its rack: what is most worth knowing first."""
    if status != "ready":
        return status  # unreachable, pending
    if cordoned:
        return "cordoned"
    if held:
        return "held"
    return "ready"


def _node_row(node: Any, place: dict[str, str | None], holds: list[Hold]) -> dict[str, Any]:
    classes = Counter(gpu.gpu_class or gpu.name or "?" for gpu in node.gpus.all())
    held_by = [h.domain for h in _holds_on(place, holds)]
    status = node.live_status
    return {
        "name": node.name,
        "status": status,
        "status_label": node.get_live_status_display(),
        "cordoned": node.cordoned,
        "cordon_reason": node.cordon_reason,
        "gpus": sum(classes.values()),
        "gpu_classes": [{"name": name, "count": count} for name, count in sorted(classes.items())],
        "pdu": place["pdu"],
        "location": place,
        "held_by": held_by,
        "state": _slot_state(status, node.cordoned, bool(held_by)),
    }


def _sort_key(name: str | None) -> tuple[int, str]:
    """Named groups in order, the unsaid one last."""
    return (1, "") if name is None else (0, name)


def _group(name: str | None, level: str, holds: list[Hold]) -> dict[str, Any]:
    own = next((h for h in holds if h.level == level and h.name == name), None) if name is not None else None
    return {"name": name, "label": name if name is not None else UNSAID, "level": level, "hold": own}


def _facility_nodes() -> list[Any]:
    """Every node that is not revoked, in name order, with its GPUs and only the fields the page reads."""
    from apps.cluster.choices import NodeStatus
    from apps.cluster.models import Gpu, Node

    return list(
        Node.objects.exclude(status=NodeStatus.REVOKED)
        .only("name", "labels", "hardware", "status", "cordoned", "cordon_reason", "last_seen_at")
        .prefetch_related(Prefetch("gpus", queryset=Gpu.objects.only("node_id", "index", "gpu_class", "name")))
        .order_by("name")
    )


def _models_on_nodes() -> dict[int, Counter[str]]:
    """Node id -> the shards on it per model name, of the replicas that claim resources."""
    from apps.cluster.choices import NodeStatus
    from apps.cluster.inventory import CLAIMING_STATES
    from apps.cluster.models import Shard

    models_on: dict[int, Counter[str]] = defaultdict(Counter)
    shards = Shard.objects.filter(replica__state__in=CLAIMING_STATES).exclude(node__status=NodeStatus.REVOKED)
    for node_id, model_name in shards.values_list("node_id", "replica__model__name"):
        models_on[node_id][model_name] += 1
    return models_on


def _tree(racks: dict[tuple[str | None, ...], dict[str, Any]], holds: list[Hold]) -> list[dict[str, Any]]:
    """The racks, keyed by (site, room, row, rack), as sites of rooms of rows of racks, each level
    in name order with the unsaid one last.  Each rack's model counts become a sorted list."""
    sites: dict[str | None, dict[str, Any]] = {}
    for key in sorted(racks, key=lambda k: tuple(_sort_key(part) for part in k)):
        site_name, room_name, row_name, _rack = key
        rack = racks[key]
        rack["models"] = [{"name": name, "shards": count} for name, count in sorted(rack["models"].items())]
        rack["held"] = bool(rack["holds"])
        site = sites.setdefault(site_name, {**_group(site_name, "site", holds), "rooms": {}})
        room = site["rooms"].setdefault(room_name, {**_group(room_name, "room", holds), "rows": {}})
        row_group = room["rows"].setdefault(row_name, {**_group(row_name, "row", holds), "racks": []})
        row_group["racks"].append(rack)
    tree = []
    for site in sites.values():
        rooms = []
        for room in site["rooms"].values():
            room["rows"] = list(room["rows"].values())
            rooms.append(room)
        site["rooms"] = rooms
        tree.append(site)
    return tree


def facility_page() -> dict[str, Any]:
    """The tree (sites → rooms → rows → racks) of every node that is not revoked, the nodes naming no
    rack, each named PDU with its nodes, and the active holds.

    A rack: its nodes in name order (status, cordon, GPUs, PDU, the slot's colour), the models with
    shards on them (replicas that claim resources), and the holds on it: its own and any on its site,
    room or row, each marked `inherited` when it is one of those.
    """
    holds = active_holds()
    nodes = _facility_nodes()
    models_on = _models_on_nodes()

    racks: dict[tuple[str | None, ...], dict[str, Any]] = {}
    without_rack: list[dict[str, Any]] = []
    pdus: dict[str, list[str]] = defaultdict(list)
    covered: Counter[str] = Counter()
    placed = False
    for node in nodes:
        place = node_location(node)
        placed = placed or any(place.values())
        row = _node_row(node, place, holds)
        for domain in row["held_by"]:
            covered[domain] += 1
        if place["pdu"]:
            pdus[str(place["pdu"])].append(node.name)
        if not place["rack"]:
            without_rack.append(row)
            continue
        key = tuple(place[level] for level in TREE)
        rack = racks.get(key)
        if rack is None:
            rack = racks[key] = {
                **_group(place["rack"], "rack", holds),
                "domain": f"rack={place['rack']}",
                "path": "/".join(str(place[level] or UNSAID) for level in TREE),
                "place": {level: place[level] for level in TREE},
                "nodes": [],
                "models": Counter(),
                "holds": [{"hold": h, "inherited": h.level != "rack"} for h in _holds_on(place, holds, TREE)],
            }
        rack["nodes"].append(row)
        rack["models"].update(models_on.get(node.pk, Counter()))

    tree = _tree(racks, holds)
    budgets = power_rows(nodes)
    for site in tree:
        for room in site["rooms"]:
            for row_group in room["rows"]:
                for rack in row_group["racks"]:
                    rack["power"] = budgets.get(rack["domain"])
    pdu_holds = {h.name: h for h in holds if h.level == "pdu"}
    return {
        "budgets": list(budgets.values()),
        "levels": list(LEVELS),
        "sites": tree,
        "racks": sum(len(row["racks"]) for site in tree for room in site["rooms"] for row in room["rows"]),
        "nodes": len(nodes),
        "placed": placed,
        "without_rack": without_rack,
        "pdus": [
            {
                "name": name,
                "domain": f"pdu={name}",
                "nodes": members,
                "hold": pdu_holds.get(name),
                "power": budgets.get(f"pdu={name}"),
            }
            for name, members in sorted(pdus.items())
        ],
        "holds": [_hold_row(h, nodes=covered[h.domain]) for h in holds],
    }


def power_rows(nodes: list[Any]) -> dict[str, dict[str, Any]]:
    """Domain -> its budget with what its nodes draw: the cap, the feeds, the known draw, how many of
    its nodes' draw is unknown, and the share of the cap drawn (for the bar; None when nothing is
    known)."""
    from apps.facility import power
    from apps.facility.models import Budget

    budgets = {b.domain: b for b in Budget.objects.all()}
    if not budgets:
        return {}
    from apps.cluster.models import Node

    members: dict[str, list[int]] = defaultdict(list)
    capped: set[int] = set()
    for node in nodes:
        for level, value in node_location(node).items():
            domain = f"{level}={value}"
            if value and domain in budgets:
                members[domain].append(node.pk)
                capped.add(node.pk)
    # Only the capped nodes' samples are read (a sample is large, and most nodes may have no cap).
    sampled = Node.objects.filter(pk__in=capped).only("labels", "hardware", "sample", "sampled_at") if capped else []
    draws = power.node_draws({node.pk: node for node in sampled}) if capped else {}
    rows: dict[str, dict[str, Any]] = {}
    for domain, budget in budgets.items():
        ids = members.get(domain, [])
        known = [d for i in ids if (d := draws.get(i)) is not None]
        unknown = len(ids) - len(known)
        drawn = sum(known) if known else None
        cap = budget.cap_watts
        share = None if drawn is None or not cap else drawn / cap * 100
        rows[domain] = {
            "domain": domain,
            "level": budget.level,
            "name": budget.name,
            "cap_watts": cap,
            "watts": budget.watts,
            "feeds": budget.feeds,
            "redundant": budget.redundant,
            "source": budget.source,
            "nodes": len(ids),
            "drawn_watts": drawn,
            "draw_unknown": unknown,
            "share": share,
            "bar": None if share is None else min(share, 100.0),
            "over": share is not None and share > 100,
            "near": share is not None and 90 <= share <= 100,
        }
    return rows
