"""What a reconciler pass decides, over a store of models, replicas and their claims.

The reconciler (apps.cluster.reconciler) runs a pass on the database; the fleet simulator
(apps.sim) runs the same pass on a copy held in memory. Both give `run_pass` a `Store`: the
objects it hands out carry the attributes of the catalog's Model and Profile and the cluster's
Replica rows, and every change goes back through it. A pass:

1. Releases replicas that finished stopping (every shard stopped, or its node gone; or, with
   every node of it out of touch, once its drain grace and three stop graces have passed).
2. Retries failed replicas whose backoff has passed: their claims are released and
   they are placed again.
3. For each model, highest class first: stops replicas beyond its wanted count (newest
   first), adds pending replicas up to it, and places each pending replica with the
   highest-priority profile that fits, keeping the refusals it met.
4. A model below its minimum that fits nowhere may preempt: a lower class for a higher,
   within a class only what grew above its own minimum. Victims are chosen on a copy of
   the inventory and stopped only if that makes the room; their models are held back.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

from django.conf import settings
from django.utils.translation import gettext as _

from apps.catalog import profile_fields
from apps.catalog.choices import CapacityClass
from apps.cluster import placement
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState, StopReason

__all__ = [
    "PREEMPT_HOLD",
    "PassReport",
    "ShardView",
    "Store",
    "backoff",
    "release_after",
    "run_pass",
    "running_spec",
]

log = logging.getLogger(__name__)

# The longest a preempted model is held back for its preemptor (which normally lifts the hold by
# being placed, within a pass or two of its victims stopping).
PREEMPT_HOLD = timedelta(minutes=30)

# What a replica's engines run, from its model and profile: a change to any of these is rolled out
# by replacing the replica, never by restarting its engines in place. They are the declared fields
# marked `running` (apps.catalog.profile_fields); one passed as an engine's flag is in extra_args.
RUNNING_FIELDS = tuple(f.name for f in profile_fields.CORE if f.running and not f.engine_flags)


def running_spec(model: Any, profile: Any) -> dict[str, Any]:
    return {
        "source": model.source,
        "profile": profile.name,
        **profile_fields.running_values(profile),
    }


def release_after(replica: Any) -> timedelta:
    """How long a stopping replica whose nodes are all out of touch keeps its claims: its engines may
    still run there, for the requests in flight (its drain grace), then SIGTERM to SIGKILL (the stop
    grace); three stop graces leave the agent time to be heard from again."""
    return timedelta(seconds=(replica.drain_grace or 0) + settings.ENGINE_STOP_GRACE * 3)


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


@dataclass(frozen=True, slots=True)
class ShardView:
    """What step 1 needs of a stopping replica's shard and its node."""

    node_id: int
    state: str
    node_status: str
    node_revoked: bool


class Store(Protocol):
    """Where a pass reads and writes. Models carry Model's attributes (`wanted_replicas`,
    `class_rank`, `owner_keys()`...), replicas Replica's, profiles Profile's; `update` sets the
    attributes on the object and keeps them."""

    def stopping(self) -> list[tuple[Any, list[ShardView]]]: ...
    def failed_due(self, now: Any) -> list[Any]: ...
    def release(self, replica: Any) -> None:
        """Forget a replica that stopped, with its shards and their claims."""

    def clear_shards(self, replica: Any) -> set[int]:
        """Drop a replica's shards and their claims; the nodes they were on."""

    def inventory(self) -> placement.Inventory: ...
    def models(self) -> list[Any]:
        """The models placed on the cluster (not external ones)."""

    def draining(self) -> dict[int, Any]:
        """Node id -> what drains it (with `drain_force`), for every node being drained."""

    def profiles(self, model: Any) -> list[Any]: ...
    def replicas(self, model: Any) -> list[Any]:
        """The model's replicas, oldest first."""

    def new_replica(self, model: Any, now: Any, replaces: Any = None) -> Any: ...
    def update(self, obj: Any, **fields: Any) -> None: ...
    def update_model(self, model_id: int, **fields: Any) -> None:
        """Change a model that may not be the one at hand (a preempted one)."""

    def delete_replica(self, replica: Any) -> None: ...
    def delete_model(self, model: Any) -> None: ...
    def shard_nodes(self, replica: Any) -> list[int]: ...
    def has_pending(self, model_id: int) -> bool: ...
    def placed_count(self, model: Any) -> int:
        """The model's replicas neither pending nor stopping."""

    def replicas_by_id(self, ids: Iterable[int]) -> list[Any]: ...
    def add_shards(self, replica: Any, plan: placement.Placement) -> set[int]:
        """Record the plan's shards for the replica; the nodes they are on."""

    def audit(self, action: str, obj: Any, changes: dict[str, Any], **fields: Any) -> None: ...


def profile_spec(profile: Any) -> placement.ProfileSpec:
    own, extra = profile_fields.spec_values(profile)
    return placement.ProfileSpec(id=profile.pk, name=profile.name, **own, extra=extra)


def replica_request(model: Any, profiles: Iterable[Any], replica: Any = None) -> placement.ReplicaRequest:
    specs = sorted((profile_spec(p) for p in profiles), key=lambda p: (-p.priority, p.name))
    return placement.ReplicaRequest(
        model=model.name,
        profiles=specs,
        owner=model.owner_keys(),
        capacity_class=model.effective_class,
        replica_id=str(replica.pk) if replica else "",
        source=model.source,
    )


def run_pass(store: Store, now: Any) -> PassReport:
    report = PassReport()

    # 1. Release replicas that finished stopping.
    for replica, shards in store.stopping():
        grace_over = replica.stop_requested_at and now - replica.stop_requested_at > release_after(replica)
        if all(s.state in (ShardState.STOPPED, ShardState.FAILED) or s.node_revoked for s in shards) or (
            grace_over and all(s.node_status != NodeStatus.READY for s in shards)
        ):
            report.released.append(str(replica))
            report.nodes_changed.update(s.node_id for s in shards)
            store.release(replica)

    # 2. Failed replicas past their backoff go back to pending, their claims released.
    for replica in store.failed_due(now):
        report.nodes_changed.update(store.clear_shards(replica))
        store.update(replica, state=ReplicaState.PENDING)

    inventory = store.inventory()
    draining = store.draining()
    for model in sorted(store.models(), key=lambda m: (-m.class_rank, m.name)):
        _reconcile_model(store, model, inventory, now, report, draining)
    return report


def _reconcile_model(
    store: Store,
    model: Any,
    inventory: placement.Inventory,
    now: Any,
    report: PassReport,
    draining: dict[int, Any],
) -> None:
    if model.deleted_at is not None:
        # Deleted: stop what still runs; once nothing is left (released in step 1), the model goes.
        left = store.replicas(model)
        for replica in left:
            if replica.state != ReplicaState.STOPPING:
                _stop(store, replica, now, report, StopReason.DELETED)
        if not left:
            store.delete_model(model)
            report.released.append(f"{model.name} (deleted)")
        return
    replicas = [r for r in store.replicas(model) if r.state != ReplicaState.STOPPING]
    # A replica whose replacement is under way is not counted: its replacement is.
    replaced = {r.replaces_id for r in replicas if r.replaces_id}
    counted = [r for r in replicas if r.pk not in replaced]
    _scale_for_load(store, model, counted, now, report)
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
            _stop(store, replica, now, report, StopReason.SCALED_DOWN)
        replicas = [r for r in replicas if r not in victims]
        counted = [r for r in counted if r not in victims]

    # 3b. Too few: add pending replicas.
    for _i in range(wanted - len(counted)):
        fresh = store.new_replica(model, now)
        replicas.append(fresh)
        counted.append(fresh)

    _mark_above_minimum(store, model, counted)
    if model.held_until and model.held_until > now:
        if not _still_held(store, model):
            store.update(model, held_until=None, held_for_id=None)
        else:
            return
    profiles = store.profiles(model)
    if not profiles:
        return
    for replica in replicas:
        if replica.state != ReplicaState.PENDING:
            continue
        if replica.next_attempt_at and replica.next_attempt_at > now:
            continue
        _place(store, model, profiles, replica, inventory, now, report)
    _roll(store, model, profiles, replicas, now, report, inventory, draining)


def _roll(
    store: Store,
    model: Any,
    profile_list: list[Any],
    replicas: list[Any],
    now: Any,
    report: PassReport,
    inventory: placement.Inventory,
    draining: dict[int, Any],
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
       under its maximum, else in its place (stopped first, and the next one only once that
       replacement is ready). A replacement that cannot be placed beside it (no room) replaces it in
       place too: never more than one below the minimum.
    """
    profiles = {p.pk: p for p in profile_list}
    specs = {pk: running_spec(model, p) for pk, p in profiles.items()}
    _keep_specs(store, replicas, profiles, specs)
    staleness = _Staleness(store, specs, draining)
    if _follow_replacements(store, model, replicas, now, report, staleness):
        return
    if any(r.replaces_id is not None for r in replicas):
        return  # one replacement at a time
    _replace_next(store, model, profile_list, replicas, now, report, inventory, staleness)


@dataclass
class _Staleness:
    """Why a replica is due for a replacement in a roll: its running spec is not its profile's now,
    or it has a shard on a draining node."""

    store: Store
    specs: dict[int, dict[str, Any]]  # the running spec of each of the model's profiles, by id
    draining: dict[int, Any]  # the draining nodes, by id

    def outdated(self, replica: Any) -> bool:
        spec = self.specs.get(replica.profile_id) if replica.profile_id else None
        return spec is None or replica.spec != spec

    def drained(self, replica: Any) -> Any:
        """The draining node the replica has a shard on (the first), or None."""
        draining = self.draining
        if not draining:
            return None
        return next((draining[n] for n in self.store.shard_nodes(replica) if n in draining), None)


def _keep_specs(store: Store, replicas: list[Any], profiles: dict[int, Any], specs: dict[int, dict[str, Any]]) -> None:
    """Replicas placed before specs were kept run what their profile says now: that is their spec."""
    for replica in replicas:
        if (
            not replica.spec
            and replica.state in (ReplicaState.STARTING, ReplicaState.READY)
            and replica.profile_id in profiles
        ):
            store.update(replica, spec=specs[replica.profile_id])


def _follow_replacements(
    store: Store, model: Any, replicas: list[Any], now: Any, report: PassReport, staleness: _Staleness
) -> bool:
    """Steps 1 and 2 of the roll, for the replacements under way: a pending one no longer needed is
    dropped (and taken out of `replicas`), a ready one stops the replica it replaces, and one that
    failed, or that cannot be placed beside the replica it replaces, ends the roll for this pass.
    True when the roll goes no further this pass."""
    by_id = {r.pk: r for r in replicas}
    outdated, drained = staleness.outdated, staleness.drained
    replacements = [r for r in replicas if r.replaces_id is not None]
    for replacement in list(replacements):
        old = by_id.get(replacement.replaces_id)
        if replacement.state == ReplicaState.PENDING and old is not None and not outdated(old) and drained(old) is None:
            # What it was to replace needs no replacing any more (a drain ended, a change undone).
            store.delete_replica(replacement)
            replicas.remove(replacement)
            continue
        if replacement.state == ReplicaState.READY:
            if old is not None and old.state != ReplicaState.STOPPING:
                _stop_stale(store, old, now, report, drained(old))
                store.audit("replica.rolled", old, {"replaced_by": replacement.pk}, model=model.name)
            store.update(replacement, replaces_id=None)
            report.rolled.append(f"{old} → {replacement}" if old else str(replacement))
        elif replacement.state == ReplicaState.FAILED:
            message = _(
                "The rolling change stopped: its replacement replica failed; the old replica keeps serving. %(reason)s"
            ) % {"reason": replacement.message}
            if old is not None and old.message != message:
                store.update(old, message=message)
                store.audit("replica.roll_failed", replacement, {"replaces": old.pk}, model=model.name)
            return True
        elif (
            replacement.state == ReplicaState.PENDING
            and replacement.rejections
            and old is not None
            and old.state != ReplicaState.STOPPING
        ):
            node = drained(old)
            if node is not None and not node.drain_force:
                return True  # a drain waits for room elsewhere (the replacement's refusals say why)
            # No room beside the old one: it makes the room itself.
            _stop_stale(store, old, now, report, node)
            store.audit("replica.rolled", old, {"replaced_by": replacement.pk, "in_place": True}, model=model.name)
            return True
    return False


def _replace_next(
    store: Store,
    model: Any,
    profile_list: list[Any],
    replicas: list[Any],
    now: Any,
    report: PassReport,
    inventory: placement.Inventory,
    staleness: _Staleness,
) -> None:
    """Step 3 of the roll: the oldest replica due (those on a draining node first) gets a replacement,
    placed at once: beside it while the model is under its maximum (or the replica is drained), else
    in its place."""
    outdated, drained = staleness.outdated, staleness.drained
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
        replacement = store.new_replica(model, now, replaces=target)
        store.audit("replica.roll_start", target, {"replacement": replacement.pk}, model=model.name, stale=len(stale))
    else:
        if any(r.state == ReplicaState.STARTING and not outdated(r) for r in replicas):
            return  # the last one replaced in its place is still starting: never two below at once
        _stop_stale(store, target, now, report, None)
        replacement = store.new_replica(model, now)
        store.audit(
            "replica.roll_start",
            target,
            {"replacement": replacement.pk, "in_place": True},
            model=model.name,
            stale=len(stale),
        )
    report.rolled.append(f"{target} → {replacement}")
    _place(store, model, profile_list, replacement, inventory, now, report)


def _mark_above_minimum(store: Store, model: Any, replicas: list[Any]) -> None:
    """The oldest `min_replicas` placed replicas are the model's minimum; the others were added for
    load (or on demand) and may be preempted by a model of the same class below its minimum."""
    placed = sorted((r for r in replicas if r.state != ReplicaState.PENDING), key=lambda r: (r.created_at, r.pk))
    for index, replica in enumerate(placed):
        above = index >= model.min_replicas
        if replica.above_minimum != above:
            store.update(replica, above_minimum=above)


def _still_held(store: Store, model: Any) -> bool:
    """A preempted model waits while its preemptor still has a replica waiting for the room."""
    if model.held_for_id is None:
        return True  # held by hand or by an older version: until held_until
    return store.has_pending(model.held_for_id)


def _scale_for_load(store: Store, model: Any, replicas: list[Any], now: Any, report: PassReport) -> None:
    """Step the replicas wanted for the load: one more while every replica keeps being busy, one
    fewer after a quiet spell. Never past max_replicas, never below min_replicas.

    A step up waits until every replica is ready and the gateway was busy again after the
    newest became ready, so a replica still loading its weights is not answered with another.
    """
    wanted = model.wanted_replicas(now)
    load = model.load_replicas
    busy = model.busy_at is not None and now - model.busy_at <= timedelta(seconds=settings.SCALE_UP_WINDOW)
    if not busy and not load:
        return  # nothing to step either way
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
        if not moments or now - max(moments) >= timedelta(seconds=settings.SCALE_DOWN_AFTER):
            step = min(load, model.max_replicas) - 1
            load = step if step > model.min_replicas else 0
    if load != model.load_replicas:
        store.update(model, load_replicas=load, scaled_at=now)
        report.scaled.append(f"{model.name}: {wanted} → {model.wanted_replicas(now)}")
        log.info("model %s scaled for load: %s → %s replicas", model.name, wanted, model.wanted_replicas(now))


def _place(
    store: Store,
    model: Any,
    profiles: list[Any],
    replica: Any,
    inventory: placement.Inventory,
    now: Any,
    report: PassReport,
) -> None:
    request = replica_request(model, profiles, replica)
    result = placement.place(inventory, request)
    rejections = [rejection_json(r) for r in result.rejections]
    if result.placement is None:
        message = _("No node can take it now; see the reasons.")
        if store.placed_count(model) < model.min_replicas:
            preemption = placement.plan_preemption(inventory, request)
            if preemption is not None and preemption.victims:
                victims = store.replicas_by_id(int(v) for v in preemption.victims)
                for victim in victims:
                    _stop(store, victim, now, report, StopReason.PREEMPTED, preempted_by=model)
                message = _("Waiting for %(count)s preempted replicas to stop.") % {"count": len(victims)}
        if replica.rejections != rejections or replica.message != message:
            store.update(replica, rejections=rejections, message=message)
        report.pending.append(str(replica))
        return

    plan = result.placement
    above = store.placed_count(model) >= model.min_replicas  # added for load or on demand, beyond the minimum
    profile = next(p for p in profiles if p.pk == plan.profile.id)
    store.update(
        replica,
        profile_id=plan.profile.id,
        spec=running_spec(model, profile),
        state=ReplicaState.STARTING,
        rejections=rejections,
        placed_at=now,
        message="",
        above_minimum=above,
    )
    report.nodes_changed.update(store.add_shards(replica, plan))
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
        store.update(model, held_until=None, held_for_id=None)


def _stop_stale(store: Store, replica: Any, now: Any, report: PassReport, drained_by: Any) -> None:
    """Stop a replica a roll replaces: moved off a draining node (`drained_by`, whose own grace
    wins), else replaced by a change of its spec."""
    if drained_by is not None:
        _stop(store, replica, now, report, StopReason.DRAINED, grace=getattr(drained_by, "drain_grace", None))
    else:
        _stop(store, replica, now, report, StopReason.ROLLED)


def _stop(
    store: Store,
    replica: Any,
    now: Any,
    report: PassReport,
    reason: str,
    *,
    grace: int | None = None,
    preempted_by: Any = None,
) -> None:
    """Stop a replica: a pending one is forgotten; a placed one becomes STOPPING, which takes it out
    of every gateway's routes at once, and its engines run on for `grace` seconds (the server's
    LLMGW_DRAIN_GRACE_SECONDS when None) for the requests in flight, stopped once idle."""
    if replica.state == ReplicaState.PENDING:
        store.delete_replica(replica)
        return
    store.update(
        replica,
        state=ReplicaState.STOPPING,
        stop_requested_at=now,
        stop_reason=reason,
        drain_grace=settings.DRAIN_GRACE if grace is None else grace,
        message=(_("Preempted for %(model)s.") % {"model": preempted_by.name}) if preempted_by else "",
    )
    report.nodes_changed.update(store.shard_nodes(replica))
    report.stopping.append(str(replica))
    if preempted_by is not None:
        report.preempted.append(str(replica))
        store.update_model(replica.model_id, held_until=now + PREEMPT_HOLD, held_for_id=preempted_by.pk)


def rejection_json(rejection: placement.Rejection) -> dict[str, Any]:
    data = rejection.to_dict()
    data["params"] = {k: v for k, v in data["params"].items() if isinstance(v, str | int | float | bool) or v is None}
    return data


def class_label(model: Any) -> str:
    return str(CapacityClass(model.effective_class).label)
