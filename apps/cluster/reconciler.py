"""The reconciler: compare what is wanted with what runs, and move one step closer.

Level-triggered and idempotent: every pass reads the whole desired and actual state
from the database and acts on the difference, so a lost message or a crashed worker
costs a pass, never correctness. One pass runs at a time across all workers (a locked
row). A pass:

1. Releases replicas that finished stopping (every shard stopped, or its node gone).
2. Retries failed replicas whose backoff has passed: their claims are released and
   they are placed again.
3. For each model, highest class first: stops replicas beyond its wanted count (newest
   first), adds pending replicas up to it, and places each pending replica with the
   highest-priority profile that fits, keeping the refusals it met.
4. A model below its minimum that fits nowhere may preempt: a lower class for a higher,
   within a class only what grew above its own minimum. Victims are chosen on a copy of
   the inventory and stopped only if that makes the room; their models are held back.
5. After the commit, every node whose shard list changed is sent its desired state.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Prefetch
from django.utils import timezone
from django.utils.translation import gettext as _
from prometheus_client import Counter

from apps.catalog.models import Model
from apps.cluster import placement
from apps.cluster.choices import ReplicaState, ShardState
from apps.cluster.inventory import build_inventory, replica_request
from apps.cluster.models import ControlLock, Node, Replica, Shard

__all__ = ["PassReport", "backoff", "reconcile", "request_reconcile"]

log = logging.getLogger(__name__)

PASSES = Counter("llmgw_reconcile_passes", "Reconciler passes, by how they ended", ["result"])

# The longest a preempted model is held back for its preemptor (which normally lifts the hold by
# being placed, within a pass or two of its victims stopping).
PREEMPT_HOLD = timedelta(minutes=30)


def backoff(failures: int) -> timedelta:
    """10 s, 20 s, 40 s ... up to 10 minutes: a crashing engine is retried, never in a hot loop."""
    return timedelta(seconds=min(600, 10 * 2 ** max(0, failures - 1)))


@dataclass
class PassReport:
    ran: bool = True
    placed: list[str] = field(default_factory=list)
    pending: list[str] = field(default_factory=list)
    stopping: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    scaled: list[str] = field(default_factory=list)
    rolled: list[str] = field(default_factory=list)
    nodes_changed: set[int] = field(default_factory=set)


def request_reconcile() -> None:
    """Kick a pass once the current transaction commits (beat runs one every few seconds anyway)."""

    def kick() -> None:
        try:
            from apps.cluster.tasks import reconcile as task

            task.delay()
        except Exception:  # the broker being down must not fail the change that asked for a pass
            log.warning("could not queue a reconciler pass; beat will run one", exc_info=True)

    transaction.on_commit(kick)


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
            report = _pass(now)
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


def _pass(now: Any) -> PassReport:
    report = PassReport()

    # 1. Release replicas that finished stopping.
    for replica in Replica.objects.filter(state=ReplicaState.STOPPING).prefetch_related("shards__node"):
        shards = list(replica.shards.all())
        grace_over = replica.stop_requested_at and now - replica.stop_requested_at > timedelta(
            seconds=settings.ENGINE_STOP_GRACE * 3
        )
        if all(s.state in (ShardState.STOPPED, ShardState.FAILED) or s.node.revoked_at for s in shards) or (
            grace_over and all(s.node.status != "ready" for s in shards)
        ):
            report.released.append(str(replica))
            report.nodes_changed.update(s.node_id for s in shards)
            replica.delete()

    # 2. Failed replicas past their backoff go back to pending, their claims released.
    for replica in Replica.objects.filter(state=ReplicaState.FAILED, next_attempt_at__lte=now):
        report.nodes_changed.update(replica.shards.values_list("node_id", flat=True))
        replica.shards.all().delete()
        replica.state = ReplicaState.PENDING
        replica.save(update_fields=["state"])

    inventory = build_inventory()
    ports: dict[int, set[int]] = {}
    models = (
        Model.objects.exclude(external_url__gt="")
        .select_related("organization", "team__organization", "project__team__organization")
        .prefetch_related(
            "profiles",
            Prefetch("replicas", queryset=Replica.objects.order_by("created_at", "pk").prefetch_related("shards")),
        )
    )
    draining = {n.pk: n for n in Node.objects.filter(drain_requested_at__isnull=False)}
    from apps.facility.services import draining_nodes

    for node in draining_nodes():  # a rack (or PDU, row...) held with drain
        draining.setdefault(node.pk, node)
    for model in sorted(models, key=lambda m: (-m.class_rank, m.name)):
        _reconcile_model(model, inventory, ports, now, report, draining)
    return report


def _reconcile_model(
    model: Model,
    inventory: placement.Inventory,
    ports: dict[int, set[int]],
    now: Any,
    report: PassReport,
    draining: dict[int, Node] | None = None,
) -> None:
    if model.deleted_at is not None:
        # Deleted: stop what still runs; once nothing is left (released in step 1), the row goes.
        left = list(model.replicas.all())
        for replica in left:
            if replica.state != ReplicaState.STOPPING:
                _stop(replica, now, report, inventory)
        if not left:
            Model.objects.filter(pk=model.pk).delete()
            report.released.append(f"{model.name} (deleted)")
        return
    replicas = [r for r in model.replicas.all() if r.state != ReplicaState.STOPPING]
    # A replica whose replacement is under way is not counted: its replacement is.
    replaced = {r.replaces_id for r in replicas if r.replaces_id}
    counted = [r for r in replicas if r.pk not in replaced]
    _scale_for_load(model, counted, now, report)
    wanted = model.wanted_replicas(now)

    # 3a. Too many: stop the newest first (pending ones before running ones).
    extra = len(counted) - wanted
    if extra > 0:
        order = sorted(counted, key=lambda r: (r.state != ReplicaState.PENDING, r.created_at), reverse=False)
        victims = [r for r in order if r.state == ReplicaState.PENDING][:extra]
        running = sorted(
            (r for r in counted if r.state != ReplicaState.PENDING), key=lambda r: (r.created_at, r.pk), reverse=True
        )
        victims += running[: extra - len(victims)]
        for replica in victims:
            _stop(replica, now, report, inventory)
        replicas = [r for r in replicas if r not in victims]
        counted = [r for r in counted if r not in victims]

    # 3b. Too few: add pending replicas.
    for _i in range(wanted - len(counted)):
        fresh = Replica.objects.create(model=model, state=ReplicaState.PENDING, created_at=now)
        replicas.append(fresh)
        counted.append(fresh)

    _mark_above_minimum(model, counted)
    if model.held_until and model.held_until > now:
        if not _still_held(model):
            model.held_until = model.held_for = None
            Model.objects.filter(pk=model.pk).update(held_until=None, held_for=None)
        else:
            return
    if not model.profiles.all():
        return
    for replica in replicas:
        if replica.state != ReplicaState.PENDING:
            continue
        if replica.next_attempt_at and replica.next_attempt_at > now:
            continue
        _place(model, replica, inventory, ports, now, report)
    _roll(model, replicas, now, report, inventory, ports, draining or {})


def _roll(
    model: Model,
    replicas: list[Replica],
    now: Any,
    report: PassReport,
    inventory: placement.Inventory,
    ports: dict[int, set[int]],
    draining: dict[int, Node],
) -> None:
    """Move replicas off draining nodes, and bring those whose running spec is out of date to the
    model's current one, one at a time (drains first).

    A replica on a draining node is replaced elsewhere first whatever the model's maximum (a drain
    never takes a model below what it runs), and waits while its replacement cannot be placed,
    unless the drain is forced: then it is stopped anyway.

    1. A replacement that is ready stops the replica it replaces.
    2. While a replacement is on its way nothing else is replaced; one that failed stops the roll
       (the old replica keeps serving; the replacement is retried with the usual backoff).
    3. Otherwise the oldest out-of-date replica gets a replacement: alongside it while the model is
       under its maximum, else in its place (stopped first). A replacement that cannot be placed
       beside it (no room) replaces it in place too: never more than one below the minimum.
    """
    from apps.accounts import audit
    from apps.cluster.inventory import running_spec

    profiles = {p.pk: p for p in model.profiles.all()}
    by_id = {r.pk: r for r in replicas}
    for replica in replicas:  # replicas placed before specs were kept run what their profile says now
        if (
            not replica.spec
            and replica.state in (ReplicaState.STARTING, ReplicaState.READY)
            and replica.profile_id in profiles
        ):
            replica.spec = running_spec(model, profiles[replica.profile_id])
            Replica.objects.filter(pk=replica.pk).update(spec=replica.spec)

    def outdated(replica: Replica) -> bool:
        profile = profiles.get(replica.profile_id) if replica.profile_id else None
        return profile is None or replica.spec != running_spec(model, profile)

    def drained(replica: Replica) -> Node | None:
        return next((draining[s.node_id] for s in replica.shards.all() if s.node_id in draining), None)

    replacements = [r for r in replicas if r.replaces_id is not None]
    for replacement in list(replacements):
        old = by_id.get(replacement.replaces_id)  # type: ignore[arg-type]
        if replacement.state == ReplicaState.PENDING and old is not None and not outdated(old) and drained(old) is None:
            # What it was to replace needs no replacing any more (a drain ended, a change undone).
            replacement.delete()
            replicas.remove(replacement)
            continue
        if replacement.state == ReplicaState.READY:
            if old is not None and old.state != ReplicaState.STOPPING:
                _stop(old, now, report, inventory)
                audit.record(None, "replica.rolled", old, changes={"replaced_by": replacement.pk}, model=model.name)
            replacement.replaces = None
            Replica.objects.filter(pk=replacement.pk).update(replaces=None)
            report.rolled.append(f"{old} → {replacement}" if old else str(replacement))
        elif replacement.state == ReplicaState.FAILED:
            message = _(
                "The rolling change stopped: its replacement replica failed; the old replica keeps serving. %(reason)s"
            ) % {"reason": replacement.message}
            if old is not None and old.message != message:
                old.message = message
                Replica.objects.filter(pk=old.pk).update(message=message)
                audit.record(None, "replica.roll_failed", replacement, changes={"replaces": old.pk}, model=model.name)
            return
        elif (
            replacement.state == ReplicaState.PENDING
            and replacement.rejections
            and old is not None
            and old.state != ReplicaState.STOPPING
        ):
            node = drained(old)
            if node is not None and not node.drain_force:
                return  # a drain waits for room elsewhere (the replacement's refusals say why)
            # No room beside the old one: it makes the room itself.
            _stop(old, now, report, inventory)
            audit.record(
                None, "replica.rolled", old, changes={"replaced_by": replacement.pk, "in_place": True}, model=model.name
            )
            return
    if any(r.replaces_id is not None for r in replicas):
        return  # one replacement at a time
    movable = (ReplicaState.STARTING, ReplicaState.READY)
    stale = sorted(
        (r for r in replicas if r.state in movable and (drained(r) is not None or outdated(r))),
        key=lambda r: (drained(r) is None, r.created_at, r.pk),
    )
    if not stale:
        return
    target = stale[0]
    live = [r for r in replicas if r.state != ReplicaState.STOPPING]
    if drained(target) is not None or len(live) < model.max_replicas:
        replacement = Replica.objects.create(model=model, state=ReplicaState.PENDING, created_at=now, replaces=target)
        audit.record(
            None,
            "replica.roll_start",
            target,
            changes={"replacement": replacement.pk},
            model=model.name,
            stale=len(stale),
        )
    else:
        _stop(target, now, report, inventory)
        replacement = Replica.objects.create(model=model, state=ReplicaState.PENDING, created_at=now)
        audit.record(
            None,
            "replica.roll_start",
            target,
            changes={"replacement": replacement.pk, "in_place": True},
            model=model.name,
            stale=len(stale),
        )
    report.rolled.append(f"{target} → {replacement}")
    _place(model, replacement, inventory, ports, now, report)


def _mark_above_minimum(model: Model, replicas: list[Replica]) -> None:
    """The oldest `min_replicas` placed replicas are the model's minimum; the others were added for
    load (or on demand) and may be preempted by a model of the same class below its minimum."""
    placed = sorted((r for r in replicas if r.state != ReplicaState.PENDING), key=lambda r: (r.created_at, r.pk))
    for index, replica in enumerate(placed):
        above = index >= model.min_replicas
        if replica.above_minimum != above:
            replica.above_minimum = above
            Replica.objects.filter(pk=replica.pk).update(above_minimum=above)


def _still_held(model: Model) -> bool:
    """A preempted model waits while its preemptor still has a replica waiting for the room."""
    if model.held_for_id is None:
        return True  # held by hand or by an older version: until held_until
    return Replica.objects.filter(model_id=model.held_for_id, state=ReplicaState.PENDING).exists()


def _scale_for_load(model: Model, replicas: list[Replica], now: Any, report: PassReport) -> None:
    """Step the replicas wanted for the load: one more while every replica keeps being busy, one
    fewer after a quiet spell. Never past max_replicas, never below min_replicas.

    A step up waits until every replica is ready and the gateway was busy again after the
    newest became ready, so a replica still loading its weights is not answered with another.
    """
    wanted = model.wanted_replicas(now)
    load = model.load_replicas
    up_window = timedelta(seconds=settings.SCALE_UP_WINDOW)
    quiet_for = timedelta(seconds=settings.SCALE_DOWN_AFTER)
    busy = model.busy_at is not None and now - model.busy_at <= up_window
    newest_ready = max((r.ready_at for r in replicas if r.ready_at), default=None)
    settled = bool(replicas) and len(replicas) >= wanted and all(r.state == ReplicaState.READY for r in replicas)
    fresh = (
        model.busy_at is not None
        and (newest_ready is None or model.busy_at > newest_ready)
        and (model.scaled_at is None or model.busy_at > model.scaled_at)
    )
    if busy and settled and fresh and wanted < model.max_replicas:
        load = wanted + 1
    elif load and not busy:
        moments = [t for t in (model.busy_at, model.scaled_at) if t is not None]
        if not moments or now - max(moments) >= quiet_for:
            step = min(load, model.max_replicas) - 1
            load = step if step > model.min_replicas else 0
    if load != model.load_replicas:
        model.load_replicas = load
        model.scaled_at = now
        Model.objects.filter(pk=model.pk).update(load_replicas=load, scaled_at=now)
        report.scaled.append(f"{model.name}: {wanted} → {model.wanted_replicas(now)}")
        log.info("model %s scaled for load: %s → %s replicas", model.name, wanted, model.wanted_replicas(now))


def _place(
    model: Model,
    replica: Replica,
    inventory: placement.Inventory,
    ports: dict[int, set[int]],
    now: Any,
    report: PassReport,
) -> None:
    request = replica_request(model, replica)
    result = placement.place(inventory, request)
    rejections = [_rejection_json(r) for r in result.rejections]
    if result.placement is None:
        running = (
            Replica.objects.filter(model=model)
            .exclude(state=ReplicaState.PENDING)
            .exclude(state=ReplicaState.STOPPING)
            .count()
        )
        message = _("No node can take it now; see the reasons.")
        if running < model.min_replicas:
            preemption = placement.plan_preemption(inventory, request)
            if preemption is not None and preemption.victims:
                victims = list(
                    Replica.objects.filter(pk__in=[int(v) for v in preemption.victims]).select_related("model")
                )
                for victim in victims:
                    _stop(victim, now, report, inventory, preempted_by=model)
                message = _("Waiting for %(count)s preempted replicas to stop.") % {"count": len(victims)}
        if replica.rejections != rejections or replica.message != message:
            replica.rejections = rejections
            replica.message = message
            replica.save(update_fields=["rejections", "message"])
        report.pending.append(str(replica))
        return

    plan = result.placement
    placed = Replica.objects.filter(model=model).exclude(state__in=(ReplicaState.PENDING, ReplicaState.STOPPING))
    above = placed.count() >= model.min_replicas  # added for load or on demand, beyond the minimum
    from apps.cluster.inventory import running_spec, shard_env

    profile = next(p for p in model.profiles.all() if p.pk == plan.profile.id)
    replica.profile_id = plan.profile.id
    replica.spec = running_spec(model, profile)
    replica.state = ReplicaState.STARTING
    replica.rejections = rejections
    replica.placed_at = now
    replica.message = ""
    replica.above_minimum = above
    replica.save(update_fields=["profile", "spec", "state", "rejections", "placed_at", "message", "above_minimum"])
    for shard in plan.shards:
        Shard.objects.create(
            replica=replica,
            rank=shard.rank,
            node_id=shard.node_id,
            gpu_indices=list(shard.gpu_indices),
            memory_bytes=shard.memory_bytes,
            cpu_cores=shard.cpu_cores,
            port=_allocate_port(shard.node_id, ports),
            secret=secrets.token_urlsafe(24),
            env=shard_env(shard.node_id, plan.group) if len(plan.shards) > 1 else {},
        )
        report.nodes_changed.add(shard.node_id)
    inventory.apply(
        plan,
        str(replica.pk),
        owner=request.owner,
        capacity_class=request.capacity_class,
        model=model.name,
        above_minimum=above,
    )
    report.placed.append(str(replica))
    if model.held_until:
        Model.objects.filter(pk=model.pk).update(held_until=None, held_for=None)


def _stop(
    replica: Replica, now: Any, report: PassReport, inventory: placement.Inventory, preempted_by: Model | None = None
) -> None:
    if replica.state == ReplicaState.PENDING:
        replica.delete()
        return
    replica.state = ReplicaState.STOPPING
    replica.stop_requested_at = now
    replica.message = (_("Preempted for %(model)s.") % {"model": preempted_by.name}) if preempted_by else ""
    replica.save(update_fields=["state", "stop_requested_at", "message"])
    report.nodes_changed.update(replica.shards.values_list("node_id", flat=True))
    report.stopping.append(str(replica))
    if preempted_by is not None:
        report.preempted.append(str(replica))
        Model.objects.filter(pk=replica.model_id).update(held_until=now + PREEMPT_HOLD, held_for=preempted_by)


def _rejection_json(rejection: placement.Rejection) -> dict[str, Any]:
    data = rejection.to_dict()
    data["params"] = {k: v for k, v in data["params"].items() if isinstance(v, str | int | float | bool) or v is None}
    return data


# Desired state ---------------------------------------------------------------------------------


def desired_shards(node: Node) -> list[dict[str, Any]]:
    """The whole list of shards a node should run, each an agent.protocol.DesiredShard as the
    "desired" message carries it (the agent reads them back with the same class)."""
    from agent.protocol import DesiredShard

    shards = (
        Shard.objects.filter(node=node, replica__state__in=(ReplicaState.STARTING, ReplicaState.READY))
        .select_related("replica__model", "replica__profile")
        .order_by("replica_id", "rank")
    )
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
                stop_grace=float(node.drain_grace if node.drain_grace is not None else settings.ENGINE_STOP_GRACE),
            ).to_message()
        )
    return out


def desired_message(node: Node, generation: int, tables: Any = None) -> dict[str, Any]:
    """The body of a node's "desired" message: its shards and the engines it should have
    (`tables`: the engine rules and releases, when the caller read them once for many nodes)."""
    from apps.cluster.engines import desired_engines
    from apps.mirror.services import node_fetches

    return {
        "shards": desired_shards(node),
        "engines": desired_engines(node, tables),
        "mirror": node_fetches(),
        "generation": generation,
    }


def push_desired_state(node_ids: set[int] | None = None) -> None:
    """Send each node (or the ones named) its whole shard list over its websocket."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from agent import protocol
    from apps.cluster.services import node_group

    layer = get_channel_layer()
    if layer is None:
        return
    from apps.cluster.engines import EngineTables

    nodes = Node.objects.filter(revoked_at__isnull=True).prefetch_related("gpus")
    if node_ids is not None:
        nodes = nodes.filter(pk__in=node_ids)
    tables = EngineTables.read()  # once for the push, not once per node
    for node in nodes:
        text = protocol.encode("desired", desired_message(node, int(timezone.now().timestamp()), tables))
        try:
            async_to_sync(layer.group_send)(node_group(node.pk), {"type": "agent.send", "text": text})
        except Exception:
            log.warning("could not send node %s its desired state", node.name, exc_info=True)
