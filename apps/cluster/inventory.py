"""The database's view of the cluster as placement's plain snapshot (and back).

Other apps' parts of each node's snapshot (its fabrics, NVLink domain and location) come from the
parts registered in apps.cluster.extensions, filled into the snapshot's `extra` after the cluster
app's own part is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from agent.messages import HeartbeatSample
from apps.catalog.models import Model
from apps.cluster import decisions
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.cluster.decisions import RUNNING_FIELDS, profile_spec, running_spec
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.gpu_classes import class_share
from apps.cluster.models import Node, Replica, Shard
from apps.cluster.placement import NODE_STATUS, CapacityQuota, Claim, GpuSlot, Inventory, NodeSnapshot, ReplicaRequest
from apps.quotas.models import CapacityQuota as QuotaRow

__all__ = [
    "CLAIMING_STATES",
    "RUNNING_FIELDS",
    "build_inventory",
    "fetch_states",
    "held_weights",
    "profile_spec",
    "replica_request",
    "running_spec",
    "slot_share",
]

# Replicas whose shards hold their claims: a stopping replica still occupies its node until it stopped.
CLAIMING_STATES = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.STOPPING, ReplicaState.FAILED)


def nvlink_groups(hardware: dict[str, Any]) -> dict[int, str]:
    """GPU index -> its NVLink group inside the node, as the agent worked it out from `nvidia-smi
    topo -m` (or AMD cards' XGMI links from `amd-smi topology`) at registration (cards joined by
    NVLink or XGMI share one). {} when not reported (unknown)."""
    topology = hardware.get("gpu_topology")
    gpus = topology.get("gpus") if isinstance(topology, dict) else None
    if not isinstance(gpus, list):
        return {}
    return {
        gpu["index"]: str(gpu["group"])
        for gpu in gpus
        if isinstance(gpu, dict) and isinstance(gpu.get("index"), int) and gpu.get("group")
    }


def slot_share(share: float | None, parent: int | None, gpu_class: str) -> float:
    """The part of its card a device is: a whole card 1; a slice what its agent said, else the share
    its class names (a 1g of an H100 1/7), as held GPU time counts it."""
    if parent is None:
        return 1.0
    if share is not None and 0 < share <= 1:
        return share
    return class_share(gpu_class)


def _snapshot(node: Node) -> NodeSnapshot:
    linked = nvlink_groups(node.hardware or {})
    gpus = [
        GpuSlot(
            index=g.index,
            gpu_class=g.gpu_class or g.name or "unknown",
            healthy=g.healthy,
            nvlink_group=linked.get(g.index),
            vendor=g.vendor or "nvidia",
            kind=g.kind,
            parent=g.parent_index,
            split=g.split,
            memory_group=g.memory_group or None,
            fault=g.fault or None,
            label=g.label,
            share=slot_share(g.share, g.parent_index, g.gpu_class),
        )
        for g in node.gpus.all()
    ]
    engines = node.hardware.get("engines")
    weights, weight_dirs, partial = held_weights(node)
    snapshot = NodeSnapshot(
        id=node.pk,
        name=node.name,
        ready=node.live_status == NodeStatus.READY,
        cordoned=node.cordoned,
        cordon_reason=node.cordon_reason,
        labels=node.placement_labels,
        memory_total_bytes=node.memory_total_bytes,
        cpus=node.cpus,
        gpus=gpus,
        engines=frozenset(engines) if isinstance(engines, list) else None,
        engine_status={
            str(k): str(v) for k, v in (node.hardware.get("engine_status") or {}).items() if isinstance(v, str)
        },
        engine_builds={
            str(k): str(v) for k, v in (node.hardware.get("engine_builds") or {}).items() if isinstance(v, str)
        },
        fabric=None,
        weights=weights,
        weight_dirs=weight_dirs,
        partial_dirs=partial,
        fetches=fetch_states(node.latest_sample),
    )
    NODE_STATUS.put(snapshot, node.live_status)
    return snapshot


def held_weights(node: Node) -> tuple[frozenset[str], frozenset[str] | None, frozenset[str]]:
    """The model sources the node holds whole (paths on it), the directories it reports them for
    (None when it reports none), and those of them whose scan stopped at its bounds (a source in
    one may be there unlisted). Older agents named the entries relative to their directories."""
    pools = (node.latest_sample or {}).get("storage") or []
    held: set[str] = set()
    dirs: set[str] = set()
    partial: set[str] = set()
    for pool in pools:
        if not isinstance(pool, dict):
            continue
        directories = [d for d in pool.get("directories") or [] if isinstance(d, str)]
        dirs.update(directories)
        partial.update(d for d in pool.get("partial") or [] if isinstance(d, str))
        for entry in pool.get("weights") or []:
            if not isinstance(entry, str):
                continue
            if entry.startswith("/"):
                held.add(entry)
            else:
                held.update(f"{d.rstrip('/')}/{entry}" for d in directories)
    return frozenset(held), (frozenset(dirs) if dirs else None), frozenset(partial)


FETCH_STATES = ("held", "fetching", "refused", "failed")


def fetch_states(sample: HeartbeatSample | None) -> dict[str, tuple[str, str]]:
    """What a node said in a heartbeat's sample of the weights it was told to fetch (the mirror's
    versions): directory -> (state, reason). Entries it did not say clearly are left out."""
    out: dict[str, tuple[str, str]] = {}
    for entry in (sample or {}).get("mirror") or []:
        if not isinstance(entry, dict):
            continue
        directory, state = entry.get("dir"), entry.get("state")
        if isinstance(directory, str) and directory.startswith("/") and state in FETCH_STATES:
            out[directory.rstrip("/")] = (str(state), str(entry.get("message") or ""))
    return out


def build_inventory(*, exclude_replicas: Iterable[int] = ()) -> Inventory:
    excluded = set(exclude_replicas)
    rows = {n.pk: n for n in Node.objects.exclude(status=NodeStatus.REVOKED).prefetch_related("gpus")}
    nodes = {pk: _snapshot(n) for pk, n in rows.items()}
    EXTENSIONS.snapshot(nodes, rows)
    claims = []
    shards = (
        Shard.objects.filter(replica__state__in=CLAIMING_STATES)
        .select_related(
            "replica__model__organization", "replica__model__team__organization", "replica__model__project__team"
        )
        .order_by("replica_id", "rank")
    )
    for shard in shards:
        if shard.replica_id in excluded or shard.node_id not in nodes:
            continue
        replica = shard.replica
        claims.append(
            Claim(
                replica=str(replica.pk),
                shard=shard.rank,
                node_id=shard.node_id,
                gpu_indices=tuple(shard.gpu_indices or ()),
                memory_bytes=shard.memory_bytes,
                cpu_cores=shard.cpu_cores,
                owner=replica.model.owner_keys(),
                capacity_class=replica.model.effective_class,
                model=replica.model.name,
                above_minimum=replica.above_minimum,
            )
        )
    quotas = {
        row.owner_key: CapacityQuota(
            gpus=row.gpus, cpu_cores=row.cpu_cores, memory_bytes=row.memory_bytes, replicas=row.replicas
        )
        for row in QuotaRow.objects.all()
    }
    inventory = Inventory(nodes=nodes, claims=claims, quotas=quotas)
    return inventory


def replica_request(model: Model, replica: Replica | None = None) -> ReplicaRequest:
    return decisions.replica_request(model, model.profiles.all(), replica)
