"""What nodes and shards draw, and the power caps of racks, PDUs and rows.

A shard's draw is the highest of what is known of it: declared (its profile's `power_watts`),
derived (its cards' TDP, by GPU class), measured (its cards' power draw, the highest reading of
the last five minutes of the node's history and its fresh sample). A node draws the most of what
was measured of it over that window (every card's draw and the CPU packages' RAPL power, read
together) and what is derived: its base (the `llmgw.io/base-watts` label: fans, CPUs, NICs,
drives at their most) plus its shards' draws. Where nothing is known the draw is None, said as
unknown, never counted as zero; a node whose base is not given counts its shards only.

Budgets come from server.yaml (`facility: {budgets: [...]}`, which states its whole set) or the
API; each is `{domain: rack=r12, watts: 15000}` or, for a domain fed by several circuits,
`{domain: rack=r12, feeds: [{name: A, watts: 17300}, {name: B, watts: 17300}], redundant: true}`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.utils.translation import gettext as _

from apps.facility.draw import derived_watts, shard_watts
from apps.facility.locations import parse_domain
from apps.facility.models import Budget
from llmgw.errors import ServiceError
from llmgw.ids import whole_number

if TYPE_CHECKING:
    from agent.messages import HeartbeatSample
    from apps.cluster.models import Node

__all__ = [
    "BudgetError",
    "base_watts",
    "remove_budget",
    "set_budget",
    "apply_budgets",
    "apply_server_budgets",
    "budget_dict",
    "caps",
    "derived_watts",
    "node_draws",
    "shard_watts",
    "slices_of",
]

MAX_WATTS = 10_000_000  # 10 MW: beyond any one domain
WINDOW_S = 300  # measured draw: the highest reading of the last five minutes
BASE_LABEL = "llmgw.io/base-watts"


class BudgetError(ServiceError, ValueError):
    """A budget that cannot be taken, and why (field -> messages)."""

    code = "budget_invalid"

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__("; ".join(f"{k}: {' '.join(v)}" for k, v in errors.items()), details=errors)
        self.errors = errors


def slices_of(sample: HeartbeatSample | None) -> dict[int, tuple[int, float]]:
    """The slices a sample lists (MIG devices, AMD compute partitions): index -> (card, share)."""
    out: dict[int, tuple[int, float]] = {}
    for g in (sample or {}).get("gpus") or []:
        if not isinstance(g, dict) or not isinstance(g.get("index"), int):
            continue
        parent, share = g.get("parent"), g.get("share")
        if isinstance(parent, int) and isinstance(share, int | float) and 0 < share <= 1:
            out[g["index"]] = (parent, float(share))
    return out


def _measured(sample: HeartbeatSample | None, indices: Iterable[int] | None = None) -> float | None:
    """The cards' power draw in a sample (those of `indices`, a slice its share of its card's draw;
    else every card, plus RAPL); None when a card it needs did not report one."""
    if not isinstance(sample, dict):
        return None
    gpus = {g.get("index"): g for g in sample.get("gpus") or [] if isinstance(g, dict)}
    slices = slices_of(sample)
    wanted: list[Any] = list(indices) if indices is not None else [i for i in gpus if i not in slices]
    total = 0.0
    for index in wanted:
        card, share = slices.get(index, (index, 1.0))
        figures = gpus.get(card)
        draw = figures.get("power_draw_w") if figures is not None else None
        if not isinstance(draw, int | float):
            return None
        total += float(draw) * share
    if indices is None:
        rapl = sample.get("cpu_package_power_w")
        if isinstance(rapl, int | float):
            total += float(rapl)
        elif not wanted:
            return None
    return total


def _point_measured(
    point: dict[str, Any], indices: Iterable[int] | None = None, slices: dict[int, tuple[int, float]] | None = None
) -> float | None:
    """What one history point (apps.cluster.history._history_point, which keeps cards, not their
    slices) measured: the cards of `indices`, a slice its share of its card (`slices`), else every
    card plus RAPL; None when a card it needs reported no draw."""
    found = point.get("gpus")
    gpus: dict[str, Any] = found if isinstance(found, dict) else {}
    parts = [(slices or {}).get(i, (i, 1.0)) for i in indices] if indices is not None else None
    wanted = [(str(card), share) for card, share in parts] if parts is not None else [(i, 1.0) for i in gpus]
    total = 0.0
    for index, share in wanted:
        figures = gpus.get(index)
        draw = figures[2] if isinstance(figures, list) and len(figures) > 2 else None
        if not isinstance(draw, int | float):
            return None
        total += float(draw) * share
    if indices is None:
        rapl = point.get("rapl")
        if isinstance(rapl, int | float):
            total += float(rapl)
        elif not wanted:
            return None
    return total


def _windowed(sample: HeartbeatSample | None, points: list[dict[str, Any]], indices: list[int] | None) -> float | None:
    """The highest of the fresh sample's reading and the window's."""
    slices = slices_of(sample)
    return shard_watts(_measured(sample, indices), *(_point_measured(p, indices, slices) for p in points))


def base_watts(node: Any) -> int | None:
    """The node's base draw from its llmgw.io/base-watts label (whole watts), None when not given."""
    labels = getattr(node, "placement_labels", None) or getattr(node, "labels", None) or {}
    return whole_number(str(labels.get(BASE_LABEL) or "").strip(), 1, MAX_WATTS)


def node_draws(nodes: dict[int, Node]) -> dict[int, float | None]:
    """Node id -> what it draws now (W), from what was measured of it over the window, its base and
    the shards it holds; None unknown."""
    from apps.cluster.history import recent_history
    from apps.cluster.inventory import CLAIMING_STATES
    from apps.cluster.models import Shard

    history = recent_history(nodes, WINDOW_S)

    shards: dict[int, list[float | None]] = {}
    rows = (
        Shard.objects.filter(node_id__in=list(nodes), replica__state__in=CLAIMING_STATES)
        .select_related("replica__profile")
        .only("node_id", "gpu_indices", "replica__profile__power_watts", "replica__profile__accelerator")
    )
    for shard in rows:
        node = nodes[shard.node_id]
        profile = shard.replica.profile
        cards = list(shard.gpu_indices or [])
        sample = node.fresh_sample()
        shards.setdefault(shard.node_id, []).append(
            shard_watts(
                profile.power_watts if profile else None,
                derived_watts(profile.accelerator if profile else None, len(cards)),
                _windowed(sample, history.get(shard.node_id, []), cards) if cards else None,
            )
        )
    out: dict[int, float | None] = {}
    for node_id, node in nodes.items():
        measured = _windowed(node.fresh_sample(), history.get(node_id, []), None)
        held = shards.get(node_id, [])
        claimed = sum(v for v in held if v is not None) if all(v is not None for v in held) else None
        base = base_watts(node)
        if base is not None:
            derived = base + (claimed or 0.0) if claimed is not None or not held else None
        else:
            derived = claimed if held else None
        out[node_id] = shard_watts(measured, derived)
    return out


def caps() -> dict[str, int]:
    """Domain (rack=r12) -> its cap in watts."""
    return {b.domain: cap for b in Budget.objects.all() if (cap := b.cap_watts) is not None}


def budget_dict(row: Budget) -> dict[str, Any]:
    return {
        "domain": row.domain,
        "watts": row.watts,
        "feeds": row.feeds,
        "redundant": row.redundant,
        "cap_watts": row.cap_watts,
        "source": row.source,
    }


def _whole_watts(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_WATTS


def _parse(entries: Any, path: str) -> list[dict[str, Any]]:
    errors: dict[str, list[str]] = {}
    if not isinstance(entries, list):
        raise BudgetError({path: [_("Expected a list of budgets.")]})
    parsed: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict):
            errors.setdefault(where, []).append(_("Expected a mapping with a domain and watts or feeds."))
            continue
        unknown = sorted(set(entry) - {"domain", "watts", "feeds", "redundant"})
        if unknown:
            errors.setdefault(where, []).append(
                _("Unknown key(s) %(keys)s (known: domain, watts, feeds, redundant).") % {"keys": ", ".join(unknown)}
            )
        try:
            level, name = parse_domain(str(entry.get("domain") or ""))
        except ValueError as exc:
            errors.setdefault(f"{where}.domain", []).append(str(exc))
            continue
        if f"{level}={name}" in seen:
            errors.setdefault(f"{where}.domain", []).append(_("Given twice."))
        seen.add(f"{level}={name}")
        watts = entry.get("watts")
        feeds = entry.get("feeds") or []
        if watts is not None and not _whole_watts(watts):
            errors.setdefault(f"{where}.watts", []).append(
                _("Expected whole watts from 1 to %(max)s; got “%(value)s”.") % {"max": MAX_WATTS, "value": watts}
            )
        clean_feeds = []
        if not isinstance(feeds, list) or not all(isinstance(f, dict) and _whole_watts(f.get("watts")) for f in feeds):
            errors.setdefault(f"{where}.feeds", []).append(_("Expected a list of {name, watts} with whole watts."))
        else:
            clean_feeds = [
                {"name": str(f.get("name") or chr(65 + n)), "watts": f["watts"]} for n, f in enumerate(feeds)
            ]
        if watts is None and not clean_feeds:
            errors.setdefault(where, []).append(_("Give the cap as watts, or the feeds that carry it."))
        redundant = entry.get("redundant", False)
        if not isinstance(redundant, bool):
            errors.setdefault(f"{where}.redundant", []).append(_("Expected true or false."))
        parsed.append(
            {"level": level, "name": name, "watts": watts, "feeds": clean_feeds, "redundant": redundant is True}
        )
    if errors:
        raise BudgetError(errors)
    return parsed


@transaction.atomic
def apply_budgets(entries: Any, *, source: str, replace: bool) -> list[Budget]:
    """Take budgets (validated whole first: one bad entry writes nothing); with `replace`, the
    budgets of `source` not listed are removed (server.yaml states its whole set)."""
    parsed = _parse(entries, "facility.budgets")
    rows = []
    for entry in parsed:
        row, _created = Budget.objects.update_or_create(
            level=entry["level"],
            name=entry["name"],
            defaults={
                "watts": entry["watts"],
                "feeds": entry["feeds"],
                "redundant": entry["redundant"],
                "source": source,
            },
        )
        rows.append(row)
    if replace:
        Budget.objects.filter(source=source).exclude(pk__in=[r.pk for r in rows]).delete()
    return rows


def apply_server_budgets(path: str) -> list[Budget] | None:
    """server.yaml's `facility.budgets` (None when it has none: the budgets stay as they are)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise BudgetError({"server.yaml": [str(exc)]}) from None
    facility = data.get("facility") if isinstance(data, dict) else None
    if facility is None:
        return None
    if not isinstance(facility, dict) or set(facility) - {"budgets"}:
        raise BudgetError({"facility": [_("Expected a mapping with a “budgets” list.")]})
    return apply_budgets(facility.get("budgets") or [], source="server.yaml", replace=True)


@transaction.atomic
def set_budget(entry: Any, *, source: str, actor: Any, address: str | None = None) -> Budget:
    """Set one domain's cap (the API's and the console's way), audited."""
    from apps.accounts import audit

    before = Budget.objects.filter(**_level_name(entry)).first()
    [row] = apply_budgets([entry], source=source, replace=False)
    audit.record(
        actor,
        "facility.budget",
        row,
        changes={"cap_watts": [before.cap_watts if before else None, row.cap_watts]},
        address=address,
    )
    return row


def _level_name(entry: Any) -> dict[str, str]:
    try:
        level, name = parse_domain(str((entry or {}).get("domain") or "")) if isinstance(entry, dict) else ("", "")
    except ValueError:
        return {"level": "", "name": ""}
    return {"level": level, "name": name}


@transaction.atomic
def remove_budget(domain: str, *, actor: Any, address: str | None = None) -> Budget:
    """Remove a domain's cap, audited; BudgetError when it has none."""
    from apps.accounts import audit

    try:
        level, name = parse_domain(domain)
    except ValueError as exc:
        raise BudgetError({"domain": [str(exc)]}) from None
    row = Budget.objects.filter(level=level, name=name).first()
    if row is None:
        raise BudgetError({"domain": [_("%(domain)s has no power cap.") % {"domain": f"{level}={name}"}]})
    audit.record(actor, "facility.budget_removed", row, changes={"cap_watts": [row.cap_watts, None]}, address=address)
    row.delete()
    return row
