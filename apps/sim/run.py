"""Run a scenario: the reconciler's own pass (apps.cluster.decisions) on a fleet held in memory,
step by step, with the nodes' agents played by a small model of what they do (engines start in
`ready_after`, stop within a step, fail with their node), and report what happened.

The report (a plain JSON-able dict, see docs/sim.md) has a line per step for the charts and, at
the start, after each event and at the end, a snapshot: replicas placed and pending with the
placement's reasons, GPUs stranded, fragmentation per class, replicas per leaf, NVLink domain and
rack, power headroom per capped domain, preemptions, and how many more replicas of the named
model fit.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Any

from apps.catalog import profile_fields
from apps.cluster import placement
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState
from apps.cluster.decisions import backoff, replica_request, run_pass
from apps.fabrics.placement import FABRICS, NVLINK, FabricAttachment, NvlinkPart
from apps.facility.draw import derived_watts
from apps.facility.locations import LEVELS, label_of, location
from apps.facility.placement import FACILITY, FacilityPart, HeldDomain, renew_draws
from apps.facility.placement import INDEX as FACILITY_INDEX
from apps.sim.limits import MAX_PROBLEMS, figure
from apps.sim.scenario import Event, Scenario, ScenarioError
from apps.sim.store import MemoryStore, SimDrain, SimModel, SimProfile, SimReplica, SimShard

__all__ = ["Simulation", "live_fleet", "live_nodes", "simulate"]

HINTED = 10  # problems with a name the fleet lacks that also get the nearest name it has
PENDING_LISTED = 50  # pending replicas listed by name in a snapshot (the rest are counted)
HEADROOM_LIMIT = 256  # more replicas of the named model counted at most (the report says "at least")


def up_window() -> timedelta:
    """The reconciler's scale-up window, read when a run starts, as the reconciler reads it."""
    from django.conf import settings

    return timedelta(seconds=settings.SCALE_UP_WINDOW)


def _fabric_extra(name: str, kind: str, leaf: str | None, leaf_name: str | None, hcas: list[str]) -> FabricAttachment:
    """A node's attachment to a described fabric, in the shape the fabrics app gives placement."""
    return {
        "name": name,
        "kind": kind,
        "identity": f"{kind}:sim-{name}",
        "problem": "",
        "hcas": hcas,
        "netdevs": [],
        "leaf": leaf,
        "leaf_name": leaf_name,
        "short": False,
    }


def build_nodes(
    scenario: Scenario, first_id: int = 1
) -> tuple[dict[int, placement.NodeSnapshot], dict[int, float | None]]:
    """The described groups as placement snapshots, and each node's draw with nothing placed (W)."""
    nodes: dict[int, placement.NodeSnapshot] = {}
    idle: dict[int, float | None] = {}
    racks: Counter[str] = Counter()
    node_id = first_id
    for group in scenario.groups:
        kind = scenario.node_types[group.type]
        rack_base = racks[group.rack_prefix]
        for n in range(group.count):
            labels = {**kind.labels, **group.labels}
            if group.per_rack:
                number = rack_base + n // group.per_rack + 1
                rack = f"{group.rack_prefix}{number:02d}"
                labels[label_of("rack")] = rack
                if group.pdus_per_rack:
                    labels[label_of("pdu")] = f"{rack}-{chr(ord('a') + n % group.pdus_per_rack)}"
            fabrics: list[FabricAttachment] | None = None
            if group.fabric:
                per_leaf = group.per_leaf or group.count
                block = n // per_leaf
                hcas = [f"mlx5_{r}" for r in range(max(group.rails, 1))]
                if group.rails:
                    leaves = [f"{group.fabric}-pod{block:03d}-rail{r}" for r in range(group.rails)]
                    leaf, leaf_name = ",".join(sorted(leaves)), ", ".join(leaves)
                else:
                    leaf = leaf_name = f"{group.fabric}-leaf{block:03d}"
                fabrics = [_fabric_extra(group.fabric, group.fabric_kind, leaf, leaf_name, hcas)]
            nvlink: NvlinkPart | None = None
            if group.nvlink_domain:
                domain = f"sim-{group.type}-nvl{n // group.nvlink_domain:03d}.0"
                nvlink = {"domain": domain, "label": domain, "ready": True, "problems": []}
            snapshot = nodes[node_id] = placement.NodeSnapshot(
                id=node_id,
                name=group.name.format(type=group.type, n=n + 1),
                labels=labels,
                memory_total_bytes=kind.memory_bytes,
                cpus=kind.cpus,
                gpus=[placement.GpuSlot(index=i, gpu_class=cls, nvlink_group=g) for i, cls, g in kind.gpus],
            )
            placement.NODE_STATUS.put(snapshot, NodeStatus.READY)
            # The fabrics app's parts, in the shapes its placement rules read (apps.fabrics.placement).
            if fabrics is not None:
                FABRICS.put(snapshot, fabrics)
            if nvlink is not None:
                NVLINK.put(snapshot, nvlink)
            idle[node_id] = kind.idle_watts
            node_id += 1
        if group.per_rack:
            racks[group.rack_prefix] = rack_base + -(-group.count // group.per_rack)
    return nodes, idle


def _models(scenario: Scenario, first_id: int, first_profile: int) -> list[SimModel]:
    models = []
    profile_id = first_profile
    for offset, spec in enumerate(scenario.models):
        profiles = []
        for p in spec.profiles:
            profiles.append(
                SimProfile(
                    pk=profile_id,
                    name=p.name,
                    priority=p.priority,
                    engine=p.engine,
                    accelerator=p.accelerator,
                    gpus_per_shard=p.gpus,
                    nodes_per_replica=p.nodes,
                    memory_bytes=p.memory_bytes,
                    cpu_cores=p.cpu_cores,
                    node_selector=p.node_selector,
                    **p.extra,
                )
            )
            profile_id += 1
        models.append(
            SimModel(
                pk=first_id + offset,
                name=spec.name,
                min_replicas=spec.min,
                max_replicas=spec.max,
                capacity_class=spec.capacity_class,
                owner=(spec.owner,) if spec.owner else (),
                source=f"hf://sim/{spec.name}",
                profiles=profiles,
                replica_rps=spec.replica_rps,
                load=[(scenario.start + at, rps) for at, rps in spec.load],
            )
        )
    return models


def live_nodes(inventory: Any = None) -> dict[str, dict[str, Any]]:
    """The live nodes' hardware by name, for node types written `like: NAME` (and to count the
    live fleet against a run's limits): what the reconciler's inventory holds."""
    if inventory is None:
        from apps.cluster.inventory import build_inventory

        inventory = build_inventory()
    return {
        n.name: {
            "gpus": [(g.index, g.gpu_class, g.nvlink_group) for g in n.gpus],
            "cpus": n.cpus,
            "memory_bytes": n.memory_total_bytes,
        }
        for n in inventory.nodes.values()
    }


def live_fleet() -> dict[str, Any]:
    """The cluster as it is now, for a scenario that starts from it (and for `like:` node types):
    the placement snapshot the reconciler builds, and its models and replicas as plain objects."""
    from apps.cluster.inventory import build_inventory

    inventory = build_inventory()
    models = _live_models()
    replicas = _live_replicas(models)
    by_name = live_nodes(inventory)
    from apps.facility import power
    from apps.facility.services import active_holds

    holds = {h.domain: {"reason": h.reason, "drain": h.drain} for h in active_holds()}
    return {
        "nodes": inventory.nodes,
        "holds": holds,
        "caps": {str(k): float(v) for k, v in power.caps().items()},
        "models": list(models.values()),
        "replicas": replicas,
        "quotas": inventory.quotas,
        "by_name": by_name,
    }


def _live_models() -> dict[int, SimModel]:
    """Every model served by the fleet (external ones left out), by id, with its profiles."""
    from apps.catalog.models import Model

    models: dict[int, SimModel] = {}
    rows = (
        Model.objects.exclude(external_url__gt="")
        .select_related("organization", "team__organization", "project__team__organization")
        .prefetch_related("profiles")
    )
    for row in rows:
        models[row.pk] = SimModel(
            pk=row.pk,
            name=row.name,
            min_replicas=row.min_replicas,
            max_replicas=row.max_replicas,
            capacity_class=row.capacity_class,
            owner=row.owner_keys(),
            source=row.source,
            profiles=[SimProfile(pk=p.pk, name=p.name, **profile_fields.stored_values(p)) for p in row.profiles.all()],
            load_replicas=row.load_replicas,
            demand_until=row.demand_until,
            busy_at=row.busy_at,
            scaled_at=row.scaled_at,
            held_until=row.held_until,
            held_for_id=row.held_for_id,
            deleted_at=row.deleted_at,
        )
    return models


def _live_replicas(models: dict[int, SimModel]) -> list[SimReplica]:
    """The replicas of those models with their shards (none for a pending one, which holds nothing)."""
    from apps.cluster.models import Replica

    replicas = []
    for r in Replica.objects.filter(model_id__in=list(models)).prefetch_related("shards"):
        replicas.append(
            SimReplica(
                pk=r.pk,
                model=models[r.model_id],
                state=r.state,
                created_at=r.created_at,
                replaces_id=r.replaces_id,
                next_attempt_at=r.next_attempt_at,
                ready_at=r.ready_at,
                placed_at=r.placed_at,
                stop_requested_at=r.stop_requested_at,
                profile_id=r.profile_id,
                spec=dict(r.spec or {}),
                above_minimum=r.above_minimum,
                rejections=list(r.rejections or []),
                message=r.message,
                failures=r.failures,
                shards=[
                    SimShard(s.rank, s.node_id, tuple(s.gpu_indices or ()), s.memory_bytes, s.cpu_cores, s.state)
                    for s in r.shards.all()
                ]
                if r.state != ReplicaState.PENDING
                else [],
            )
        )
    return replicas


class Simulation:
    """One run of a scenario; `run()` returns the report."""

    def __init__(self, scenario: Scenario, live: dict[str, Any] | None = None) -> None:
        self.scenario = scenario
        nodes: dict[int, placement.NodeSnapshot] = {}
        models: list[SimModel] = []
        replicas: list[SimReplica] = []
        quotas: dict[str, placement.CapacityQuota] = {}
        self.measured: dict[int, float | None] = {}
        if scenario.from_cluster and live is not None:
            nodes = {
                pk: replace(n, labels=dict(n.labels), extra=_copy_extra(n.extra)) for pk, n in live["nodes"].items()
            }
            models = list(live["models"])
            replicas = list(live["replicas"])
            quotas = dict(live["quotas"])
            for pk, node in nodes.items():
                facility = FACILITY.get(node)
                self.measured[pk] = facility.get("draw_w") if isinstance(facility, dict) else None
        first_node = max(nodes, default=0) + 1
        built, idle = build_nodes(scenario, first_node)
        nodes.update(built)
        self.measured.update(idle)
        first_model = max((m.pk for m in models), default=0) + 1
        first_profile = max((p.pk for m in models for p in m.profiles), default=0) + 1
        models += _models(scenario, first_model, first_profile)
        for key, q in scenario.quotas.items():
            quotas[key] = placement.CapacityQuota(
                gpus=q["gpus"], cpu_cores=q["cpu_cores"], memory_bytes=q["memory_bytes"], replicas=q["replicas"]
            )
        self.caps = {**(live or {}).get("caps", {}), **scenario.caps} if scenario.from_cluster else dict(scenario.caps)
        # "rack=r12" -> {"reason", "drain"}: the live fleet's holds, then the scenario's
        self.holds: dict[str, dict[str, Any]] = dict((live or {}).get("holds", {})) if scenario.from_cluster else {}
        self.outages: dict[str, Any] = {}  # fabric name -> when its standby subnet manager has taken over
        self.initial_claims: dict[int, float] = {}
        self.store = MemoryStore(nodes, models, replicas, quotas, next_id=max((r.pk for r in replicas), default=0) + 1)
        check_names(scenario, self.store.nodes, [m.name for m in models], self.caps if scenario.from_cluster else {})
        self.initial_claims = self._claimed_watts()
        self._contribute()
        self.store.rebuild()
        self.steps: list[dict[str, Any]] = []
        self.snapshots: list[dict[str, Any]] = []
        self.preemptions: list[dict[str, Any]] = []
        self.pass_seconds = 0.0
        self.placements = 0
        self.power_dirty = False
        self._by_name: dict[str, SimModel] | None = None

    # -- the fleet's side of events ------------------------------------------------------------

    def _claimed_watts(self, only: set[int] | None = None) -> dict[int, float]:
        found: dict[int, float] = {}
        for claim in self.store.inv.claims:
            if only is not None and claim.node_id not in only:
                continue
            node = self.store.nodes.get(claim.node_id)
            if node is None or not claim.gpu_indices:
                continue
            classes = {g.index: g.gpu_class for g in node.gpus}
            watts = derived_watts(classes.get(claim.gpu_indices[0]), len(claim.gpu_indices)) or 0
            found[claim.node_id] = found.get(claim.node_id, 0.0) + watts
        return found

    def _contribute(self) -> None:
        """Give every node its facility part (location, holds, caps and draw), as the facility app
        gives the live snapshot: the draw with nothing placed plus what the claims on it draw."""
        claimed = self._claimed_watts() if self.caps else {}
        self.capped: set[int] = set()
        places = {node_id: location(node.labels) for node_id, node in self.store.nodes.items()}
        for node_id, node in self.store.nodes.items():
            place = places[node_id]
            if not any(place.values()) and not self.holds:
                FACILITY.drop(node)
                continue
            held: list[HeldDomain] = [
                {"domain": domain, "reason": hold["reason"]}
                for domain, hold in self.holds.items()
                if place.get(domain.partition("=")[0]) == domain.partition("=")[2]
            ]
            facility: FacilityPart = {"location": place, "held": held}
            capped = {
                f"{level}={place[level]}": self.caps[f"{level}={place[level]}"]
                for level in LEVELS
                if place[level] and f"{level}={place[level]}" in self.caps
            }
            if capped:
                self.capped.add(node_id)
                facility["caps"] = capped
                facility["draw_w"] = self._draw(node_id, claimed)
            FACILITY.put(node, facility)
        drains = {}
        for node_id, place in places.items():
            for domain, hold in self.holds.items():
                level, _sep, name = domain.partition("=")
                if hold["drain"] and place.get(level) == name:
                    drains[node_id] = SimDrain()
        self.store.drains = drains

    def _renew_draws(self) -> None:
        """Claims were made or dropped since the last step: each capped node's draw becomes its draw
        with nothing placed plus what its claims draw now, as the node's next report would say, and
        the power index reads those draws again and counts every claim there is as in them (a claim
        released and another made on one node leave its draw as it was, and the new one is in it).
        Nothing else a model's turn reads changes, so the inventory is kept and no model that sleeps
        is woken: only a placement reads the draw, and a model with a replica to place never sleeps."""
        claimed = self._claimed_watts(self.capped)
        for node_id in self.capped:
            facility = FACILITY.get(self.store.nodes[node_id])
            if isinstance(facility, dict):
                facility["draw_w"] = self._draw(node_id, claimed)
        self.store.inv.renew_index(FACILITY_INDEX, renew_draws)

    def _draw(self, node_id: int, claimed: dict[int, float]) -> float | None:
        """The node's draw with nothing placed plus what its claims (`claimed`) draw; None unknown."""
        base = self.measured.get(node_id)
        return None if base is None else base + claimed.get(node_id, 0.0) - self.initial_claims.get(node_id, 0.0)

    def _select(self, args: dict[str, Any]) -> list[placement.NodeSnapshot]:
        nodes = self.store.nodes
        if args.get("all"):
            return list(nodes.values())
        found: dict[int, placement.NodeSnapshot] = {}  # by id: each node once, looked up in O(1)
        names = args.get("nodes")
        if names:
            wanted = {names} if isinstance(names, str) else {str(n) for n in names}
            found.update((n.id, n) for n in nodes.values() if n.name in wanted)
        for level in ("rack", "pdu"):
            if args.get(level):
                found.update((n.id, n) for n in nodes.values() if location(n.labels).get(level) == str(args[level]))
        if args.get("count"):
            pool = [n for n in sorted(nodes.values(), key=lambda n: n.name) if n.ready and n.id not in found]
            if args.get("type"):
                pool = [n for n in pool if n.name.startswith(f"{args['type']}-")]
            found.update((n.id, n) for n in pool[: int(args["count"])])
        return list(found.values())

    def apply(self, event: Event, now: Any) -> str:
        """Change the fleet as the event says; what it did, in words."""
        args = event.args
        if event.kind in ("lose", "restore"):
            chosen = self._select(args)
            for node in chosen:
                node.ready = event.kind == "restore"
                node.status = "" if node.ready else "lost (simulated)"
                placement.NODE_STATUS.put(node, NodeStatus.READY if node.ready else NodeStatus.UNREACHABLE)
            return f"{event.kind}: {len(chosen)} nodes"
        if event.kind in ("hold", "release"):
            level = next(k for k in ("rack", "pdu", "row", "room", "site") if k in args)
            domain = f"{level}={args[level]}"
            if event.kind == "hold":
                self.holds[domain] = {
                    "reason": str(args.get("reason") or "simulated"),
                    "drain": bool(args.get("drain")),
                }
            else:
                self.holds.pop(domain, None)
            return f"{event.kind}: {domain}"
        if event.kind == "cap":
            from apps.sim.scenario import _watts

            watts = _watts(args["watts"])
            self.caps[str(args["domain"])] = float(watts or 0)
            return f"cap: {args['domain']} {watts:.0f} W"
        if event.kind == "sm_failover":
            from apps.sim.scenario import parse_duration

            fabric = str(args["fabric"])
            outage = parse_duration(args.get("outage") or 0) or timedelta(0)
            self.outages[fabric] = now + outage
            self._fabric_identity(fabric, known=outage <= timedelta(0))
            return f"sm_failover: {fabric} for {outage}"
        model = self._model(str(args["model"]))
        if model is None:
            return f"{event.kind}: no model {args['model']}"
        if event.kind == "set":
            if "min" in args:
                model.min_replicas = int(args["min"])
                model.max_replicas = max(model.max_replicas, model.min_replicas)
            if "max" in args:
                model.max_replicas = max(int(args["max"]), model.min_replicas)
            if "class" in args:
                model.capacity_class = str(args["class"])
            return f"set: {model.name} min={model.min_replicas} max={model.max_replicas} class={model.effective_class}"
        if "rps" in args:
            model.load_rps = float(args["rps"])
        if "factor" in args:
            model.load_factor *= float(args["factor"])
        return f"load: {model.name} x{model.load_factor:g}"

    def _fabric_identity(self, fabric: str, *, known: bool) -> None:
        """While a fabric's subnet manager is away its nodes' ports answer no identity: placement
        groups them apart from nodes that can say theirs (apps.fabrics.placement)."""
        for node in self.store.nodes.values():
            for attachment in FABRICS.get(node) or []:
                if attachment.get("name") == fabric:
                    attachment["identity"] = f"{attachment['kind']}:sim-{fabric}" if known else None

    def _model(self, name: str) -> SimModel | None:
        """The model of that name (the index is made once: models are never added during a run)."""
        if self._by_name is None:
            self._by_name = {}
            for model in self.store.by_id.values():
                self._by_name.setdefault(model.name, model)
        return self._by_name.get(name)

    # -- the agents' side ----------------------------------------------------------------------

    def agents(self, now: Any, nodes_changed: bool = True) -> bool:
        """Engines start, become ready, stop and fail with their nodes. True when a claim changed.
        Without `nodes_changed` (no event since the last step) no node was lost, and a ready
        replica, placed on ready nodes, has nothing to do."""
        nodes = self.store.nodes
        ready_after = self.scenario.ready_after
        changed = False
        for replica in list(self.store.replica_index.values()):
            state = replica.state
            if state in (ReplicaState.PENDING, ReplicaState.FAILED) or (
                state == ReplicaState.READY and not nodes_changed
            ):
                continue
            lost = [s for s in replica.shards if s.node_id not in nodes or not nodes[s.node_id].ready]
            if state == ReplicaState.STOPPING:
                for shard in replica.shards:
                    node = nodes.get(shard.node_id)
                    if node is not None and node.ready and shard.state != ShardState.STOPPED:
                        shard.state = ShardState.STOPPED
                        self.store.touch(replica.model.pk)
                continue
            if lost:
                self.store.touch(replica.model.pk)
                replica.failures += 1
                replica.state = ReplicaState.FAILED
                replica.next_attempt_at = now + backoff(replica.failures)
                gone = nodes.get(lost[0].node_id)
                replica.message = f"node {gone.name if gone else lost[0].node_id} was lost"
                for shard in lost:
                    shard.state = ShardState.FAILED
                changed = True
                continue
            if (
                state == ReplicaState.STARTING
                and replica.placed_at is not None
                and now - replica.placed_at >= ready_after
            ):
                self.store.touch(replica.model.pk)
                replica.state = ReplicaState.READY
                replica.ready_at = now
                replica.failures = 0
                for shard in replica.shards:
                    shard.state = ShardState.READY
        return changed

    def load(self, now: Any) -> None:
        """A model is busy while its requests per second exceed what its ready replicas serve."""
        replicas_of = self.store.replicas_of
        for model in self.store.by_id.values():
            if model.replica_rps is None:
                continue
            ready = sum(1 for r in replicas_of.get(model.pk, ()) if r.state == ReplicaState.READY)
            rps = model.load_rps
            if rps is None:
                rps = 0.0
                for at, value in model.load:
                    if at > now:
                        break
                    rps = value
            if rps * model.load_factor > ready * model.replica_rps:
                model.busy_at = now
                self.store.touch(model.pk)

    # -- running -------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        quiet = logging.getLogger("apps.cluster.decisions")
        level = quiet.level
        quiet.setLevel(logging.WARNING)  # a simulated fleet's scaling is in the report, not the log
        try:
            return self._run()
        finally:
            quiet.setLevel(level)

    def _run(self) -> dict[str, Any]:
        scenario = self.scenario
        started = time.perf_counter()
        events = list(scenario.events)
        self.snapshots.append(self.snapshot(scenario.start, _("start")))
        for k in range(scenario.steps + 1):
            now = scenario.start + k * scenario.step
            due: list[tuple[Event | None, str]] = []
            while events and events[0].at <= k * scenario.step:
                event = events.pop(0)
                due.append((event, self.apply(event, now)))
            for fabric, until in list(self.outages.items()):
                if until <= now:
                    self._fabric_identity(fabric, known=True)
                    del self.outages[fabric]
                    due.append((None, f"sm_failover: {fabric} back"))
            claims_changed = self.agents(now, nodes_changed=bool(due) or k == 0)
            self.load(now)
            if due:
                self._contribute()
                self.store.rebuild()
                self.store.wake_all()
                self.power_dirty = False
            elif self.caps and (claims_changed or self.power_dirty):
                self._renew_draws()
                self.power_dirty = False
            before = time.perf_counter()
            report = run_pass(self.store, now)
            self.store.settle(now + scenario.step, up_window())
            self.pass_seconds += time.perf_counter() - before
            self.placements += len(report.placed) + len(report.pending)
            if report.placed or report.released or report.stopping:
                self.power_dirty = True
            for name in report.preempted:
                self.preemptions.append({"at": _offset(scenario, now), "replica": name})
            self.steps.append(self.step_line(now, report))
            for happened, text in due:
                self.snapshots.append(self.snapshot(now, text, happened))
        self.snapshots.append(self.snapshot(scenario.start + scenario.steps * scenario.step, _("end")))
        wall = time.perf_counter() - started
        return {
            "scenario": {
                "start": scenario.start.isoformat(),
                "step_seconds": scenario.step.total_seconds(),
                "steps": scenario.steps,
                "nodes": len(self.store.nodes),
                "gpus": sum(len(n.gpus) for n in self.store.nodes.values()),
                "models": len(self.store.by_id),
                "events": len(scenario.events),
                "from_cluster": scenario.from_cluster,
                "model": scenario.report_model,
            },
            "steps": self.steps,
            "snapshots": self.snapshots,
            "preemptions": self.preemptions,
            "timing": {
                "seconds": round(wall, 3),
                "pass_seconds": round(self.pass_seconds, 3),
                "per_step_ms": round(1000 * wall / max(len(self.steps), 1), 3),
                "placements": self.placements,
                "per_placement_ms": round(1000 * self.pass_seconds / self.placements, 3) if self.placements else None,
            },
        }

    def step_line(self, now: Any, report: Any) -> dict[str, Any]:
        states: Counter[str] = Counter(r.state for r in self.store.replica_index.values())
        inv = self.store.inv
        nodes = self.store.nodes
        free = inv.free_in_all() - sum(inv.free_total(n.id) for n in nodes.values() if n.gpus and not n.ready)
        return {
            "at": _offset(self.scenario, now),
            "ready": states[ReplicaState.READY],
            "starting": states[ReplicaState.STARTING],
            "pending": states[ReplicaState.PENDING],
            "stopping": states[ReplicaState.STOPPING],
            "failed": states[ReplicaState.FAILED],
            "placed": len(report.placed),
            "preempted": len(report.preempted),
            "gpus_free": free,
        }

    # -- what a snapshot reports ---------------------------------------------------------------

    def snapshot(self, now: Any, label: str, event: Event | None = None) -> dict[str, Any]:
        inv = self.store.inv
        nodes = self.store.nodes
        replicas = list(self.store.replica_index.values())
        states: Counter[str] = Counter(r.state for r in replicas)
        pending = [r for r in replicas if r.state == ReplicaState.PENDING]
        pending_rows = []
        for replica in sorted(pending, key=lambda r: (-r.model.class_rank, r.model.name, r.pk))[:PENDING_LISTED]:
            reasons = Counter(str(j.get("code") or "") for j in replica.rejections)
            example = {str(j.get("code")): str(j.get("message") or "") for j in reversed(replica.rejections)}
            pending_rows.append(
                {
                    "replica": str(replica),
                    "model": replica.model.name,
                    "class": replica.model.effective_class,
                    "message": replica.message,
                    "reasons": [
                        {"code": code, "nodes": count, "example": example.get(code, "")}
                        for code, count in reasons.most_common(3)
                    ],
                }
            )
        by_class: dict[str, dict[str, int]] = {}
        for node_id in inv.gpu_nodes():
            node = nodes[node_id]
            for cls in inv.gpu_classes(node_id):
                total = sum(1 for g in node.gpus if g.gpu_class == cls and g.healthy)
                free = inv.free_count(node_id, cls) if node.ready else 0
                row = by_class.setdefault(cls, {"gpus": 0, "free": 0, "free_on_whole_nodes": 0, "nodes_with_free": 0})
                row["gpus"] += total
                row["free"] += free
                if free:
                    row["nodes_with_free"] += 1
                    if free == total:
                        row["free_on_whole_nodes"] += free
        stranded = self.stranded(pending)
        fragmentation = {
            cls: {
                **row,
                "stranded": stranded.get(cls, 0),
                "fragmentation": round(1 - row["free_on_whole_nodes"] / row["free"], 4) if row["free"] else 0.0,
            }
            for cls, row in sorted(by_class.items())
        }
        where = self.placement_spread()
        out: dict[str, Any] = {
            "at": _offset(self.scenario, now),
            "label": label,
            "event": event.text if event is not None else None,
            "replicas": {
                "ready": states[ReplicaState.READY],
                "starting": states[ReplicaState.STARTING],
                "pending": len(pending),
                "stopping": states[ReplicaState.STOPPING],
                "failed": states[ReplicaState.FAILED],
            },
            "pending": pending_rows,
            "pending_unlisted": max(0, len(pending) - PENDING_LISTED),
            "gpus_stranded": sum(stranded.values()),
            "classes": fragmentation,
            "per_rack": where["rack"],
            "per_leaf": where["leaf"],
            "per_nvlink_domain": where["nvlink"],
            "power": self.power(),
            "preemptions": len(self.preemptions),
            "nodes_ready": sum(1 for n in nodes.values() if n.ready),
        }
        model = self._model(self.scenario.report_model) if self.scenario.report_model else None
        if model is not None:
            request = replica_request(model, model.profiles)
            more = placement.headroom(inv, request, limit=HEADROOM_LIMIT)
            out["headroom"] = {
                "model": model.name,
                "more_replicas": more,
                "at_least": more >= HEADROOM_LIMIT,
            }
        return out

    def stranded(self, pending: list[SimReplica]) -> dict[str, int]:
        """Free GPUs no pending replica could take a shard on (every filter asked, as placement
        asks them): with nothing pending, none."""
        inv = self.store.inv
        if not pending:
            return {}
        nodes = self.store.nodes
        left = {n for n in inv.gpu_nodes() if nodes[n].ready and any(inv.free_count(n, c) for c in inv.gpu_classes(n))}
        seen: set[int] = set()
        for replica in pending:
            if not left:
                break
            if replica.model.pk in seen:
                continue
            seen.add(replica.model.pk)
            request = replica_request(replica.model, replica.model.profiles, replica)
            left -= placement.usable_nodes(inv, request, nodes=left)
        found: Counter[str] = Counter()
        for node_id in left:
            for cls in inv.gpu_classes(node_id):
                found[cls] += inv.free_count(node_id, cls)
        return {cls: n for cls, n in found.items() if n}

    def placement_spread(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {"rack": {}, "leaf": {}, "nvlink": {}}
        nodes = self.store.nodes
        for replica_id in self.store.inv.replica_ids():
            claims = self.store.inv.replica_claims(replica_id)
            keys: dict[str, set[str]] = {"rack": set(), "leaf": set(), "nvlink": set()}
            gpus: Counter[tuple[str, str]] = Counter()
            for claim in claims:
                node = nodes.get(claim.node_id)
                if node is None:
                    continue
                rack = location(node.labels).get("rack") or "-"
                leaf = next((str(a.get("leaf_name") or a.get("leaf") or "-") for a in FABRICS.get(node) or []), "-")
                nvlink = NVLINK.get(node)
                domain = str(nvlink.get("label") or "-") if isinstance(nvlink, dict) else "-"
                for kind, key in (("rack", rack), ("leaf", leaf), ("nvlink", domain)):
                    keys[kind].add(key)
                    gpus[(kind, key)] += len(claim.gpu_indices)
            for kind, found in keys.items():
                for key in found:
                    row = out[kind].setdefault(key, {"replicas": 0, "gpus": 0})
                    row["replicas"] += 1
                    row["gpus"] += gpus[(kind, key)]
        return {kind: dict(sorted(rows.items())) for kind, rows in out.items()}

    def power(self) -> dict[str, dict[str, Any]]:
        """Each capped domain: its cap, what its nodes draw (null while a node's draw is unknown)
        and the headroom left."""
        drawn: dict[str, float] = {}
        unknown: Counter[str] = Counter()
        claimed = self._claimed_watts()
        for node_id, node in self.store.nodes.items():
            place = location(node.labels)
            base = self.measured.get(node_id)
            for level in LEVELS:
                domain = f"{level}={place[level]}" if place[level] else None
                if domain is None or domain not in self.caps:
                    continue
                if base is None:
                    unknown[domain] += 1
                    continue
                draw = base + claimed.get(node_id, 0.0) - self.initial_claims.get(node_id, 0.0)
                drawn[domain] = drawn.get(domain, 0.0) + draw
        out = {}
        for domain, cap in sorted(self.caps.items()):
            known = None if unknown[domain] else round(drawn.get(domain, 0.0), 1)
            out[domain] = {
                "cap_w": cap,
                "drawn_w": known,
                "headroom_w": None if known is None else round(cap - known, 1),
                "nodes_unknown": unknown[domain],
            }
        return out


def check_names(
    scenario: Scenario, nodes: dict[int, placement.NodeSnapshot], models: list[str], live_caps: dict[str, float]
) -> None:
    """Every node, domain, fabric and model an event or the report names must be in the fleet: a
    what-if about a rack that does not exist would otherwise answer as if nothing happened."""
    import difflib

    known: dict[str, set[str]] = {"nodes": set(), "fabric": set(), "model": set(models), "type": set()}
    known["type"] = set(scenario.node_types)
    for node in nodes.values():
        known["nodes"].add(node.name)
        for level, name in location(node.labels).items():
            if name:
                known.setdefault(level, set()).add(str(name))
        for attachment in FABRICS.get(node) or []:
            if attachment.get("name"):
                known["fabric"].add(str(attachment["name"]))
    problems: list[str] = []
    ordered: dict[str, list[str]] = {}  # each kind's names sorted once, for the hints

    def need(kind: str, value: Any, where: str) -> None:
        names = known.get(kind, set())
        if str(value) in names:
            return
        hint = ""
        if len(problems) < HINTED:  # a near name for the first few: difflib is slow over many names
            if kind not in ordered:
                ordered[kind] = sorted(names)
            near = difflib.get_close_matches(str(value), ordered[kind], n=1)
            hint = (_(" (did you mean %(key)s?)") % {"key": near[0]}) if near else ""
        problems.append(
            _("%(where)s: no %(kind)s %(name)s in the fleet%(hint)s")
            % {"where": where, "kind": kind.removesuffix("s"), "name": value, "hint": hint}
        )

    for event in scenario.events:
        args, where = event.args, f"{event.path}.{event.kind}"
        names = args.get("nodes")
        for name in [names] if isinstance(names, str) else list(names or []):
            need("nodes", name, f"{where}.nodes")
        for level in LEVELS:
            if args.get(level) and event.kind != "cap":
                need(level, args[level], f"{where}.{level}")
        if event.kind == "lose" and args.get("type"):
            need("type", args["type"], f"{where}.type")
        if event.kind == "cap":
            level, _sep, name = str(args["domain"]).partition("=")
            need(level, name, f"{where}.domain")
        if event.kind == "sm_failover":
            need("fabric", args["fabric"], f"{where}.fabric")
        if event.kind in ("set", "load"):
            need("model", args["model"], f"{where}.model")
    for domain in scenario.caps:
        if domain not in live_caps:
            level, _sep, name = domain.partition("=")
            need(level, name, f"power.caps.{domain}")
    if scenario.report_model:
        need("model", scenario.report_model, "report.model")
    if problems:
        more = len(problems) - MAX_PROBLEMS
        listed = problems[:MAX_PROBLEMS]
        raise ScenarioError(listed + ([_("and %(count)s more problems") % {"count": figure(more)}] if more > 0 else []))


def _offset(scenario: Scenario, now: Any) -> float:
    """Minutes since the scenario's start."""
    return round(float((now - scenario.start).total_seconds()) / 60, 3)


def _copy_extra(extra: dict[str, Any]) -> dict[str, Any]:
    import copy

    return copy.deepcopy(extra)


def _(text: str) -> str:
    from django.utils.translation import gettext

    return gettext(text)


def simulate(scenario: Scenario, live: dict[str, Any] | None = None) -> dict[str, Any]:
    return Simulation(scenario, live).run()
