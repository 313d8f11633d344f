"""What a connected agent reports, taken into the database: its samples, its shards, its engines.

- Heartbeats: the latest sample of each node, written in bulk (`write_heartbeats`, called by the
  write-behind buffer in apps.cluster.heartbeats) with the node's last-seen time; each sample also
  becomes a point of the node's history (apps.cluster.history). A node whose heartbeats stop is
  marked unreachable (`mark_unreachable_nodes`). The health of its GPUs (ECC faults, processes
  llmgw did not start) is written only when it changed.
- Shard states (`record_report`): the agent's word for each shard it runs, and the state of their
  replicas that follows from it (ready, failed with backoff, released once stopped).
- Engines (`record_engines`) and the answer to a doctor request (`record_doctor`).

Writers of node rows lock them in id order (a registration locks one), so two never deadlock.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from typing import Any

from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone
from django.utils.translation import gettext as _

from agent.messages import GpuFigures, HeartbeatSample
from apps.accounts import audit
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState
from apps.cluster.history import append_histories
from apps.cluster.models import Gpu, Node, Replica, Shard

__all__ = [
    "ENGINE_KEYS",
    "Health",
    "gpu_fault",
    "gpu_health",
    "mark_unreachable_nodes",
    "record_doctor",
    "record_engines",
    "record_heartbeats",
    "record_report",
    "sample_health",
    "write_gpu_health",
    "write_heartbeats",
]


# Heartbeats ------------------------------------------------------------------------------


def gpu_fault(gpu: GpuFigures) -> str:
    """Why the device cannot be trusted now, in its agent's words; "" when it can."""
    fault = gpu.get("fault")
    return fault[:1000] if isinstance(fault, str) else ""


def gpu_health(gpu: GpuFigures) -> tuple[bool, int]:
    """(ECC fault, processes not started by llmgw) for one GPU of a sample or registration."""
    ecc = gpu.get("ecc_uncorrected_volatile")
    fault = bool(ecc) or gpu.get("remapped_rows_failure") is True or gpu.get("remapped_rows_pending") is True
    foreign = gpu.get("foreign_processes")
    if foreign is None:
        foreign = len(gpu.get("processes") or [])
    return fault, int(foreign)


def record_heartbeats(samples: dict[int, tuple[HeartbeatSample, Any]]) -> int:
    """Store the latest sample of many nodes at once; returns how many rows were written."""
    return len(write_heartbeats(samples))


# The rows locked in id order first, as every writer of node rows does (a registration locks one),
# so two writers never hold one row each while waiting for the other's; then one UPDATE from the
# arrays. A node revoked meanwhile stays revoked. One statement, one round trip, one row write
# per node, and the desired state versions come back with it.
HEARTBEATS_SQL = """
WITH v AS (
    SELECT * FROM unnest(%s::bigint[], %s::text[], %s::timestamptz[]) AS v(id, sample, at)
), locked AS (
    SELECT n.id FROM {table} n JOIN v ON v.id = n.id ORDER BY n.id FOR UPDATE OF n
)
UPDATE {table} n
SET sample = v.sample::jsonb, sampled_at = v.at, last_seen_at = v.at,
    status = CASE WHEN n.revoked_at IS NULL THEN %s ELSE %s END
FROM v, locked
WHERE n.id = v.id AND locked.id = n.id
RETURNING n.id, n.desired_version
"""


def write_heartbeats(samples: dict[int, tuple[HeartbeatSample, Any]]) -> dict[int, int]:
    """Store the latest sample of many nodes at once and return {node id: desired state version}
    of the rows written. `samples` maps node id to (sample, time received). On PostgreSQL one
    statement per 500 nodes; elsewhere a bulk update. The samples also go to the nodes'
    histories and the fleet rollup."""
    if not samples:
        return {}
    ids = sorted(samples)
    versions: dict[int, int] = {}
    if connection.vendor == "postgresql":
        sql = HEARTBEATS_SQL.format(table=connection.ops.quote_name(Node._meta.db_table))
        with transaction.atomic(), connection.cursor() as cursor:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                cursor.execute(
                    sql,
                    [
                        chunk,
                        [json.dumps(samples[i][0], separators=(",", ":")) for i in chunk],
                        [samples[i][1] for i in chunk],
                        NodeStatus.READY,
                        NodeStatus.REVOKED,
                    ],
                )
                versions.update(cursor.fetchall())
    else:
        rows = [
            Node(
                pk=node_id,
                sample=samples[node_id][0],
                sampled_at=samples[node_id][1],
                last_seen_at=samples[node_id][1],
                status=NodeStatus.READY,
            )
            for node_id in ids
        ]
        with transaction.atomic():
            list(Node.objects.select_for_update().filter(pk__in=ids).order_by("pk").values_list("pk", flat=True))
            Node.objects.bulk_update(rows, ["sample", "sampled_at", "last_seen_at", "status"], batch_size=500)
            Node.objects.filter(pk__in=ids, revoked_at__isnull=False).update(status=NodeStatus.REVOKED)
            versions = dict(Node.objects.filter(pk__in=ids).values_list("pk", "desired_version"))
    append_histories({node_id: sample for node_id, (sample, _at) in samples.items() if node_id in versions})
    return versions


Health = tuple[bool, int, str]  # (uncorrected ECC errors, foreign processes, why it cannot be trusted)


def sample_health(sample: HeartbeatSample) -> dict[int, Health]:
    return {int(g["index"]): (*gpu_health(g), gpu_fault(g)) for g in sample.get("gpus") or []}


def write_gpu_health(node_id: int, health: dict[int, Health], known: dict[int, Health] | None) -> None:
    """Write the health rows of the devices whose health changed (rare: an ECC fault, a foreign
    process, a MIG or partition layout that changed under the agent)."""
    for index, (fault, foreign, untrusted) in health.items():
        if known is None or known.get(index) != (fault, foreign, untrusted):
            Gpu.objects.filter(node_id=node_id, index=index).update(
                ecc_fault=fault, foreign_processes=foreign, fault=untrusted
            )


def mark_unreachable_nodes(grace: timedelta) -> int:
    """Nodes whose agent missed its heartbeats for longer than the grace become unreachable."""
    cutoff = timezone.now() - grace
    return Node.objects.filter(status=NodeStatus.READY, last_seen_at__lt=cutoff).update(status=NodeStatus.UNREACHABLE)


# Reports of what the engines are doing -----------------------------------------------------------

SHARD_ID = re.compile(r"^r(\d+)s(\d+)$")


def _save_reported(shard: Any, fields: list[str]) -> bool:
    """Save what the agent said of a shard; False when the shard is gone: the reconciler released
    its replica (every shard of it had stopped) since this report read it. In a savepoint, so the
    rest of the report is still recorded."""
    try:
        with transaction.atomic():
            shard.save(update_fields=fields)
    except type(shard).NotUpdated:
        return False
    return True


@transaction.atomic
def record_report(node_id: int, states: list[dict[str, Any]]) -> set[int]:
    """Take the agent's word for its shards and move their replicas on: ready when every shard
    is, failed (with backoff) when one failed, released when a stopping one has stopped.
    Returns the ids of replicas whose state changed."""
    from apps.cluster.reconciler import backoff, request_reconcile

    now = timezone.now()
    reported: dict[tuple[int, int], dict[str, Any]] = {}
    for entry in states:
        match = SHARD_ID.match(str(entry.get("shard", "")))
        if match:
            reported[(int(match.group(1)), int(match.group(2)))] = entry
    shards = {(s.replica_id, s.rank): s for s in Shard.objects.filter(node_id=node_id).select_related("replica")}
    touched: set[int] = set()
    for key, shard in shards.items():
        state = reported.get(key)
        if state is None:
            # Not running there. For a stopping replica that is what we wanted.
            if shard.replica.state == ReplicaState.STOPPING and shard.state != ShardState.STOPPED:
                shard.state = ShardState.STOPPED
                if _save_reported(shard, ["state"]):
                    touched.add(shard.replica_id)
            continue
        new_state = state.get("state") if state.get("state") in ShardState.values else shard.state
        fields = {
            "state": new_state,
            "pid": state.get("pid"),
            "exit_code": state.get("exit_code"),
            "log_tail": list(state.get("log_tail") or [])[-50:],
            "message": str(state.get("message") or ""),
            "context_tokens": state.get("context_tokens"),
        }
        if any(getattr(shard, k) != v for k, v in fields.items()):
            for k, v in fields.items():
                setattr(shard, k, v)
            shard.reported_at = now
            if _save_reported(shard, [*fields, "reported_at"]):
                touched.add(shard.replica_id)
    for replica in Replica.objects.filter(pk__in=touched).prefetch_related("shards"):
        parts = list(replica.shards.all())
        if replica.state == ReplicaState.STOPPING:
            done = (ShardState.STOPPED, ShardState.FAILED)
            if all(s.state in done for s in parts):
                request_reconcile()
            elif any(s.rank == 0 and s.state in done for s in parts):
                # Its other ranks ran on while rank 0 drained (reconciler.desired_shards): their nodes'
                # agents are told to stop them now.
                waiting = {s.node_id for s in parts if s.rank > 0 and s.state not in done}
                Node.objects.filter(pk__in=waiting).update(desired_version=F("desired_version") + 1)
            continue
        failed = [s for s in parts if s.state == ShardState.FAILED]
        if failed:
            if replica.state != ReplicaState.FAILED:
                replica.state = ReplicaState.FAILED
                replica.failures += 1
                replica.next_attempt_at = now + backoff(replica.failures)
                first = failed[0]
                replica.message = _("An engine exited with code %(code)s: %(message)s") % {
                    "code": first.exit_code if first.exit_code is not None else "-",
                    "message": first.message or (first.log_tail[-1] if first.log_tail else ""),
                }
                replica.ready_at = None
                replica.save(update_fields=["state", "failures", "next_attempt_at", "message", "ready_at"])
                audit.record(
                    None,
                    "replica.failed",
                    replica,
                    changes={"failures": replica.failures, "exit_code": first.exit_code},
                )
        elif all(s.state == ShardState.READY for s in parts) and replica.state != ReplicaState.READY:
            replica.state = ReplicaState.READY
            replica.ready_at = now
            replica.failures = 0
            replica.message = ""
            replica.save(update_fields=["state", "ready_at", "failures", "message"])
            request_reconcile()  # a replacement ready: the replica it replaces may stop now, not at the next beat
    return touched


ENGINE_KEYS = ("engines", "engine_versions", "engines_probed", "engine_status", "engine_sources", "engine_builds")


def record_engines(node_id: int, report: dict[str, Any]) -> bool:
    """Take the agent's word for its engines (usable ones, versions, installs in progress or
    failed). A node that gained an engine gets a reconciler pass: its pending models may fit now.
    Returns whether anything changed."""
    from apps.cluster.reconciler import request_reconcile

    with transaction.atomic():
        node = Node.objects.select_for_update().filter(pk=node_id).first()
        if node is None:
            return False
        before = {key: node.hardware.get(key) for key in ENGINE_KEYS}
        after = {key: report.get(key) for key in ENGINE_KEYS if key in report}
        if all(before.get(k) == v for k, v in after.items()):
            return False
        node.hardware = {**node.hardware, **after}
        node.save(update_fields=["hardware"])
        gained = set(after.get("engines") or []) - set(before.get("engines") or [])
        lost = set(before.get("engines") or []) - set(after.get("engines") or [])
        if gained or lost:
            audit.record(
                None,
                "node.engines",
                node,
                changes={"engines": [sorted(before.get("engines") or []), sorted(after.get("engines") or [])]},
            )
        if gained:
            request_reconcile()
    return True


def record_doctor(node_id: int, body: dict[str, Any]) -> None:
    """The agent's answer to a doctor request: its checks, kept on the node."""
    result = body.get("result") if body.get("ok") else None
    checks = result.get("checks") if isinstance(result, dict) else None
    if not isinstance(checks, list):
        checks = [{"name": "doctor", "status": "fail", "detail": str(body.get("error") or "no answer"), "fix": ""}]
    clean = [
        {k: str(item.get(k) or "")[:2000] for k in ("name", "status", "detail", "fix")}
        for item in checks[:200]
        if isinstance(item, dict)
    ]
    Node.objects.filter(pk=node_id).update(doctor=clean, doctor_at=timezone.now())
