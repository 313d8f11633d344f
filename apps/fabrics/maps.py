"""Fabric maps: which node maps each InfiniBand fabric, and what its answer becomes.

Every FABRIC_MAP_INTERVAL beat asks one ready node per physical InfiniBand fabric (one that
lists the ibnetdiscover feature and has an active port on it) to run ibnetdiscover through
that port. The control plane parses the text itself (apps.fabrics.topology), so a format the
parser has not met is a control plane upgrade, not one on every node. An operator may ask for a
map now (`ask_for_map`): that request is audited as fabric.map, the beat's are not.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agent import bounded, protocol
from apps.accounts import audit
from apps.accounts.models import User
from apps.cluster import agent_requests
from apps.cluster.choices import NodeStatus
from apps.cluster.models import AgentRequest, Node
from apps.fabrics import topology
from apps.fabrics.models import FabricMap

__all__ = ["KEEP_MAPS", "ask_for_map", "latest_maps", "map_fabrics", "port_leaves", "record_map", "request_map"]

log = logging.getLogger(__name__)

KEEP_MAPS = 12  # per fabric: an hour of maps at the default interval
MAP_TIMEOUT_S = 180
MAX_TEXT = 64 * 1024 * 1024  # a decompressed map larger than this is refused, not parsed


def _text(result: Any) -> str:
    """The map's text: inflated with a bound (a few hundred kilobytes of gzip can hold gigabytes
    of zeros), refused once it passes MAX_TEXT."""
    if not isinstance(result, dict):
        raise ValueError("the answer holds no map")
    if isinstance(result.get("text_gz"), str):
        packed = bounded.b64decode(result["text_gz"], limit=protocol.MAX_MESSAGE_BYTES, what="the map")
        return bounded.inflate(packed, limit=MAX_TEXT, what="the map").decode("utf-8", errors="replace")
    if isinstance(result.get("text"), str):
        return str(result["text"])
    refused = result.get("refused") or []
    raise ValueError("; ".join(["the answer holds no map", *map(str, refused)]))


def record_map(row: AgentRequest, result: Any) -> dict[str, Any]:
    """The handler of an ibnetdiscover answer: the map parsed and kept; the row keeps a summary."""
    parsed = topology.parse(_text(result))
    data = topology.to_dict(parsed)
    if not data["switches"]:
        raise ValueError("; ".join(["the map holds no switch", *data["warnings"][:3]]))
    fabric = str(row.params.get("fabric") or "")
    kept = FabricMap.objects.create(fabric=fabric, node=row.node, device=str(row.params.get("device") or ""), data=data)
    old = FabricMap.objects.filter(fabric=fabric).order_by("-taken_at", "-pk").values_list("pk", flat=True)[KEEP_MAPS:]
    FabricMap.objects.filter(pk__in=list(old)).delete()
    return {"map": kept.pk, "counts": data["counts"], "warnings": data["warnings"][:20]}


def _candidates() -> dict[str, list[tuple[str, Node, str, int]]]:
    """Per physical InfiniBand fabric: (name, node, device, port) of each active port on it."""
    from apps.fabrics.services import _load, port_identity

    rows, sm_sets, _managers = _load()
    found: dict[str, list[tuple[str, Node, str, int]]] = {}
    for row in rows:
        node = row.node
        if node.live_status != NodeStatus.READY or agent_requests.FEATURES["ibnetdiscover"] not in (
            node.features or []
        ):
            continue
        for port in row.ports or []:
            identity = port_identity(port, sm_sets)
            if port.get("up") and identity and identity.startswith("ib:"):
                found.setdefault(identity, []).append((node.name, node, str(port["device"]), int(port["port"])))
    return found


def request_map(fabric: str, *, exclude: set[int] | None = None) -> AgentRequest | None:
    """Ask one node on the fabric to map it (the first by name that did not just fail to)."""
    options = sorted(_candidates().get(fabric, []), key=lambda c: (c[0], c[2], c[3]))
    recent = timezone.now() - timedelta(seconds=2 * settings.FABRIC_MAP_INTERVAL)
    failed = set(
        AgentRequest.objects.filter(
            kind="ibnetdiscover",
            params__fabric=fabric,
            created_at__gte=recent,
            state__in=(AgentRequest.State.FAILED, AgentRequest.State.TIMED_OUT),
        ).values_list("node_id", flat=True)
    )
    skip = (exclude or set()) | failed
    ordered = [c for c in options if c[1].pk not in skip] + [c for c in options if c[1].pk in skip]
    for _name, node, device, port in ordered:
        try:
            return agent_requests.create(
                node,
                "ibnetdiscover",
                {"fabric": fabric, "device": device, "port": port},
                timeout_s=MAP_TIMEOUT_S,
                group=f"map:{fabric}",
            )
        except agent_requests.RequestRefused as exc:
            log.info("fabric %s: %s", fabric, exc)
    return None


@transaction.atomic
def ask_for_map(fabric: str, *, actor: User | None, address: str | None = None) -> AgentRequest | None:
    """An operator's request to map the fabric now (see request_map), and its audit event: who asked,
    for which fabric, which node maps it through which port, from where. None when no node can."""
    row = request_map(fabric)
    if row is not None:
        audit.record(
            actor,
            "fabric.map",
            row,
            address=address,
            fabric=fabric,
            node=row.node.name,
            device=row.params.get("device"),
            port=row.params.get("port"),
        )
    return row


def map_fabrics() -> list[AgentRequest]:
    """One map request per InfiniBand fabric that has none waiting."""
    waiting = set(
        AgentRequest.objects.filter(
            kind="ibnetdiscover", state__in=(AgentRequest.State.PENDING, AgentRequest.State.SENT)
        ).values_list("group", flat=True)
    )
    made = []
    for fabric in sorted(_candidates()):
        if f"map:{fabric}" in waiting:
            continue
        row = request_map(fabric)
        if row is not None:
            made.append(row)
    return made


def latest_maps() -> dict[str, FabricMap]:
    """The newest map of each fabric (only those are read whole: a large fabric's map is a megabyte)."""
    newest: dict[str, int] = {}
    for pk, fabric in FabricMap.objects.order_by("fabric", "-taken_at", "-pk").values_list("pk", "fabric"):
        newest.setdefault(fabric, pk)
    return {kept.fabric: kept for kept in FabricMap.objects.filter(pk__in=newest.values()).select_related("node")}


def port_leaves(maps: dict[str, FabricMap]) -> dict[str, dict[str, dict[str, Any]]]:
    """fabric -> port GUID -> {leaf, leaf_name, degraded} from each fabric's newest map."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for fabric, kept in maps.items():
        switches = {s["guid"]: s.get("desc") or s["guid"] for s in kept.data.get("switches") or []}
        ports: dict[str, dict[str, Any]] = {}
        for adapter in kept.data.get("adapters") or []:
            for port in adapter.get("ports") or []:
                guid = port.get("port_guid")
                if guid:
                    leaf = port.get("leaf")
                    ports[str(guid)] = {
                        "leaf": leaf,
                        "leaf_name": switches.get(leaf, leaf),
                        "degraded": bool(port.get("degraded")),
                    }
        out[fabric] = ports
    return out
