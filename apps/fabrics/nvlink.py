"""Multi-node NVLink domains (GB200/GB300 NVL72, NVLink Switch systems) and IMEX, as the agents report them.

Every GPU sample carries each card's fabric registration from `nvidia-smi -q` (state, status,
ClusterUUID, CliqueId, health, bandwidth); a node in a domain also reports `nvidia-imex-ctl -q`
and `-N` and its IMEX channels once per `gpu_check_interval`. Nothing is stored apart from the
samples: a domain is what the fresh samples say now, and a node whose sample went stale is in
none (unknown, not out).

The rules are NCCL's and NVIDIA's DRA driver's: a card's State must be Completed, and only then
does its Status mean anything (Success); a zero ClusterUUID is a single machine's NVSwitch, no
domain and no error; an unhealthy card can still print a CliqueId and is not joined. A node's
domain is `<ClusterUUID>.<CliqueId>`, one for all its cards. A replica across nodes may be formed
in a domain from the nodes whose every card is joined, whose IMEX daemon is READY with its domain
UP and which hold an IMEX channel (without IMEX the cards cannot share memory across nodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.utils.translation import gettext as _

from apps.cluster.placement import NodeSnapshot
from apps.fabrics.placement import NVLINK

if TYPE_CHECKING:
    from apps.cluster.models import Node

__all__ = [
    "GROUP_PREFIX",
    "MNNVL_ENV",
    "CardFabric",
    "NodeNVLink",
    "card_fabric",
    "may_name_domain",
    "contribute_snapshots",
    "domain_group",
    "domains_overview",
    "node_nvlink",
    "read_node",
]

GROUP_PREFIX = "nvlink:"
# What a shard of a replica formed inside one NVLink domain is told: use multi-node NVLink, and fail
# rather than fall back silently (1, not NCCL's default 2 = auto); MNNVL needs cuMem allocations.
MNNVL_ENV = {"NCCL_MNNVL_ENABLE": "1", "NCCL_CUMEM_ENABLE": "1"}
FULL_BANDWIDTH = "full"
NO_FABRIC = {"", "n/a", "not supported", "none"}


def domain_group(domain: str) -> str:
    return f"{GROUP_PREFIX}{domain}"


def _zero_uuid(value: str | None) -> bool:
    text = (value or "").strip()
    return not text or text.upper() == "N/A" or not text.strip("0-")


@dataclass(slots=True)
class CardFabric:
    """One card's NVLink fabric registration, and what it means."""

    index: int
    state: str | None
    status: str | None
    cluster_uuid: str | None
    clique_id: int | None
    health: str | None
    bandwidth: str | None
    domain: str | None  # <ClusterUUID>.<CliqueId>, None for no multi-node domain
    joined: bool
    degraded: bool  # joined, on less than full bandwidth or limited capacity
    problem: str  # why it is not joined ("" when it is)
    faults: list[str] = field(default_factory=list)  # Health rows set (Route Unhealthy...): degraded

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "state": self.state,
            "status": self.status,
            "cluster_uuid": self.cluster_uuid,
            "clique_id": self.clique_id,
            "health": self.health,
            "bandwidth": self.bandwidth,
            "domain": self.domain,
            "joined": self.joined,
            "degraded": self.degraded,
            "problem": self.problem,
            "faults": list(self.faults),
        }


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def card_fabric(gpu: dict[str, Any]) -> CardFabric | None:
    """A card's fabric from its sample entry; None where it has none (no NVSwitch, or not reported)."""
    fabric = gpu.get("fabric")
    index = gpu.get("index")
    if not isinstance(fabric, dict) or not isinstance(index, int):
        return None
    state = fabric.get("state")
    if state is None or str(state).strip().lower() in NO_FABRIC:
        return None
    state = str(state)
    status, uuid, health, bandwidth = (
        _text(fabric.get(key)) for key in ("status", "cluster_uuid", "health_summary", "bandwidth")
    )
    # Older GB200 drivers print "Not Supported" for every Health row: unknown, not degraded.
    health = None if (health or "").strip().lower() in NO_FABRIC else health
    bandwidth = None if (bandwidth or "").strip().lower() in NO_FABRIC else bandwidth
    faults = [str(f) for f in _list(fabric.get("health_faults"))]
    clique = fabric.get("clique_id")
    clique_id = clique if isinstance(clique, int) and not isinstance(clique, bool) else None
    domain = f"{uuid}.{clique_id}" if not _zero_uuid(uuid) and clique_id is not None else None
    problem = ""
    if state.lower() != "completed":
        problem = _("fabric %(state)s") % {"state": state}
    elif (status or "").lower() != "success":
        problem = _("fabric status %(status)s") % {"status": status or "-"}
    elif (health or "").lower() == "unhealthy":
        problem = _("fabric unhealthy")
    elif domain is None and not _zero_uuid(uuid):
        problem = _("no CliqueId")
    joined = not problem and domain is not None
    degraded = joined and (
        (bandwidth is not None and not bandwidth.strip().lower().startswith(FULL_BANDWIDTH))
        or (health or "").lower() == "limited capacity"
        or bool(faults)
    )
    return CardFabric(
        index=index,
        state=state,
        status=status,
        cluster_uuid=uuid,
        clique_id=clique_id,
        health=health,
        bandwidth=bandwidth,
        domain=domain,
        joined=joined,
        degraded=degraded,
        problem=problem,
        faults=faults,
    )


@dataclass(slots=True)
class NodeNVLink:
    """A node's place in a multi-node NVLink domain, from its fresh sample."""

    cards: list[CardFabric]
    domain: str | None  # the domain its cards name (the most named, when they disagree)
    imex: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)  # what keeps the node out of its domain

    @property
    def ready(self) -> bool:
        return self.domain is not None and not self.problems

    @property
    def imex_up(self) -> bool | None:
        return imex_up(self.imex)

    def as_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "ready": self.ready,
            "problems": list(self.problems),
            "imex": imex_summary(self.imex),
            "gpus": [c.as_dict() for c in self.cards],
        }


def imex_up(imex: dict[str, Any] | None) -> bool | None:
    """IMEX ready to share memory: the daemon READY, its domain UP and a channel; None when not read."""
    if not isinstance(imex, dict):
        return None
    return bool(
        imex.get("installed")
        and imex.get("state") == "READY"
        and (imex.get("domain_state") or "UP") == "UP"
        and imex.get("channels")
    )


def imex_summary(imex: dict[str, Any] | None) -> dict[str, Any] | None:
    if not isinstance(imex, dict):
        return None
    nodes = [n for n in _list(imex.get("nodes")) if isinstance(n, dict)]
    channels = [c for c in _list(imex.get("channels")) if isinstance(c, int)]
    return {
        "installed": bool(imex.get("installed")),
        "state": imex.get("state"),
        "domain_state": imex.get("domain_state"),
        "configured": imex.get("configured"),
        "channels": channels if isinstance(imex.get("channels"), list) else None,
        "up": imex_up(imex),
        "nodes": len(nodes),
        "nodes_ready": sum(1 for n in nodes if n.get("state") == "READY"),
    }


def _imex_problem(imex: dict[str, Any] | None) -> str:
    if not isinstance(imex, dict):
        return _("IMEX not reported yet")
    if not imex.get("installed"):
        return _("IMEX is not installed")
    state = imex.get("state")
    if state != "READY":
        return _("IMEX is %(state)s") % {"state": state or _("unknown")}
    if imex.get("configured") is False:
        return _("IMEX has no node configuration")
    domain_state = imex.get("domain_state")
    if domain_state not in (None, "UP"):
        down = [
            str(n.get("address") or n.get("index"))
            for n in _list(imex.get("nodes"))
            if isinstance(n, dict) and n.get("state") != "READY"
        ]
        text = _("IMEX domain %(state)s") % {"state": domain_state}
        return f"{text} ({', '.join(down)})" if down else text
    if not imex.get("channels"):
        return _("no IMEX channel")
    return ""


def _cards(report: Mapping[str, Any] | None) -> list[CardFabric]:
    if not isinstance(report, dict):
        return []
    found = (card_fabric(g) for g in _list(report.get("gpus")) if isinstance(g, dict))
    return [c for c in found if c is not None]


def may_name_domain(sample: Mapping[str, Any]) -> bool:
    """False when no card of the sample can name a multi-node NVLink domain (none prints a non-zero
    ClusterUUID): a single HGX board's cards, or cards with no fabric. Cheaper than read_node()
    for a caller that only wants nodes in a domain."""
    for gpu in _list(sample.get("gpus")):
        fabric = gpu.get("fabric") if isinstance(gpu, dict) else None
        if isinstance(fabric, dict) and not _zero_uuid(_text(fabric.get("cluster_uuid"))):
            return True
    return False


def _named(cards: Iterable[CardFabric]) -> dict[str, int]:
    named: dict[str, int] = {}
    for card in cards:
        if card.domain is not None:
            named[card.domain] = named.get(card.domain, 0) + 1
    return named


def registered_domain(gpus: Iterable[dict[str, Any]]) -> str | None:
    """The domain most of a registering node's cards name (None: none names one)."""
    found = (card_fabric(g) for g in gpus if isinstance(g, dict))
    named = _named(c for c in found if c is not None)
    return max(sorted(named), key=lambda d: named[d]) if named else None


def read_node(sample: Mapping[str, Any] | None, hardware: dict[str, Any] | None = None) -> NodeNVLink | None:
    """What a node's sample says of its NVLink domain; None when none of its cards has a fabric.

    Cards whose fabric is not registered (a fabric manager restarting) print no ClusterUUID; the
    node is then still shown in the domain its cards last named (`hardware["nvlink_domain"]`), out.
    """
    if not isinstance(sample, dict):
        return None
    cards = _cards(sample)
    if not cards:
        return None
    known = (hardware or {}).get("nvlink_domain")
    named = _named(cards) or ({str(known): 1} if known else {})
    imex = sample.get("imex") if isinstance(sample.get("imex"), dict) else None
    if not named:
        return NodeNVLink(cards=cards, domain=None, imex=imex)
    domain = max(sorted(named), key=lambda d: named[d])
    problems: list[str] = []
    if len(named) > 1:
        problems.append(_("its cards name %(count)d domains") % {"count": len(named)})
    for card in cards:
        if card.problem:
            problems.append(_("GPU %(index)d: %(problem)s") % {"index": card.index, "problem": card.problem})
        elif card.domain != domain:
            problems.append(_("GPU %(index)d: in no domain") % {"index": card.index})
    imex_problem = _imex_problem(imex)
    if imex_problem:
        problems.append(imex_problem)
    return NodeNVLink(cards=cards, domain=domain, imex=imex, problems=problems)


def node_nvlink(node: Node) -> NodeNVLink | None:
    """A Node row's NVLink domain from its fresh sample (None: no fabric, or the sample is stale)."""
    return read_node(node.fresh_sample(), node.hardware)


def domain_label(domain: str) -> str:
    """A domain as people read it: the ClusterUUID's first block and the clique."""
    uuid, _sep, clique = domain.rpartition(".")
    return f"{uuid.split('-')[0]}…/{clique}" if uuid else domain


def contribute_snapshots(snapshots: dict[int, NodeSnapshot], nodes: dict[int, Node] | None = None) -> None:
    """Give each node of a placement snapshot its NVLink domain (`extra["nvlink"]`)."""
    for node_id, node in (nodes or {}).items():
        snapshot = snapshots.get(node_id)
        if snapshot is None:
            continue
        found = node_nvlink(node)
        if found is None or found.domain is None:
            continue
        NVLINK.put(
            snapshot,
            {
                "domain": found.domain,
                "label": domain_label(found.domain),
                "ready": found.ready,
                "problems": list(found.problems),
            },
        )


def shard_env(group: tuple[str, ...] | None) -> dict[str, str] | None:
    """The environment of a shard of a replica formed inside an NVLink domain; None for other groups."""
    if not group or not group[0].startswith(GROUP_PREFIX):
        return None
    return dict(MNNVL_ENV)


def _mnnvl_replicas(node_ids: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
    """Node id -> the running replicas that have a shard there told to use multi-node NVLink."""
    from apps.cluster.inventory import CLAIMING_STATES
    from apps.cluster.models import Shard

    found: dict[int, list[dict[str, Any]]] = {}
    shards = (
        Shard.objects.filter(node_id__in=list(node_ids), replica__state__in=CLAIMING_STATES)
        .select_related("replica__model")
        .only("node_id", "env", "replica__id", "replica__state", "replica__model__name")
    )
    for shard in shards:
        if (shard.env or {}).get("NCCL_MNNVL_ENABLE") != MNNVL_ENV["NCCL_MNNVL_ENABLE"]:
            continue
        replica = shard.replica
        found.setdefault(shard.node_id, []).append(
            {"replica": replica.pk, "model": replica.model.name, "state": replica.state}
        )
    return found


def domains_overview() -> dict[str, Any]:
    """Every NVLink domain with its trays (nodes), each card's joining, IMEX, and what keeps a tray
    out; the running replicas across the domain, with those on a tray now out said to be at risk."""
    from apps.cluster.models import Node

    nodes = list(Node.objects.filter(gpus__isnull=False).distinct().order_by("name"))
    domains: dict[str, dict[str, Any]] = {}
    standalone: list[dict[str, Any]] = []
    found: dict[int, NodeNVLink] = {}
    stale: list[str] = []
    for node in nodes:
        state = node_nvlink(node)
        if state is None:
            if node.sample is not None and node.fresh_sample() is None and read_node(node.latest_sample, node.hardware):
                stale.append(node.name)
            continue
        found[node.pk] = state
    replicas = _mnnvl_replicas(found)
    for node in nodes:
        state = found.get(node.pk)
        if state is None:
            continue
        entry = {
            "name": node.name,
            "id": node.pk,
            **state.as_dict(),
            "replicas": replicas.get(node.pk, []),
        }
        if state.domain is None:
            standalone.append(entry)
            continue
        domain = domains.setdefault(
            state.domain,
            {
                "domain": state.domain,
                "label": domain_label(state.domain),
                "cluster_uuid": state.domain.rpartition(".")[0],
                "clique_id": state.domain.rpartition(".")[2],
                "nodes": [],
            },
        )
        domain["nodes"].append(entry)
    out = []
    for domain in sorted(domains.values(), key=lambda d: d["domain"]):
        trays = domain["nodes"]
        cards = [g for t in trays for g in t["gpus"]]
        domain["gpus"] = len(cards)
        domain["gpus_joined"] = sum(1 for g in cards if g["joined"])
        domain["gpus_degraded"] = sum(1 for g in cards if g["degraded"])
        domain["nodes_ready"] = sum(1 for t in trays if t["ready"])
        domain["imex_up"] = sum(1 for t in trays if (t["imex"] or {}).get("up"))
        at_risk = []
        for tray in trays:
            for replica in tray["replicas"]:
                if not tray["ready"]:
                    at_risk.append({**replica, "node": tray["name"], "problems": tray["problems"]})
        domain["at_risk"] = at_risk
        out.append(domain)
    return {"domains": out, "standalone": standalone, "stale": stale}


def node_view(node: Any) -> dict[str, Any] | None:
    """A node's page: its GPU-by-GPU NVLink matrix with each card's NUMA node and closest adapters
    (from registration), and its domain, cards' joining and IMEX (from the fresh sample). None when
    the node reported neither."""
    topology = (node.hardware or {}).get("gpu_topology")
    state = node_nvlink(node)
    if not isinstance(topology, dict) and state is None:
        return None
    rows = []
    found = _list(topology.get("gpus")) if isinstance(topology, dict) else []
    gpus = [g for g in found if isinstance(g, dict) and isinstance(g.get("index"), int)]
    indices = sorted(g["index"] for g in gpus)
    for gpu in sorted(gpus, key=lambda g: g["index"]):
        paths: dict[str, Any] = gpu["paths"] if isinstance(gpu.get("paths"), dict) else {}
        links: dict[str, Any] = gpu["links"] if isinstance(gpu.get("links"), dict) else {}
        cells = []
        for peer in indices:
            if peer == gpu["index"]:
                cells.append({"text": "X", "link": False})
            else:
                cells.append({"text": paths.get(str(peer)) or "-", "link": bool(links.get(str(peer)))})
        rows.append(
            {
                "index": gpu["index"],
                "cells": cells,
                "numa_node": gpu.get("numa_node"),
                "cpu_affinity": gpu.get("cpu_affinity"),
                "nearest_nics": _list(gpu.get("nearest_nics")),
                "nearest_path": gpu.get("nearest_path"),
            }
        )
    return {
        "matrix": {"indices": indices, "rows": rows} if rows else None,
        "domain": state.domain if state else None,
        "label": domain_label(state.domain) if state and state.domain else None,
        "ready": state.ready if state else None,
        "problems": state.problems if state else [],
        "imex": imex_summary(state.imex) if state else None,
        "cards": [c.as_dict() for c in state.cards] if state else [],
    }
