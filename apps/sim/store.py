"""The decisions' store (apps.cluster.decisions.Store) held in memory: the simulator's copy of the
fleet's models, replicas and claims. Its objects carry the attributes of the catalog's and the
cluster's rows, so the reconciler's own pass runs on them unchanged."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from apps.catalog.scaling import Scaling
from apps.cluster import placement
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState
from apps.cluster.decisions import ShardView

__all__ = ["MemoryStore", "SimModel", "SimProfile", "SimReplica", "SimShard"]


@dataclass(eq=False)
class SimProfile:
    """A catalogue profile's copy: an attribute for every declared field (apps.catalog.profile_fields),
    those plugins declare included."""

    pk: int
    name: str
    priority: int = 0
    engine: str = "vllm"
    accelerator: str = ""
    gpus_per_shard: int = 0
    nodes_per_replica: int = 1
    memory_bytes: int = 0
    cpu_cores: float = 0.0
    node_selector: dict[str, str] = field(default_factory=dict)
    keep_within: str = ""
    power_watts: int | None = None
    parallel: int = 1
    context_size: int | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    gpu_memory_utilisation: float | None = None


@dataclass(eq=False)
class SimModel(Scaling):
    pk: int
    name: str
    min_replicas: int = 1
    max_replicas: int = 1
    capacity_class: str = ""
    owner: tuple[str, ...] = ()
    source: str = ""
    profiles: list[SimProfile] = field(default_factory=list)
    load_replicas: int = 0
    demand_until: Any = None
    busy_at: Any = None
    scaled_at: Any = None
    held_until: Any = None
    held_for_id: int | None = None
    deleted_at: Any = None
    # What the simulator drives its load with (not read by the pass).
    replica_rps: float | None = None
    load: list[tuple[Any, float]] = field(default_factory=list)
    load_factor: float = 1.0
    load_rps: float | None = None  # set by a load event: the requests per second from then on

    def owner_keys(self) -> tuple[str, ...]:
        return self.owner


@dataclass(eq=False, slots=True)
class SimShard:
    rank: int
    node_id: int
    gpu_indices: tuple[int, ...]
    memory_bytes: int
    cpu_cores: float
    state: str = ShardState.ASSIGNED


@dataclass(eq=False)
class SimReplica:
    pk: int
    model: SimModel
    state: str = ReplicaState.PENDING
    created_at: Any = None
    replaces_id: int | None = None
    next_attempt_at: Any = None
    ready_at: Any = None
    placed_at: Any = None
    stop_requested_at: Any = None
    stop_reason: str = ""
    drain_grace: int | None = None
    profile_id: int | None = None
    spec: dict[str, Any] = field(default_factory=dict)
    above_minimum: bool = False
    rejections: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    failures: int = 0
    shards: list[SimShard] = field(default_factory=list)

    @property
    def model_id(self) -> int:
        return self.model.pk

    def __str__(self) -> str:
        return f"{self.model.name}#{self.pk}"


@dataclass(frozen=True, slots=True)
class SimDrain:
    drain_force: bool = False
    drain_grace: int | None = None


class MemoryStore:
    """Models and replicas by id, and one live inventory the pass places on. `rebuild` makes a fresh
    inventory from the nodes and the claims (after the nodes changed: an event)."""

    def __init__(
        self,
        nodes: dict[int, placement.NodeSnapshot],
        models: Iterable[SimModel],
        replicas: Iterable[SimReplica] = (),
        quotas: dict[str, placement.CapacityQuota] | None = None,
        next_id: int = 1,
    ) -> None:
        self.nodes = nodes
        self.quotas = dict(quotas or {})
        self.by_id: dict[int, SimModel] = {m.pk: m for m in models}
        self.replicas_of: dict[int, list[SimReplica]] = {pk: [] for pk in self.by_id}
        self.replica_index: dict[int, SimReplica] = {}
        for replica in sorted(replicas, key=lambda r: (r.created_at, r.pk)):
            self.replicas_of.setdefault(replica.model.pk, []).append(replica)
            self.replica_index[replica.pk] = replica
        self.next_id = max([next_id, *(r.pk + 1 for r in self.replica_index.values())])
        self.drains: dict[int, SimDrain] = {}
        self.log: list[dict[str, Any]] = []
        # Models whose last turn decided nothing and whose next can decide nothing either until
        # something about them changes (`touched`): a pass skips them (see settle).
        self.sleep = True
        self.asleep: set[int] = set()
        self.touched: set[int] = set()
        self.evaluated: list[SimModel] = []
        self.inv = placement.Inventory({}, [])
        self.rebuild()

    # -- what the simulator uses ---------------------------------------------------------------

    def claims(self) -> list[placement.Claim]:
        found = []
        for pk in sorted(self.replica_index):
            replica = self.replica_index[pk]
            if replica.state == ReplicaState.PENDING:
                continue
            model = replica.model
            for shard in replica.shards:
                found.append(
                    placement.Claim(
                        str(pk),
                        shard.rank,
                        shard.node_id,
                        shard.gpu_indices,
                        shard.memory_bytes,
                        shard.cpu_cores,
                        model.owner_keys(),
                        model.effective_class,
                        model.name,
                        replica.above_minimum,
                    )
                )
        return found

    def rebuild(self) -> None:
        self.inv = placement.Inventory(self.nodes, self.claims(), self.quotas)

    def all_replicas(self) -> list[SimReplica]:
        return list(self.replica_index.values())

    def _may_preempt(self) -> bool:
        """Whether some pending replica's model is below its minimum (and so may preempt)."""
        pending: set[int] = set()
        placed: dict[int, int] = {}
        gone = (ReplicaState.PENDING, ReplicaState.STOPPING)
        for replica in self.replica_index.values():
            pk = replica.model.pk
            if replica.state == ReplicaState.PENDING:
                pending.add(pk)
            elif replica.state not in gone:
                placed[pk] = placed.get(pk, 0) + 1
        return any(placed.get(pk, 0) < self.by_id[pk].min_replicas for pk in pending if pk in self.by_id)

    def touch(self, model_id: int) -> None:
        """Something outside the pass changed the model or one of its replicas."""
        self.touched.add(model_id)

    def wake_all(self) -> None:
        self.asleep.clear()

    def settle(self, now: Any, up_window: Any) -> None:
        """After a pass: a model its pass changed nothing of sleeps while nothing its next turn
        reads can differ: no replica pending (placement is retried every pass), no hold, demand or
        load step under way, no load window open."""
        if not self.sleep:
            self.touched.clear()
            return
        pending = {r.model.pk for r in self.replica_index.values() if r.state == ReplicaState.PENDING}
        for model in self.evaluated:
            pk = model.pk
            if (
                pk in self.touched
                or pk in pending
                or model.held_until is not None
                or model.load_replicas
                or (model.demand_until is not None and model.demand_until > now)
                or (model.busy_at is not None and now - model.busy_at <= up_window)
                or model.deleted_at is not None
            ):
                self.asleep.discard(pk)
            else:
                self.asleep.add(pk)
        self.asleep -= self.touched
        self.touched.clear()

    # -- the Store protocol --------------------------------------------------------------------

    def stopping(self) -> list[tuple[SimReplica, list[ShardView]]]:
        out = []
        for replica in list(self.replica_index.values()):
            if replica.state != ReplicaState.STOPPING:
                continue
            views = []
            for shard in replica.shards:
                node = self.nodes.get(shard.node_id)
                status = NodeStatus.READY if node is not None and node.ready else NodeStatus.UNREACHABLE
                views.append(ShardView(shard.node_id, shard.state, status, node is None))
            out.append((replica, views))
        return out

    def failed_due(self, now: Any) -> list[SimReplica]:
        return [
            r
            for r in self.replica_index.values()
            if r.state == ReplicaState.FAILED and r.next_attempt_at is not None and r.next_attempt_at <= now
        ]

    def release(self, replica: SimReplica) -> None:
        self.touched.add(replica.model.pk)
        self.inv.release(str(replica.pk))
        self.replica_index.pop(replica.pk, None)
        siblings = self.replicas_of.get(replica.model.pk, [])
        if replica in siblings:
            siblings.remove(replica)

    def clear_shards(self, replica: SimReplica) -> set[int]:
        nodes = {s.node_id for s in replica.shards}
        self.touched.add(replica.model.pk)
        self.inv.release(str(replica.pk))
        replica.shards = []
        return nodes

    def inventory(self) -> placement.Inventory:
        return self.inv

    def models(self) -> list[SimModel]:
        if self.sleep and self._may_preempt():
            self.asleep.clear()  # a preemption changes the models it stops, before their turn
        if self.sleep:
            self.asleep -= self.touched
            self.evaluated = [m for m in self.by_id.values() if m.pk not in self.asleep]
        else:
            self.evaluated = list(self.by_id.values())
        self.touched.clear()  # from here on it gathers what the pass itself changes
        return self.evaluated

    def draining(self) -> dict[int, SimDrain]:
        return dict(self.drains)

    def profiles(self, model: SimModel) -> list[SimProfile]:
        return model.profiles

    def replicas(self, model: SimModel) -> list[SimReplica]:
        return list(self.replicas_of.get(model.pk, []))

    def new_replica(self, model: SimModel, now: Any, replaces: SimReplica | None = None) -> SimReplica:
        replica = SimReplica(
            pk=self.next_id, model=model, created_at=now, replaces_id=replaces.pk if replaces is not None else None
        )
        self.next_id += 1
        self.touched.add(model.pk)
        self.replica_index[replica.pk] = replica
        self.replicas_of.setdefault(model.pk, []).append(replica)
        return replica

    def update(self, obj: SimModel | SimReplica, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(obj, name, value)
        if isinstance(obj, SimReplica):
            self.touched.add(obj.model.pk)
            if "above_minimum" in fields:
                # The database's inventory is read again each pass; this one is kept, so its claims
                # follow the flag (it is read by preemption only, and indexes nothing).
                for claim in self.inv.replica_claims(str(obj.pk)):
                    object.__setattr__(claim, "above_minimum", bool(fields["above_minimum"]))
        else:
            self.touched.add(obj.pk)

    def update_model(self, model_id: int, **fields: Any) -> None:
        model = self.by_id.get(model_id)
        if model is not None:
            self.update(model, **fields)

    def delete_replica(self, replica: SimReplica) -> None:
        if replica.shards:
            self.inv.release(str(replica.pk))
        self.release(replica)

    def delete_model(self, model: SimModel) -> None:
        self.touched.add(model.pk)
        self.by_id.pop(model.pk, None)
        self.replicas_of.pop(model.pk, None)

    def shard_nodes(self, replica: SimReplica) -> list[int]:
        return [s.node_id for s in replica.shards]

    def has_pending(self, model_id: int) -> bool:
        return any(r.state == ReplicaState.PENDING for r in self.replicas_of.get(model_id, []))

    def placed_count(self, model: SimModel) -> int:
        gone = (ReplicaState.PENDING, ReplicaState.STOPPING)
        return sum(1 for r in self.replicas_of.get(model.pk, []) if r.state not in gone)

    def replicas_by_id(self, ids: Iterable[int]) -> list[SimReplica]:
        return [self.replica_index[pk] for pk in ids if pk in self.replica_index]

    def add_shards(self, replica: SimReplica, plan: placement.Placement) -> set[int]:
        self.touched.add(replica.model.pk)
        replica.shards = [
            SimShard(s.rank, s.node_id, tuple(s.gpu_indices), s.memory_bytes, s.cpu_cores) for s in plan.shards
        ]
        return {s.node_id for s in plan.shards}

    def audit(self, action: str, obj: SimReplica, changes: dict[str, Any], **fields: Any) -> None:
        self.log.append({"action": action, "object": str(obj), "changes": changes, **fields})
