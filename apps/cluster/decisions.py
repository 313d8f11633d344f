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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Protocol

from django.conf import settings
from django.utils.translation import gettext as _

from apps.catalog import profile_fields
from apps.catalog.choices import CapacityClass
from apps.cluster import placement
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState, StopReason

__all__ = [
    "PREEMPT_HOLD",
    "DrainRow",
    "ModelRow",
    "PassReport",
    "ProfileRow",
    "ReplicaRow",
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


def running_spec(model: ModelRow, profile: ProfileRow) -> dict[str, Any]:
    return {
        "source": model.source,
        "profile": profile.name,
        **profile_fields.running_values(profile),
    }


def release_after(replica: ReplicaRow) -> timedelta:
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


# What a pass reads of the objects a store hands out: the catalog's Model and Profile rows and the
# cluster's Replica rows (DatabaseStore), or the simulator's copies (apps.sim.store). Read-only here:
# every change goes through Store.update, which sets the attribute and keeps it.


class ModelRow(Protocol):
    """A model as a pass reads it (apps.catalog.models.Model, apps.sim.store.SimModel)."""

    @property
    def pk(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def min_replicas(self) -> int: ...
    @property
    def max_replicas(self) -> int: ...
    @property
    def load_replicas(self) -> int: ...  # replicas stepped up for load, 0 when none
    @property
    def busy_at(self) -> datetime | None: ...  # when the gateway last found every replica busy
    @property
    def scaled_at(self) -> datetime | None: ...  # when load_replicas last stepped
    @property
    def held_until(self) -> datetime | None: ...  # held back (preempted) until then
    @property
    def held_for_id(self) -> int | None: ...  # the model it was preempted for
    @property
    def deleted_at(self) -> datetime | None: ...
    @property
    def effective_class(self) -> str: ...  # its capacity class (apps.catalog.scaling.Scaling)
    @property
    def class_rank(self) -> int: ...  # higher classes are placed first

    def wanted_replicas(self, now: datetime) -> int: ...
    def owner_keys(self) -> tuple[str, ...]: ...


class ProfileRow(Protocol):
    """A profile as a pass reads it; its declared fields are read by name (apps.catalog.profile_fields)."""

    @property
    def pk(self) -> int: ...
    @property
    def name(self) -> str: ...


class ReplicaRow(Protocol):
    """A replica as a pass reads it (apps.cluster.models.Replica, apps.sim.store.SimReplica)."""

    @property
    def pk(self) -> int: ...
    @property
    def model_id(self) -> int: ...
    @property
    def state(self) -> str: ...  # a ReplicaState
    @property
    def created_at(self) -> datetime: ...
    @property
    def replaces_id(self) -> int | None: ...  # the replica it replaces in a roll
    @property
    def next_attempt_at(self) -> datetime | None: ...  # a failed one is not retried before
    @property
    def ready_at(self) -> datetime | None: ...
    @property
    def stop_requested_at(self) -> datetime | None: ...
    @property
    def drain_grace(self) -> int | None: ...  # seconds its engines run on once stopping
    @property
    def profile_id(self) -> int | None: ...  # the profile it was placed with
    @property
    def spec(self) -> Any: ...  # what its engines run (running_spec), {} before it was kept
    @property
    def above_minimum(self) -> bool: ...
    @property
    def rejections(self) -> Any: ...  # the refusals it met (rejection_json each)
    @property
    def message(self) -> str: ...


class DrainRow(Protocol):
    """What drains a node: the node itself (apps.cluster.models.Node), or the simulator's drain."""

    @property
    def drain_force(self) -> bool: ...  # stop its replicas even when they cannot be replaced first


class Store[M: ModelRow, R: ReplicaRow, P: ProfileRow](Protocol):
    """Where a pass reads and writes: models M, replicas R and profiles P (each with at least the
    attributes above); `update` sets the attributes on the object and keeps them.

    DatabaseStore is a Store[Model, Replica, Profile], MemoryStore (apps.sim) a Store[SimModel,
    SimReplica, SimProfile]: mypy checks each where it is handed to run_pass. (Not with an annotation
    such as `store: Store[Model, Replica, Profile]`: its bounds are checked before django-stubs has
    given the models their fields, and fail.)"""

    def stopping(self) -> list[tuple[R, list[ShardView]]]: ...
    def failed_due(self, now: datetime) -> list[R]: ...
    def release(self, replica: R) -> None:
        """Forget a replica that stopped, with its shards and their claims."""

    def clear_shards(self, replica: R) -> set[int]:
        """Drop a replica's shards and their claims; the nodes they were on."""

    def inventory(self) -> placement.Inventory: ...
    def models(self) -> list[M]:
        """The models placed on the cluster (not external ones)."""

    def draining(self) -> Mapping[int, DrainRow]:
        """Node id -> what drains it (with `drain_force`), for every node being drained."""

    def profiles(self, model: M) -> list[P]: ...
    def replicas(self, model: M) -> list[R]:
        """The model's replicas, oldest first."""

    def new_replica(self, model: M, now: datetime, replaces: R | None = None) -> R: ...
    def update(self, obj: M | R, **fields: Any) -> None: ...
    def update_model(self, model_id: int, **fields: Any) -> None:
        """Change a model that may not be the one at hand (a preempted one)."""

    def delete_replica(self, replica: R) -> None: ...
    def delete_model(self, model: M) -> None: ...
    def shard_nodes(self, replica: R) -> list[int]: ...
    def has_pending(self, model_id: int) -> bool: ...
    def placed_count(self, model: M) -> int:
        """The model's replicas neither pending nor stopping."""

    def replicas_by_id(self, ids: Iterable[int]) -> list[R]: ...
    def add_shards(self, replica: R, plan: placement.Placement) -> set[int]:
        """Record the plan's shards for the replica; the nodes they are on."""

    def audit(self, action: str, obj: R, changes: dict[str, Any], **fields: Any) -> None: ...


def profile_spec(profile: ProfileRow) -> placement.ProfileSpec:
    own, extra = profile_fields.spec_values(profile)
    return placement.ProfileSpec(id=profile.pk, name=profile.name, **own, extra=extra)


def replica_request(
    model: ModelRow, profiles: Iterable[ProfileRow], replica: ReplicaRow | None = None
) -> placement.ReplicaRequest:
    specs = sorted((profile_spec(p) for p in profiles), key=lambda p: (-p.priority, p.name))
    return placement.ReplicaRequest(
        model=model.name,
        profiles=specs,
        owner=model.owner_keys(),
        capacity_class=model.effective_class,
        replica_id=str(replica.pk) if replica else "",
        source=model.source,
    )


def run_pass[M: ModelRow, R: ReplicaRow, P: ProfileRow](store: Store[M, R, P], now: datetime) -> PassReport:
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


def _reconcile_model[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P],
    model: M,
    inventory: placement.Inventory,
    now: datetime,
    report: PassReport,
    draining: Mapping[int, DrainRow],
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


def _roll[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P],
    model: M,
    profile_list: list[P],
    replicas: list[R],
    now: datetime,
    report: PassReport,
    inventory: placement.Inventory,
    draining: Mapping[int, DrainRow],
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
class _Staleness[R: ReplicaRow]:
    """Why a replica is due for a replacement in a roll: its running spec is not its profile's now,
    or it has a shard on a draining node."""

    store: Store[Any, R, Any]
    specs: dict[int, dict[str, Any]]  # the running spec of each of the model's profiles, by id
    draining: Mapping[int, DrainRow]  # the draining nodes, by id

    def outdated(self, replica: R) -> bool:
        spec = self.specs.get(replica.profile_id) if replica.profile_id else None
        return spec is None or replica.spec != spec

    def drained(self, replica: R) -> DrainRow | None:
        """The draining node the replica has a shard on (the first), or None."""
        draining = self.draining
        if not draining:
            return None
        return next((draining[n] for n in self.store.shard_nodes(replica) if n in draining), None)


def _keep_specs[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P], replicas: list[R], profiles: dict[int, P], specs: dict[int, dict[str, Any]]
) -> None:
    """Replicas placed before specs were kept run what their profile says now: that is their spec."""
    for replica in replicas:
        if (
            not replica.spec
            and replica.state in (ReplicaState.STARTING, ReplicaState.READY)
            and replica.profile_id in profiles
        ):
            store.update(replica, spec=specs[replica.profile_id])


def _follow_replacements[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P], model: M, replicas: list[R], now: datetime, report: PassReport, staleness: _Staleness[R]
) -> bool:
    """Steps 1 and 2 of the roll, for the replacements under way: a pending one no longer needed is
    dropped (and taken out of `replicas`), a ready one stops the replica it replaces, and one that
    failed, or that cannot be placed beside the replica it replaces, ends the roll for this pass.
    True when the roll goes no further this pass."""
    by_id: dict[int | None, R] = {r.pk: r for r in replicas}
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


def _replace_next[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P],
    model: M,
    profile_list: list[P],
    replicas: list[R],
    now: datetime,
    report: PassReport,
    inventory: placement.Inventory,
    staleness: _Staleness[R],
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


def _mark_above_minimum[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P], model: M, replicas: list[R]
) -> None:
    """The oldest `min_replicas` placed replicas are the model's minimum; the others were added for
    load (or on demand) and may be preempted by a model of the same class below its minimum."""
    placed = sorted((r for r in replicas if r.state != ReplicaState.PENDING), key=lambda r: (r.created_at, r.pk))
    for index, replica in enumerate(placed):
        above = index >= model.min_replicas
        if replica.above_minimum != above:
            store.update(replica, above_minimum=above)


def _still_held[M: ModelRow, R: ReplicaRow, P: ProfileRow](store: Store[M, R, P], model: M) -> bool:
    """A preempted model waits while its preemptor still has a replica waiting for the room."""
    if model.held_for_id is None:
        return True  # held by hand or by an older version: until held_until
    return store.has_pending(model.held_for_id)


def _scale_for_load[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P], model: M, replicas: list[R], now: datetime, report: PassReport
) -> None:
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


def _place[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P],
    model: M,
    profiles: list[P],
    replica: R,
    inventory: placement.Inventory,
    now: datetime,
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


def _stop_stale[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P], replica: R, now: datetime, report: PassReport, drained_by: DrainRow | None
) -> None:
    """Stop a replica a roll replaces: moved off a draining node (`drained_by`, whose own grace
    wins), else replaced by a change of its spec."""
    if drained_by is not None:
        _stop(store, replica, now, report, StopReason.DRAINED, grace=getattr(drained_by, "drain_grace", None))
    else:
        _stop(store, replica, now, report, StopReason.ROLLED)


def _stop[M: ModelRow, R: ReplicaRow, P: ProfileRow](
    store: Store[M, R, P],
    replica: R,
    now: datetime,
    report: PassReport,
    reason: str,
    *,
    grace: int | None = None,
    preempted_by: M | None = None,
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


def class_label(model: ModelRow) -> str:
    return str(CapacityClass(model.effective_class).label)
