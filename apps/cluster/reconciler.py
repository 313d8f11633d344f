"""The reconciler: compare what is wanted with what runs, and move one step closer.

Level-triggered and idempotent: every pass reads the whole desired and actual state
from the database and acts on the difference, so a lost message or a crashed worker
costs a pass, never correctness. One pass runs at a time across all workers (a locked
row). What a pass decides is apps.cluster.decisions (the fleet simulator runs the same code on a copy
in memory); this module gives it the database as its store and, after the commit, sends every
node whose shard list changed its desired state.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Prefetch
from django.db.models.signals import post_save
from django.utils import timezone
from django.utils.translation import gettext as _
from prometheus_client import Counter

from agent.messages import DesiredMessage, DesiredShardMessage, DrainingShardMessage
from apps.catalog.models import Model, Profile
from apps.cluster import placement
from apps.cluster.choices import ReplicaState, ShardState, StopReason
from apps.cluster.decisions import PREEMPT_HOLD, PassReport, ShardView, backoff, run_pass
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.inventory import build_inventory
from apps.cluster.models import ControlLock, Gpu, Node, Replica, Shard

__all__ = [
    "PREEMPT_HOLD",
    "ROUTES_SETTLE_S",
    "DatabaseStore",
    "PassReport",
    "backoff",
    "draining_shards",
    "reconcile",
    "request_reconcile",
    "stop_model_replicas",
]

log = logging.getLogger(__name__)

#: How long after a replica is stopped every gateway process has stopped routing to it: each reads
#: the table version every LLMGW_GATEWAY_REFRESH_SECONDS (sooner when Redis announces the change)
#: and then loads its tables. An engine that is idle is not stopped before this, so a request a
#: gateway sent just before it heard is not cut off.
ROUTES_SETTLE_S = settings.GATEWAY_REFRESH_SECONDS * 2 + 2
#: What of a replica the gateways' routes are made of (its state, its profile, why it cannot be
#: placed, why it stops).
ROUTED_FIELDS = frozenset({"state", "profile_id", "rejections", "stop_reason", "drain_grace"})

PASSES = Counter("llmgw_reconcile_passes", "Reconciler passes, by how they ended", ["result"])


def request_reconcile() -> None:
    """Kick a pass once the current transaction commits (beat runs one every few seconds anyway)."""

    def kick() -> None:
        try:
            from apps.cluster.tasks import reconcile as task

            task.delay()
        except Exception:  # the broker being down must not fail the change that asked for a pass
            log.warning("could not queue a reconciler pass; beat will run one", exc_info=True)

    transaction.on_commit(kick)


def stop_model_replicas(model: Model) -> int:
    """A deleted model's replicas (registered with apps.catalog.extensions): its pending ones go,
    the others stop once the requests they hold are answered (at most LLMGW_DRAIN_GRACE_SECONDS),
    from the moment it was deleted; their nodes hear after commit. Returns how many stop."""
    now = model.deleted_at or timezone.now()
    replicas = Replica.objects.filter(model=model)
    stopping = list(replicas.exclude(state__in=(ReplicaState.PENDING, ReplicaState.STOPPING)))
    replicas.filter(state=ReplicaState.PENDING).delete()
    nodes: set[int] = set()
    for replica in stopping:
        replica.state = ReplicaState.STOPPING
        replica.stop_requested_at = now
        replica.stop_reason = StopReason.DELETED
        replica.drain_grace = settings.DRAIN_GRACE
        replica.message = str(_("Stopping: the model was deleted."))
        replica.save(update_fields=["state", "stop_requested_at", "stop_reason", "drain_grace", "message"])
        nodes.update(replica.shards.values_list("node_id", flat=True))
    if nodes:
        Node.objects.filter(pk__in=nodes).update(desired_version=F("desired_version") + 1)
        transaction.on_commit(lambda: push_desired_state(nodes))
    return len(stopping)


def _lock() -> bool:
    """Take the reconciler lock for this transaction; False when another pass holds it. Only the
    database's "lock not available" means that: any other error is the pass's failure, and raised."""
    from django.db import OperationalError

    ControlLock.objects.get_or_create(name="reconciler")
    try:
        with transaction.atomic():  # a savepoint: the refused lock leaves the outer transaction usable
            ControlLock.objects.select_for_update(nowait=True).get(name="reconciler")
    except OperationalError as exc:
        if _lock_not_available(exc):
            return False
        raise
    return True


def _lock_not_available(exc: BaseException) -> bool:
    """PostgreSQL's 55P03 (SQLite serialises writers and never refuses NOWAIT)."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "55P03" or type(cause).__name__ == "LockNotAvailable"


def _allocate_port(node_id: int, taken: dict[int, set[int]]) -> int:
    """A port no shard on the node holds, searched from a random point of the range: a port some other
    program took on the node (which only the engine's failure reveals) is then not tried again on retry."""
    used = taken.setdefault(node_id, set(Shard.objects.filter(node_id=node_id).values_list("port", flat=True)))
    low, high = settings.ENGINE_PORT_MIN, settings.ENGINE_PORT_MAX
    size = high - low + 1
    start = secrets.randbelow(size)
    for step in range(size):
        port = low + (start + step) % size
        if port not in used:
            used.add(port)
            return port
    raise RuntimeError(f"node {node_id} has no free engine port between {low} and {high}")


def reconcile(now: Any = None) -> PassReport:
    """One pass, counted in llmgw_reconcile_passes_total by how it ended: ran, skipped (another pass
    held the lock) or failed (logged with the error, then raised)."""
    now = now or timezone.now()
    try:
        with transaction.atomic():
            if not _lock():
                PASSES.labels(result="skipped").inc()
                log.info("a reconciler pass was skipped: another pass holds the lock")
                return PassReport(ran=False)
            report = run_pass(DatabaseStore(), now)
            changed = set(report.nodes_changed)
            if changed:
                Node.objects.filter(pk__in=changed).update(desired_version=F("desired_version") + 1)
            transaction.on_commit(lambda: push_desired_state(changed))
    except Exception:
        PASSES.labels(result="failed").inc()
        log.exception("a reconciler pass failed")
        raise
    PASSES.labels(result="ran").inc()
    return report


class DatabaseStore:
    """The decisions' store (apps.cluster.decisions.Store) on the database, inside the pass's
    transaction. The models and replicas read for a pass are kept by id, so a replica stopped for
    another model's sake is the same object when its own model's turn comes."""

    def __init__(self) -> None:
        self._models: dict[int, Model] = {}
        self._replicas: dict[int, Replica] = {}
        self._ports: dict[int, set[int]] = {}

    def stopping(self) -> list[tuple[Replica, list[ShardView]]]:
        out = []
        for replica in Replica.objects.filter(state=ReplicaState.STOPPING).prefetch_related("shards__node"):
            shards = replica.shards.all()
            views = [ShardView(s.node_id, s.state, s.node.status, s.node.revoked_at is not None) for s in shards]
            out.append((replica, views))
        return out

    def failed_due(self, now: Any) -> list[Replica]:
        return list(Replica.objects.filter(state=ReplicaState.FAILED, next_attempt_at__lte=now))

    def release(self, replica: Replica) -> None:
        replica.delete()

    def clear_shards(self, replica: Replica) -> set[int]:
        nodes = set(replica.shards.values_list("node_id", flat=True))
        replica.shards.all().delete()
        return nodes

    def inventory(self) -> placement.Inventory:
        return build_inventory()

    def models(self) -> list[Model]:
        rows = list(
            Model.objects.exclude(external_url__gt="")
            .select_related("organization", "team__organization", "project__team__organization")
            .prefetch_related(
                "profiles",
                Prefetch("replicas", queryset=Replica.objects.order_by("created_at", "pk").prefetch_related("shards")),
            )
        )
        self._models = {m.pk: m for m in rows}
        self._replicas = {r.pk: r for m in rows for r in m.replicas.all()}
        return rows

    def draining(self) -> dict[int, Node]:
        found: dict[int, Node] = {n.pk: n for n in Node.objects.filter(drain_requested_at__isnull=False)}
        for node in EXTENSIONS.held_draining():  # a rack (or PDU, row...) held with drain
            found.setdefault(node.pk, node)
        return found

    def profiles(self, model: Model) -> list[Profile]:
        return list(model.profiles.all())

    def replicas(self, model: Model) -> list[Replica]:
        return list(model.replicas.all())

    def new_replica(self, model: Model, now: Any, replaces: Replica | None = None) -> Replica:
        replica = Replica.objects.create(model=model, state=ReplicaState.PENDING, created_at=now, replaces=replaces)
        self._replicas[replica.pk] = replica
        return replica

    def update(self, obj: Model | Replica, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(obj, name, value)
        changed = type(obj).objects.filter(pk=obj.pk).update(**fields)
        if changed and isinstance(obj, Replica) and ROUTED_FIELDS & fields.keys():
            # What listens to replicas' rows (the gateways' routes, apps.gateway.signals) hears of a
            # change it routes by as of a save: a stopped replica leaves every gateway's routes within
            # a second. Other changes (marks, backfilled specs) would only reload every gateway.
            post_save.send(
                sender=Replica,
                instance=obj,
                created=False,
                update_fields=frozenset(fields),
                raw=False,
                using=obj._state.db or "default",
            )

    def update_model(self, model_id: int, **fields: Any) -> None:
        known = self._models.get(model_id)
        if known is not None:
            for name, value in fields.items():
                setattr(known, name, value)
        Model.objects.filter(pk=model_id).update(**fields)

    def delete_replica(self, replica: Replica) -> None:
        self._replicas.pop(replica.pk, None)
        replica.delete()

    def delete_model(self, model: Model) -> None:
        Model.objects.filter(pk=model.pk).delete()

    def shard_nodes(self, replica: Replica) -> list[int]:
        return [s.node_id for s in replica.shards.all()]

    def has_pending(self, model_id: int) -> bool:
        return Replica.objects.filter(model_id=model_id, state=ReplicaState.PENDING).exists()

    def placed_count(self, model: Model) -> int:
        return (
            Replica.objects.filter(model=model).exclude(state__in=(ReplicaState.PENDING, ReplicaState.STOPPING)).count()
        )

    def replicas_by_id(self, ids: Iterable[int]) -> list[Replica]:
        wanted = list(ids)
        missing = [pk for pk in wanted if pk not in self._replicas]
        if missing:
            for row in Replica.objects.filter(pk__in=missing).select_related("model"):
                self._replicas[row.pk] = row
        return [self._replicas[pk] for pk in wanted if pk in self._replicas]

    def add_shards(self, replica: Replica, plan: placement.Placement) -> set[int]:
        for shard in plan.shards:
            devices, vendor = shard_devices(shard.node_id, shard.gpu_indices)
            Shard.objects.create(
                replica=replica,
                rank=shard.rank,
                node_id=shard.node_id,
                gpu_indices=list(shard.gpu_indices),
                devices=devices,
                vendor=vendor,
                memory_bytes=shard.memory_bytes,
                cpu_cores=shard.cpu_cores,
                port=_allocate_port(shard.node_id, self._ports),
                secret=secrets.token_urlsafe(24),
                env=EXTENSIONS.shard_env(shard.node_id, plan.group) if len(plan.shards) > 1 else {},
            )
        if hasattr(replica, "_prefetched_objects_cache"):
            replica._prefetched_objects_cache.pop("shards", None)  # read its new shards from now on
        return {shard.node_id for shard in plan.shards}

    def audit(self, action: str, obj: Replica, changes: dict[str, Any], **fields: Any) -> None:
        from apps.accounts import audit

        audit.record(None, action, obj, changes=changes, **fields)


def shard_devices(node_id: int, indices: Any) -> tuple[list[str], str]:
    """What the engine of a shard on these devices is told to use, read when it is placed: [] for
    whole NVIDIA cards (told their indices, as always), each device's id (a MIG UUID, an AMD ROCm
    index) otherwise; and the devices' vendor ("" for a CPU shard)."""
    wanted = list(indices or ())
    if not wanted:
        return [], ""
    rows = {g.index: g for g in Gpu.objects.filter(node_id=node_id, index__in=wanted)}
    found = [rows.get(index) for index in wanted]
    vendor = next((g.vendor for g in found if g is not None and g.vendor), "nvidia")
    if all(g is not None and g.kind == Gpu.Kind.GPU and g.vendor in ("", "nvidia") for g in found):
        return [], vendor
    return [g.device_id if g is not None else "" for g in found], vendor


# Desired state ---------------------------------------------------------------------------------


_DONE = (ShardState.STOPPED, ShardState.FAILED)


def _rank_waits(shard: Shard, now: Any) -> bool:
    """A rank past 0 of a stopping multi-node replica runs on while its rank 0 (the one that answers
    requests) drains: stopping it would break the requests in flight there. It stops once rank 0 has
    stopped, or once rank 0's drain grace and stop grace have passed (its node may be out of touch)."""
    replica = shard.replica
    if shard.rank == 0 or shard.state in _DONE or replica.stop_requested_at is None:
        return False
    if now - replica.stop_requested_at > timedelta(seconds=(replica.drain_grace or 0) + settings.ENGINE_STOP_GRACE):
        return False
    first = Shard.objects.filter(replica_id=replica.pk, rank=0).values_list("state", flat=True).first()
    return first is not None and first not in _DONE


def _live_shards(node: Node) -> list[Shard]:
    """The node's shards of replicas starting, ready or stopping, with their replicas, models and
    profiles, in replica and rank order: one read for both lists of its desired state. A node
    without shards (one joining for the first time, most of a fleet being installed) costs only a
    narrow look: the wide read's columns of three tables take longer to build than to run."""
    live = Shard.objects.filter(
        node=node, replica__state__in=(ReplicaState.STARTING, ReplicaState.READY, ReplicaState.STOPPING)
    )
    if not Shard.objects.filter(node=node).exists():
        return []
    return list(live.select_related("replica__model", "replica__profile").order_by("replica_id", "rank"))


def draining_shards(node: Node, now: Any = None, shards: list[Shard] | None = None) -> list[DrainingShardMessage]:
    """The shards on the node that answer requests (rank 0) of replicas being stopped, not stopped
    yet: each an agent.protocol.DrainingShard, telling the agent to keep its engine for the requests
    in flight, `left` seconds at most, and not to stop it while idle for `settle` more seconds.
    `shards`: the node's live shards (_live_shards) when the caller read them already."""
    from agent.protocol import DrainingShard

    now = now or timezone.now()
    rows = [
        shard
        for shard in (_live_shards(node) if shards is None else shards)
        if shard.rank == 0 and shard.replica.state == ReplicaState.STOPPING and shard.state not in _DONE
    ]
    out = []
    for shard in rows:
        replica = shard.replica
        grace = replica.drain_grace or 0  # stopped before drains were kept: stopped at once, as then
        since = max(0.0, (now - replica.stop_requested_at).total_seconds()) if replica.stop_requested_at else 0.0
        out.append(
            DrainingShard(
                shard=shard.shard_id,
                grace=grace,
                left=round(max(0.0, grace - since), 3),
                settle=round(max(0.0, ROUTES_SETTLE_S - since), 3),
            ).to_message()
        )
    return out


def desired_shards(node: Node, shards: list[Shard] | None = None) -> list[DesiredShardMessage]:
    """The whole list of shards a node should run, each an agent.protocol.DesiredShard as the
    "desired" message carries it (the agent reads them back with the same class). `shards`: the
    node's live shards (_live_shards) when the caller read them already."""
    from agent.protocol import DesiredShard

    now = timezone.now()
    running = (ReplicaState.STARTING, ReplicaState.READY)
    shards = [
        shard
        for shard in (_live_shards(node) if shards is None else shards)
        if shard.replica.state in running or _rank_waits(shard, now)
    ]
    host = "127.0.0.1" if node.address in {"", "127.0.0.1", "::1", "localhost"} else "0.0.0.0"  # noqa: S104
    out = []
    for shard in shards:
        replica, model, profile = shard.replica, shard.replica.model, shard.replica.profile
        # The spec it was placed with: a changed profile reaches the node by a replacement replica.
        spec: dict[str, Any] = dict(replica.spec or {})
        if not spec:
            if profile is None:
                continue
            from apps.cluster.inventory import running_spec

            spec = running_spec(model, profile)
        nodes = int(spec.get("nodes_per_replica") or 1)
        peers = list(replica.shards.order_by("rank").select_related("node")) if nodes > 1 else []
        master = peers[0] if peers else None
        out.append(
            DesiredShard(
                shard=shard.shard_id,
                model=model.name,
                served_name=model.name,
                engine=str(spec["engine"]),
                source=str(spec["source"]),
                gpu_indices=list(shard.gpu_indices or []),
                cpu_cores=float(shard.cpu_cores),
                memory_bytes=shard.memory_bytes,
                context_size=spec.get("context_size"),
                parallel=int(spec.get("parallel") or 1),
                extra_args=list(spec.get("extra_args") or []),
                env={**(shard.env or {}), **(spec.get("env") or {})},
                api_key=shard.secret,
                port=shard.port,
                host=host,
                nodes_per_replica=nodes,
                rank=shard.rank,
                master_addr=master.node.address if master else None,
                master_port=(master.port + 1000) if master else None,
                tensor_parallel=int(spec.get("gpus_per_shard") or 0) or None,
                pipeline_parallel=nodes if nodes > 1 else None,
                generation=replica.pk,
                stop_grace=float(settings.ENGINE_STOP_GRACE),
                devices=list(shard.devices or []),
                vendor=shard.vendor or "nvidia",
            ).to_message()
        )
    return out


def desired_message(
    node: Node, generation: int, tables: Any = None, fetches: tuple[list[dict[str, Any]] | None] | None = None
) -> DesiredMessage:
    """The body of a node's "desired" message: its shards and the engines it should have
    (`tables`: the engine rules and releases, when the caller read them once for many nodes), and
    what to fetch from the mirror where an app keeps one (`fetches`: (EXTENSIONS.node_fetches(),)
    when the caller read it once for many nodes)."""
    from apps.cluster.engines import desired_engines

    shards = _live_shards(node)
    message: DesiredMessage = {
        "shards": desired_shards(node, shards),
        "draining": draining_shards(node, shards=shards),
        "engines": desired_engines(node, tables),
    }
    mirror = EXTENSIONS.node_fetches() if fetches is None else fetches[0]
    if mirror is not None:
        message["mirror"] = mirror
    message["generation"] = generation
    return message


def push_desired_state(node_ids: set[int] | None = None) -> None:
    """Send each node (or the ones named) its whole shard list over its websocket."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from agent import protocol
    from apps.cluster.actions import node_group

    layer = get_channel_layer()
    if layer is None:
        return
    from apps.cluster.engines import EngineTables

    nodes = Node.objects.filter(revoked_at__isnull=True).prefetch_related("gpus")
    if node_ids is not None:
        nodes = nodes.filter(pk__in=node_ids)
    tables = EngineTables.read()  # once for the push, not once per node
    fetches = (EXTENSIONS.node_fetches(),)
    for node in nodes:
        text = protocol.encode("desired", desired_message(node, int(timezone.now().timestamp()), tables, fetches))
        try:
            async_to_sync(layer.group_send)(node_group(node.pk), {"type": "agent.send", "text": text})
        except Exception:
            log.warning("could not send node %s its desired state", node.name, exc_info=True)
