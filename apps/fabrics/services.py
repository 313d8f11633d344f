"""Nodes' ports → physical fabrics: what placement reads, what the API and pages list.

A port's physical identity is what every port of one fabric shares and ports of separate
fabrics cannot: for InfiniBand the subnet managers of its fabric — the master it sees, merged
with every manager listed together with it (`saquery SMIR`), named by the lowest GUID among
them so the name survives a failover — and for RoCE the IP network of its RoCE v2 address.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.core.cache import cache
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from agent.messages import HeartbeatSample
from apps.cluster.placement import Group, NodeSnapshot
from apps.cluster.samples import read_sample
from apps.fabrics.models import MasterChange, NodeFabrics
from apps.fabrics.placement import FABRICS, UNVERIFIED, FabricAttachment

if TYPE_CHECKING:
    from apps.cluster.models import Node

__all__ = [
    "attachments_for",
    "node_ports",
    "contribute_snapshots",
    "fabrics_overview",
    "port_identity",
    "record_fabrics",
    "shard_env",
    "subnet_manager_sets",
]

SM_CACHE_KEY = "fabrics:subnet-managers"
SM_CACHE_SECONDS = 10

PORT_FIELDS = (
    "device",
    "port",
    "fabric",
    "link_layer",
    "up",
    "state",
    "phys_state",
    "port_guid",
    "sm_guid",
    "network",
    "rate_gbps",
    "netdev",
)


def _natural(text: str) -> list[Any]:
    # isdecimal(), not isdigit(): "²" is a digit that int() refuses
    return [int(part) if part.isdecimal() else part for part in re.split(r"(\d+)", text)]


def _key(port: Mapping[str, Any]) -> str:
    return f"{port.get('device')}/{port.get('port')}"


@transaction.atomic
def record_fabrics(node_id: int, body: dict[str, Any]) -> NodeFabrics:
    """Replace the node's ports with what its agent says it carries now; keep each change of master."""
    row, _created = NodeFabrics.objects.select_for_update().get_or_create(node_id=node_id)
    before = {_key(p): p.get("sm_guid") for p in row.ports or [] if isinstance(p, dict)}
    ports = [{k: p[k] for k in PORT_FIELDS if k in p} for p in body.get("ports") or [] if isinstance(p, dict)]
    for port in ports:
        old, new = before.get(_key(port)), port.get("sm_guid")
        if old and new and old != new:
            MasterChange.objects.create(node_id=node_id, port=_key(port), previous=old, master=new)
    row.ports = ports
    row.declared = [str(n) for n in body.get("declared") or []]
    row.flaps = {str(k): int(v) for k, v in (body.get("flaps") or {}).items()}
    row.interfaces = {
        str(k): [str(a) for a in v] for k, v in (body.get("interfaces") or {}).items() if isinstance(v, list)
    }
    row.changes += 1
    row.changed_at = timezone.now()
    row.save()
    return row


def subnet_manager_sets(
    samples: Iterable[HeartbeatSample | None],
) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """From the nodes' samples: every subnet manager GUID -> its fabric's name (the lowest GUID of the
    managers listed together), and GUID -> what is known of that manager (priority, state, lid)."""
    parent: dict[str, str] = {}

    def find(guid: str) -> str:
        while parent.setdefault(guid, guid) != guid:
            parent[guid] = parent[parent[guid]]
            guid = parent[guid]
        return guid

    managers: dict[str, dict[str, Any]] = {}
    for sample in samples:
        for entry in (sample or {}).get("subnet_managers") or []:
            if not isinstance(entry, dict) or not entry.get("master"):
                continue
            master = str(entry["master"])
            find(master)
            for record in entry.get("managers") or []:
                guid = str(record.get("guid") or "")
                if not guid:
                    continue
                managers[guid] = {k: record.get(k) for k in ("lid", "priority", "state", "act_count")}
                a, b = find(master), find(guid)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return {guid: find(guid) for guid in list(parent)}, managers


def port_identity(port: Mapping[str, Any], sm_sets: dict[str, str]) -> str | None:
    if port.get("link_layer") == "Ethernet":
        network = port.get("network")
        return f"roce:{network}" if network else None
    master = port.get("sm_guid")
    return f"ib:{sm_sets.get(master, master)}" if master else None


def _expected_rates(rows: Iterable[NodeFabrics], sm_sets: dict[str, str]) -> dict[str, float]:
    """Per physical fabric, the rate most of its up ports run at (ties: the higher)."""
    rates: dict[str, Counter[float]] = {}
    for row in rows:
        for port in row.ports or []:
            identity = port_identity(port, sm_sets)
            rate = port.get("rate_gbps")
            if port.get("up") and identity and isinstance(rate, int | float):
                rates.setdefault(identity, Counter())[float(rate)] += 1
    return {k: max(c.items(), key=lambda item: (item[1], item[0]))[0] for k, c in rates.items()}


def attachments_for(
    row: NodeFabrics,
    sm_sets: dict[str, str],
    expected: dict[str, float],
    leaves: dict[str, dict[str, dict[str, Any]]] | None = None,
) -> list[FabricAttachment]:
    """The node's declared fabrics as placement's snapshot holds them (see apps.fabrics.placement).

    With the fabrics' maps (`leaves`: fabric -> port GUID -> its leaf), a node's leaf is the set of
    leaves its ports on the fabric are cabled to: one switch on a plain fat tree, one leaf per rail
    on a rail-optimised one (nodes with the same set share their rails' leaves)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for port in row.ports or []:
        if port.get("up") and port.get("fabric"):
            by_name.setdefault(str(port["fabric"]), []).append(port)
    out = []
    for name in sorted(by_name):
        ports = sorted(by_name[name], key=lambda p: (_natural(str(p.get("device"))), p.get("port") or 0))
        on: dict[str, list[dict[str, Any]]] = {}
        for port in ports:
            identity = port_identity(port, sm_sets)
            if identity:
                on.setdefault(identity, []).append(port)
        kind = "roce" if all(p.get("link_layer") == "Ethernet" for p in ports) else "ib"
        attachment: FabricAttachment = {
            "name": name,
            "kind": kind,
            "identity": None,
            "problem": "",
            "leaf": None,
            "hcas": [],  # these three are worked out below
            "netdevs": [],
            "short": False,
        }
        if len(on) > 1:
            attachment["problem"] = _("its adapters for %(name)s sit on %(count)s fabrics: %(where)s") % {
                "name": name,
                "count": len(on),
                "where": "; ".join(
                    f"{', '.join(str(p['device']) for p in found)} on {identity}"
                    for identity, found in sorted(on.items())
                ),
            }
            chosen = ports
        elif on:
            [(identity, chosen)] = on.items()
            attachment["identity"] = identity
        else:
            chosen = ports
        attachment["hcas"] = sorted({str(p["device"]) for p in chosen}, key=_natural)
        attachment["netdevs"] = sorted({str(p["netdev"]) for p in chosen if p.get("netdev")}, key=_natural)
        rate = expected.get(attachment["identity"] or "")
        attachment["short"] = bool(
            rate and any(isinstance(p.get("rate_gbps"), int | float) and p["rate_gbps"] < rate for p in chosen)
        )
        mapped = (leaves or {}).get(attachment["identity"] or "", {})
        found = [mapped[str(p["port_guid"])] for p in chosen if p.get("port_guid") and str(p["port_guid"]) in mapped]
        if found and len(found) == len(chosen) and all(f["leaf"] for f in found):
            attachment["leaf"] = ",".join(sorted({str(f["leaf"]) for f in found}))
            attachment["leaf_name"] = ", ".join(dict.fromkeys(str(f["leaf_name"]) for f in found))
        if any(f["degraded"] for f in found):
            attachment["short"] = True
        out.append(attachment)
    return out


def _load(
    node_ids: Iterable[int] | None = None, samples: Iterable[HeartbeatSample | None] | None = None
) -> tuple[list[NodeFabrics], dict[str, str], dict[str, Any]]:
    """The nodes' ports, and the subnet managers their samples list (every node's: a fabric's
    managers are what any of its nodes saw). `samples`, when the caller holds them already."""
    from apps.cluster.models import Node

    rows = NodeFabrics.objects.select_related("node")
    if node_ids is not None:
        rows = rows.filter(node_id__in=list(node_ids))
    rows_list = list(rows)
    if samples is not None:
        sm_sets, managers = subnet_manager_sets(samples)
        return rows_list, sm_sets, managers
    # Pages that refresh every few seconds (a node's, the fabrics') share one reading of the
    # subnet managers for a while rather than reading every node's sample each time.
    cached = cache.get(SM_CACHE_KEY)
    if cached is None:
        found = (read_sample(s) for s in Node.objects.exclude(fabric_ports=None).values_list("sample", flat=True))
        cached = subnet_manager_sets(found)
        cache.set(SM_CACHE_KEY, cached, SM_CACHE_SECONDS)
    sm_sets, managers = cached
    return rows_list, sm_sets, managers


def contribute_snapshots(snapshots: dict[int, NodeSnapshot], nodes: dict[int, Node] | None = None) -> None:
    """Give each node of a placement snapshot its fabrics (`extra["fabrics"]`); `nodes`: the Node rows
    the snapshot was built from, whose samples hold the subnet managers."""
    from apps.fabrics.maps import latest_maps, port_leaves

    samples = [n.latest_sample for n in nodes.values()] if nodes is not None else None
    rows, sm_sets, _managers = _load(samples=samples)
    expected = _expected_rates(rows, sm_sets)
    leaves = port_leaves(latest_maps()) if rows else {}
    for row in rows:
        snapshot = snapshots.get(row.node_id)
        if snapshot is not None:
            FABRICS.put(snapshot, attachments_for(row, sm_sets, expected, leaves))


def shard_env(node_id: int, group: Group | None) -> dict[str, str]:
    """What NCCL needs on one node of a replica formed on the fabric `group` names: its adapters on
    that fabric by exact name (a bare mlx5_1 would also match mlx5_10), and for RoCE the netdevs and
    the RoCE v2 / IPv4 GID NCCL is to pick."""
    if not group:
        return {}
    from apps.fabrics.nvlink import shard_env as nvlink_env

    mnnvl = nvlink_env(group)
    if mnnvl is not None:
        return mnnvl
    identity = group[0]
    row = NodeFabrics.objects.select_related("node").filter(node_id=node_id).first()
    if row is None:
        return {}
    rows, sm_sets, _managers = _load([node_id])
    for att in attachments_for(row, sm_sets, {}):
        matches = att["identity"] == identity or (att["identity"] is None and identity == f"{UNVERIFIED}{att['name']}")
        if not matches or att["problem"] or not att["hcas"]:
            continue
        env = {"NCCL_IB_HCA": "=" + ",".join(att["hcas"]), "NCCL_IB_DISABLE": "0"}
        if att["kind"] == "roce":
            env["NCCL_IB_ROCE_VERSION_NUM"] = "2"
            env["NCCL_IB_ADDR_FAMILY"] = "AF_INET"
            if att["netdevs"]:
                env["NCCL_SOCKET_IFNAME"] = "=" + ",".join(att["netdevs"])
        else:
            # NCCL's bootstrap is TCP: over the interface holding the address the other shards reach
            # this node at (the control plane's), when the agent said which that is.
            address = row.node.address
            bootstrap = sorted(name for name, ips in (row.interfaces or {}).items() if address and address in ips)
            if bootstrap:
                env["NCCL_SOCKET_IFNAME"] = "=" + bootstrap[0]
        return env
    return {}


def node_ports(node: Node) -> list[dict[str, Any]]:
    """A node's ports for its page: state, rate, the declared and the physical fabric each carries,
    its master subnet manager, and the error counters that are not zero. [] when it has none."""
    sample = node.latest_sample
    ports = list(sample.get("ib_ports") or []) if sample is not None else []
    if not ports:
        return []
    _rows, sm_sets, _managers = _load()
    out = []
    for port in ports:
        errors = {k: v for k, v in (port.get("errors") or {}).items() if isinstance(v, int) and v}
        out.append(
            {
                "name": _key(port),
                "link_layer": port.get("link_layer"),
                "up": port.get("up"),
                "state": port.get("state_name") or port.get("state"),
                "phys_state": port.get("phys_state_name") or port.get("phys_state"),
                "rate_gbps": port.get("rate_gbps"),
                "fabric": port.get("fabric") or "",
                "identity": port_identity(port, sm_sets) if port.get("up") else None,
                "sm_guid": port.get("sm_guid"),
                "network": port.get("network"),
                "errors": sorted(errors.items()),
                "flaps": port.get("flaps") or 0,
            }
        )
    return out


def fabrics_overview() -> dict[str, Any]:
    """Every physical fabric with its nodes, names and subnet managers, and what is wrong."""
    rows, sm_sets, managers = _load()
    expected = _expected_rates(rows, sm_sets)
    fabrics: dict[str, dict[str, Any]] = {}
    problems: list[dict[str, Any]] = []
    names: dict[str, set[str]] = {}
    hour_ago = timezone.now() - timedelta(hours=1)
    day_ago = timezone.now() - timedelta(days=1)
    for row in rows:
        node = row.node.name
        for port in row.ports or []:
            identity = port_identity(port, sm_sets)
            name = str(port.get("fabric") or "")
            where = f"{node} {_key(port)}"
            problems.extend(_port_problems(port, name, identity, where))
            if not port.get("up") or identity is None:
                continue
            fabric = fabrics.setdefault(identity, _new_fabric(identity, expected))
            _add_port(fabric, port, node, name, where)
            if name:
                names.setdefault(name, set()).add(identity)
    for name, identities in sorted(names.items()):
        if len(identities) > 1:
            problems.append(
                {
                    "code": "name_splits",
                    "message": _("fabric name %(name)s covers %(count)s fabrics: %(ids)s")
                    % {"name": name, "count": len(identities), "ids": ", ".join(sorted(identities))},
                }
            )
    out = [
        _fabric_summary(identity, fabrics[identity], sm_sets, managers, (hour_ago, day_ago), problems)
        for identity in sorted(fabrics)
    ]
    return {"fabrics": out, "problems": problems}


def _port_problems(port: dict[str, Any], name: str, identity: str | None, where: str) -> list[dict[str, Any]]:
    """What is wrong with one port on its own: a link no subnet manager brought up, and for a port
    that is up, no declared fabric or a fabric that cannot be checked."""
    problems = []
    if port.get("link_layer") == "InfiniBand" and port.get("state") == 2 and port.get("phys_state") == 5:
        problems.append(
            {
                "code": "no_sm",
                "message": _("%(port)s has a link but no subnet manager brought it up (INIT)") % {"port": where},
            }
        )
    if not port.get("up"):
        return problems
    if not name:
        problems.append(
            {"code": "undeclared", "message": _("%(port)s is up but on no declared fabric") % {"port": where}}
        )
    if identity is None:
        problems.append(
            {
                "code": "unchecked",
                "message": _("%(port)s is up but its fabric cannot be checked (no subnet manager answered it)")
                % {"port": where},
            }
        )
    return problems


def _new_fabric(identity: str, expected: dict[str, float]) -> dict[str, Any]:
    """A physical fabric as fabrics_overview() gathers it, before its first port."""
    return {
        "id": identity,
        "kind": "roce" if identity.startswith("roce:") else "ib",
        "names": set(),
        "nodes": set(),
        "ports": 0,
        "masters": set(),
        "expected_gbps": expected.get(identity),
        "short": [],
    }


def _add_port(fabric: dict[str, Any], port: dict[str, Any], node: str, name: str, where: str) -> None:
    """Count a port that is up on its fabric: its node, the name declared, the master it sees, and
    its rate when below the fabric's expected one."""
    fabric["ports"] += 1
    fabric["nodes"].add(node)
    if name:
        fabric["names"].add(name)
    if port.get("sm_guid"):
        fabric["masters"].add(str(port["sm_guid"]))
    rate = port.get("rate_gbps")
    if fabric["expected_gbps"] and isinstance(rate, int | float) and rate < fabric["expected_gbps"]:
        fabric["short"].append({"port": where, "rate_gbps": rate})


def _fabric_summary(
    identity: str,
    fabric: dict[str, Any],
    sm_sets: dict[str, str],
    managers: dict[str, Any],
    since: tuple[datetime, datetime],
    problems: list[dict[str, Any]],
) -> dict[str, Any]:
    """One fabric as fabrics_overview() lists it; what is wrong with it is added to `problems`.
    `since`: an hour ago and a day ago."""
    if len(fabric["names"]) > 1:
        problems.append(
            {
                "code": "names_share",
                "message": _("fabric %(id)s goes by %(count)s names: %(names)s")
                % {"id": identity, "count": len(fabric["names"]), "names": ", ".join(sorted(fabric["names"]))},
            }
        )
    sms: list[dict[str, Any]] = []
    master_changes: list[dict[str, Any]] = []
    if fabric["kind"] == "ib":
        sms, master_changes = _subnet_managers(identity, fabric, sm_sets, managers, since, problems)
    return {
        "id": identity,
        "kind": fabric["kind"],
        "names": sorted(fabric["names"]),
        "nodes": sorted(fabric["nodes"]),
        "ports": fabric["ports"],
        "expected_gbps": fabric["expected_gbps"],
        "short": fabric["short"],
        "subnet_managers": sms,
        "standbys": sum(1 for sm in sms if not sm["master"]) if fabric["kind"] == "ib" else None,
        "master_changes": master_changes,
    }


def _subnet_managers(
    identity: str,
    fabric: dict[str, Any],
    sm_sets: dict[str, str],
    managers: dict[str, Any],
    since: tuple[datetime, datetime],
    problems: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An InfiniBand fabric's subnet managers (which are master) and their master changes of the
    last day, newest first (at most 50); its ports disagreeing on the master, no standby and a
    change in the last hour are added to `problems`. `since`: an hour ago and a day ago."""
    hour_ago, day_ago = since
    root = identity[3:]
    members = sorted(g for g, r in sm_sets.items() if r == root)
    sms = [{"guid": g, **managers.get(g, {}), "master": g in fabric["masters"]} for g in members]
    if len(fabric["masters"]) > 1:
        problems.append(
            {
                "code": "masters_disagree",
                "message": _("ports of fabric %(id)s disagree on the master subnet manager: %(masters)s")
                % {"id": identity, "masters": ", ".join(sorted(fabric["masters"]))},
            }
        )
    if len(sms) < 2:
        problems.append(
            {
                "code": "no_standby",
                "message": _("fabric %(id)s has no standby subnet manager") % {"id": identity},
            }
        )
    changes = list(MasterChange.objects.filter(master__in=members, at__gte=day_ago).order_by("-at")[:50])
    master_changes = [
        {"at": c.at.isoformat(), "node": c.node_id, "port": c.port, "previous": c.previous, "master": c.master}
        for c in changes
    ]
    if any(c.at >= hour_ago for c in changes):
        problems.append(
            {
                "code": "master_changed",
                "message": _("the master subnet manager of fabric %(id)s changed in the last hour") % {"id": identity},
            }
        )
    return sms, master_changes


def topology_view(fabric: str) -> dict[str, Any] | None:
    """The fabric's newest map with the cluster's own adapters live on it: for each port GUID the
    node and port it is, whether it is up, and its data counters (bytes) as last sampled. None when
    the fabric has never been mapped."""
    from apps.cluster.models import AgentRequest
    from apps.fabrics.maps import latest_maps

    kept = latest_maps().get(fabric)
    requests = [
        {
            "id": r.pk,
            "node": r.node.name,
            "state": r.state,
            "error": r.error,
            "created_at": r.created_at.isoformat(),
            "answered_at": r.answered_at.isoformat() if r.answered_at else None,
        }
        for r in AgentRequest.objects.filter(kind="ibnetdiscover", params__fabric=fabric)
        .select_related("node")
        .order_by("-created_at")[:5]
    ]
    if kept is None:
        return {"fabric": fabric, "map": None, "live": {}, "requests": requests}
    live: dict[str, dict[str, Any]] = {}
    for row in NodeFabrics.objects.select_related("node"):
        sample = row.node.latest_sample
        for port in sample.get("ib_ports") or [] if sample is not None else []:
            guid = port.get("port_guid")
            if guid:
                live[str(guid)] = {
                    "node": row.node.name,
                    "port": _key(port),
                    "up": port.get("up"),
                    "state": port.get("state_name"),
                    "phys_state": port.get("phys_state_name"),
                    "rate_gbps": port.get("rate_gbps"),
                    "xmit_bytes": port.get("xmit_bytes"),
                    "rcv_bytes": port.get("rcv_bytes"),
                    "taken_at": sample.get("taken_at") if sample is not None else None,
                }
    return {
        "fabric": fabric,
        "taken_at": kept.taken_at.isoformat(),
        "mapped_from": kept.node.name if kept.node else None,
        "map": kept.data,
        "live": live,
        "requests": requests,
    }


def fabric_weights() -> dict[str, list[dict[str, Any]]]:
    """For each physical fabric, the models whose weights its nodes hold, and how many copies: a
    node's local copy counts one, a shared filer (the same mount on several nodes) once per fabric,
    since "can this fabric serve it without a copy over the management network" is the question."""
    from apps.catalog.models import Model

    sources: dict[str, str] = {}
    for name, source in Model.objects.live().exclude(source="").values_list("name", "source"):
        sources.setdefault(str(source), str(name))
    rows, sm_sets, _managers = _load()
    held: dict[str, dict[str, set[str]]] = {}
    for row in rows:
        identities = {port_identity(p, sm_sets) for p in row.ports or [] if p.get("up")} - {None}
        sample = row.node.latest_sample
        for pool in sample.get("storage") or [] if sample is not None else []:
            where = (
                f"shared:{pool.get('fstype')}:{pool.get('mount_point')}" if pool.get("shared") else f"{row.node.name}"
            )
            for entry in pool.get("weights") or []:
                model = sources.get(str(entry))
                if model is None:
                    continue
                for identity in identities:
                    held.setdefault(str(identity), {}).setdefault(model, set()).add(where)
    return {
        fabric: [{"model": m, "copies": len(where)} for m, where in sorted(models.items())]
        for fabric, models in sorted(held.items())
    }
