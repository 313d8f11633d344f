"""Property-based tests: random clusters and random sequences of requests.

On every placement produced: no GPU claimed twice, memory and cores never over-committed, one
GPU class per replica, only healthy GPUs of that class, one fabric per multi-node replica and
distinct nodes, the node selector, readiness and engines satisfied, quotas respected. And the
fast path (capacity index, bounded walk) agrees with explain(), which looks at every node with
every filter: the same profile, the best-scoring node (or fabric), and no fit missed.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apps.cluster.placement import (
    REGISTRY,
    CapacityQuota,
    Claim,
    GpuSlot,
    Inventory,
    NodeSnapshot,
    Placement,
    PlacementContext,
    ProfileExplain,
    ProfileSpec,
    Registry,
    ReplicaRequest,
    explain,
    headroom,
    place,
    plan_preemption,
    preemption_candidates,
)
from apps.fabrics import placement as fabric_plugins
from tests.budget import examples

GIB = 1024**3
CLASSES = ("H100-80GB", "A100-80GB")
FABRICS = (None, "ib-a", "ib-b")
MODELS = ("m1", "m2", "m3")
TEAMS = ("team:0", "team:1")
CAPACITY = ("opportunistic", "standard", "critical")
# No example database: nothing is written outside the test's own tree.
SETTINGS = settings(
    max_examples=examples(400),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=False,
    database=None,
)


@dataclass
class Cluster:
    nodes: dict[int, NodeSnapshot]
    claims: list[Claim] = field(default_factory=list)
    quotas: dict[str, CapacityQuota] = field(default_factory=dict)


@st.composite
def attachments(draw: st.DrawFn) -> dict[str, object]:
    """A fabric attachment as the fabrics app puts it in the snapshot (see apps/fabrics/placement.py)."""
    return {
        "name": draw(st.sampled_from(("ib-a", "ib-b"))),
        "identity": draw(st.sampled_from((None, "ib:0x01", "ib:0x02", "roce:10.0.0.0/24"))),
        "problem": draw(st.sampled_from(("", "", "", "its adapters sit on two fabrics"))),
        "leaf": draw(st.sampled_from((None, "0xL1", "0xL2"))),
        "short": draw(st.integers(0, 4)) == 0,
    }


def physical_groups(node: NodeSnapshot) -> set[str]:
    """The fabrics a node can take a shard of a replica across nodes on, worked out independently."""
    found = set()
    for att in node.extra.get("fabrics") or []:
        if att["problem"]:
            continue
        found.add(att["identity"] or f"unverified:{att['name']}")
    return found


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    count = draw(st.integers(1, 10))
    ids = draw(st.lists(st.integers(1, 10_000), min_size=count, max_size=count, unique=True))
    nodes: dict[int, NodeSnapshot] = {}
    claims: list[Claim] = []
    for n, node_id in enumerate(ids):
        main_class = draw(st.sampled_from(CLASSES))
        gpus = []
        for index in range(draw(st.integers(0, 8))):
            cls = main_class if draw(st.integers(0, 9)) else draw(st.sampled_from(CLASSES))
            gpus.append(
                GpuSlot(
                    index,
                    cls,
                    healthy=draw(st.integers(0, 9)) > 0,
                    nvlink_group=draw(st.sampled_from((None, "g0", "g1"))),
                )
            )
        memory = draw(st.one_of(st.none(), st.integers(8, 256).map(lambda g: g * GIB)))
        cpus = draw(st.one_of(st.none(), st.integers(4, 64)))
        node = NodeSnapshot(
            id=node_id,
            name=f"n{draw(st.integers(0, 99)):02d}-{n}",
            ready=draw(st.integers(0, 9)) > 0,
            cordoned=draw(st.integers(0, 9)) == 0,
            labels={"pool": draw(st.sampled_from(("a", "b")))},
            memory_total_bytes=memory,
            cpus=cpus,
            gpus=gpus,
            engines=draw(st.one_of(st.none(), st.frozensets(st.sampled_from(("vllm", "llama.cpp"))))),
            fabric=draw(st.sampled_from(FABRICS)),
            weights=draw(st.frozensets(st.sampled_from(MODELS))),
            extra={"fabrics": draw(st.lists(attachments(), max_size=2))},
        )
        # What the node already holds: some GPUs by slot, some by claim, memory and cores within its size.
        for slot in gpus:
            if draw(st.integers(0, 5)) == 0:
                slot.claimed_by = f"slot-{node_id}-{slot.index}"
        free = [s.index for s in gpus if s.claimed_by is None]
        taken = tuple(i for i in free if draw(st.integers(0, 3)) == 0)
        mem_claim = draw(st.integers(0, memory // GIB)) * GIB if memory and draw(st.booleans()) else 0
        core_claim = float(draw(st.integers(0, cpus))) if cpus and draw(st.booleans()) else 0.0
        if taken or mem_claim or core_claim:
            claims.append(
                Claim(
                    f"pre-{node_id}",
                    0,
                    node_id,
                    taken,
                    mem_claim,
                    core_claim,
                    tuple(draw(st.sets(st.sampled_from(TEAMS)))),
                    draw(st.sampled_from(CAPACITY)),
                    draw(st.sampled_from(MODELS)),
                    draw(st.booleans()),
                )
            )
        nodes[node_id] = node
    quotas = {
        team: CapacityQuota(
            gpus=draw(st.one_of(st.none(), st.integers(0, 24))),
            cpu_cores=draw(st.one_of(st.none(), st.integers(0, 64).map(float))),
            memory_bytes=draw(st.one_of(st.none(), st.integers(0, 512).map(lambda g: g * GIB))),
            replicas=draw(st.one_of(st.none(), st.integers(0, 8))),
        )
        for team in TEAMS
        if draw(st.booleans())
    }
    return Cluster(nodes, claims, quotas)


@st.composite
def profiles(draw: st.DrawFn, pid: int) -> ProfileSpec:
    accelerator = draw(st.sampled_from(("cpu", *CLASSES)))
    return ProfileSpec(
        id=pid,
        name=f"p{pid}",
        priority=draw(st.integers(0, 3)),
        engine=draw(st.sampled_from(("vllm", "llama.cpp"))),
        accelerator=accelerator,
        gpus_per_shard=draw(st.integers(0, 4)) if accelerator != "cpu" else 0,
        nodes_per_replica=draw(st.sampled_from((1, 1, 2, 3))),
        memory_bytes=draw(st.sampled_from((0, 4, 16, 64))) * GIB,
        cpu_cores=draw(st.sampled_from((0, 0.5, 2, 8))),
        node_selector=draw(st.sampled_from(({}, {}, {"pool": "a"}))),
    )


@st.composite
def requests(draw: st.DrawFn, serial: int) -> ReplicaRequest:
    count = draw(st.integers(1, 2))
    model = draw(st.sampled_from(MODELS))
    return ReplicaRequest(
        model=model,
        source=model,
        profiles=[draw(profiles(serial * 10 + i)) for i in range(count)],
        owner=tuple(sorted(draw(st.sets(st.sampled_from(TEAMS))))),
        capacity_class=draw(st.sampled_from(CAPACITY)),
        replica_id=f"new-{serial}",
    )


def jitter(ctx: PlacementContext, node: NodeSnapshot) -> float:
    """A plugin scorer with arbitrary but stable values, to exercise the bounded walk."""
    return (zlib.crc32(f"{node.name}/{ctx.request.model}".encode()) % 101) / 100


def registries(weight: float, physical: bool = False) -> Registry:
    if not weight and not physical:
        return REGISTRY
    registry = REGISTRY.copy()
    if weight:
        registry.register_scorer(jitter, name="test.jitter", weight=weight)
    if physical:
        fabric_plugins.register(registry)
    return registry


def assert_consistent(inventory: Inventory) -> None:
    """The inventory's claims, recomputed from scratch, never over-commit anything."""
    owners: Counter[tuple[int, int]] = Counter()
    memory: Counter[int] = Counter()
    cores: dict[int, float] = {}
    for node in inventory.nodes.values():
        for slot in node.gpus:
            if slot.claimed_by is not None:  # the tests never release a slot's holder
                owners[(node.id, slot.index)] += 1
    for claim in inventory.claims:
        for index in claim.gpu_indices:
            owners[(claim.node_id, index)] += 1
        memory[claim.node_id] += claim.memory_bytes
        cores[claim.node_id] = cores.get(claim.node_id, 0.0) + claim.cpu_cores
    assert all(n == 1 for n in owners.values()), owners
    for node_id, node in inventory.nodes.items():
        if node.memory_total_bytes is not None:
            assert memory[node_id] <= node.memory_total_bytes
            assert inventory.memory_claimed(node_id) == memory[node_id]
        if node.cpus is not None:
            assert cores.get(node_id, 0.0) <= node.cpus + 1e-6
        free = {(node_id, s.index) for s in inventory.free_gpus(node_id)}
        expected = {(node_id, s.index) for s in node.gpus if s.healthy and owners[(node_id, s.index)] == 0}
        assert free == expected


def usage(inventory: Inventory, key: str) -> tuple[int, float, int, int]:
    claims = [c for c in inventory.claims if key in c.owner]
    return (
        sum(len(c.gpu_indices) for c in claims),
        sum(c.cpu_cores for c in claims),
        sum(c.memory_bytes for c in claims),
        len({c.replica for c in claims}),
    )


def assert_valid(inventory: Inventory, request: ReplicaRequest, placement: Placement, physical: bool = False) -> None:
    profile = placement.profile
    shards = placement.shards
    assert len(shards) == profile.nodes_needed
    assert len({s.node_id for s in shards}) == len(shards)
    assert [s.rank for s in shards] == list(range(len(shards)))
    classes = set()
    for shard in shards:
        node = inventory.nodes[shard.node_id]
        assert node.ready and not node.cordoned
        assert all(node.labels.get(k) == v for k, v in profile.node_selector.items())
        assert node.engines is None or profile.engine in node.engines
        assert shard.memory_bytes == profile.memory_bytes and shard.cpu_cores == profile.cpu_cores
        assert len(shard.gpu_indices) == profile.gpus_needed
        slots = {s.index: s for s in node.gpus}
        for index in shard.gpu_indices:
            slot = slots[index]
            assert slot.healthy and not inventory.is_claimed(node.id, index)
            classes.add(slot.gpu_class)
        if node.memory_total_bytes is not None:
            assert inventory.memory_claimed(node.id) + shard.memory_bytes <= node.memory_total_bytes
        if node.cpus is not None:
            assert inventory.cores_claimed(node.id) + shard.cpu_cores <= node.cpus + 1e-6
    if profile.accelerator == "cpu":
        assert classes == set()
    else:
        assert classes <= {profile.accelerator}
    if len(shards) > 1:
        assert placement.group is not None
        if physical:
            for shard in shards:
                assert placement.group[0] in physical_groups(inventory.nodes[shard.node_id])
        else:
            fabrics = {inventory.nodes[s.node_id].fabric for s in shards}
            assert fabrics == {placement.group[0]}
    n = profile.nodes_needed
    for key in request.owner:
        quota = inventory.quotas.get(key)
        if quota is None:
            continue
        # A replica that claims none of a resource is not held back by that resource's quota.
        gpus, cores, memory, replicas = usage(inventory, key)
        need_gpus, need_cores, need_memory = profile.gpus_needed * n, profile.cpu_cores * n, profile.memory_bytes * n
        assert quota.gpus is None or not need_gpus or gpus + need_gpus <= quota.gpus
        assert quota.cpu_cores is None or not need_cores or cores + need_cores <= quota.cpu_cores + 1e-6
        assert quota.memory_bytes is None or not need_memory or memory + need_memory <= quota.memory_bytes
        assert quota.replicas is None or replicas + 1 <= quota.replicas


def best_multi(verdicts: ProfileExplain, inventory: Inventory, need: int) -> tuple[bool, float] | None:
    """The best a replica across nodes can get from explain's verdicts: (in one finer group, sum of
    scores); a finer group (leaf) that holds the whole replica comes first."""
    by_group: dict[object, list[float]] = {}
    by_sub: dict[object, list[float]] = {}
    for verdict in verdicts.nodes:
        if not verdict.fits or verdict.score is None:
            continue
        for group in verdict.groups:
            by_group.setdefault(group, []).append(verdict.score)
        for sub in verdict.prefer:
            by_sub.setdefault(sub, []).append(verdict.score)
    for finer, table in ((True, by_sub), (False, by_group)):
        sums = [sum(sorted(scores, reverse=True)[:need]) for scores in table.values() if len(scores) >= need]
        if sums:
            return finer, max(sums)
    return None


def assert_agrees_with_explain(
    inventory: Inventory, request: ReplicaRequest, placement: Placement | None, registry: Registry
) -> None:
    explained = explain(inventory, request, registry=registry)
    for result in explained:
        profile = result.profile
        if any(r.code not in {"no_fit", "fabric_count", "no_fabric"} for r in result.reasons):
            assert not result.fits  # refused as a whole (quota)
            continue
        if profile.nodes_needed == 1:
            fitting = [v for v in result.nodes if v.fits]
            assert result.fits == bool(fitting)
        else:
            assert result.fits == (best_multi(result, inventory, profile.nodes_needed) is not None)
    first = next((r for r in explained if r.fits), None)
    if placement is None:
        assert first is None
        return
    assert first is not None and first.profile.id == placement.profile.id
    if placement.profile.nodes_needed == 1:
        best = next(v for v in first.nodes if v.fits)
        assert placement.shards[0].node_id == best.node_id
    else:
        scores = {v.node_id: v.score for v in first.nodes if v.fits}
        total = sum(scores[s.node_id] or 0.0 for s in placement.shards)
        best = best_multi(first, inventory, placement.profile.nodes_needed)
        assert best is not None and math.isclose(total, best[1], rel_tol=1e-9, abs_tol=1e-9)
        assert (placement.subgroup is not None) == best[0]


@SETTINGS
@given(
    cluster=clusters(),
    data=st.data(),
    weight=st.sampled_from((0.0, 0.0, 0.3, 1.5)),
    physical=st.booleans(),
)
def test_random_clusters_and_requests(cluster: Cluster, data: st.DataObject, weight: float, physical: bool) -> None:
    """With the built-in grouping by declared fabric, and with the fabrics app's physical fabrics,
    leaves and cable scorer on."""
    registry = registries(weight, physical)
    inventory = Inventory(cluster.nodes, cluster.claims, cluster.quotas)
    assert_consistent(inventory)
    for serial in range(data.draw(st.integers(1, 8))):
        if inventory.replica_ids() and data.draw(st.integers(0, 4)) == 0:
            inventory.release(data.draw(st.sampled_from(sorted(inventory.replica_ids()))))
            assert_consistent(inventory)
            continue
        request = data.draw(requests(serial))
        result = place(inventory, request, registry=registry)
        assert_agrees_with_explain(inventory, request, result.placement, registry)
        assert place(inventory, request, registry=registry) == result  # deterministic
        if result.placement is None:
            assert result.rejections and all(r.message == r.template % r.params for r in result.rejections)
            continue
        assert_valid(inventory, request, result.placement, physical)
        inventory.apply_request(result.placement, request)
        assert_consistent(inventory)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(cluster=clusters(), data=st.data())
def test_preemption_and_headroom_on_random_clusters(cluster: Cluster, data: st.DataObject) -> None:
    inventory = Inventory(cluster.nodes, cluster.claims, cluster.quotas)
    before = (list(inventory.claims), {i: inventory.memory_claimed(i) for i in inventory.nodes})
    request = data.draw(requests(0))
    rank = {"opportunistic": 0, "standard": 1, "critical": 2}
    candidates = preemption_candidates(inventory, request)
    for replica in candidates:
        claims = inventory.replica_claims(replica)
        assert all(c.model != request.model for c in claims)
        mine, theirs = rank[request.capacity_class], rank[claims[0].capacity_class]
        assert theirs < mine or (theirs == mine and all(c.above_minimum for c in claims))
    plan = plan_preemption(inventory, request)
    if plan is None:
        trial = inventory.copy()
        for replica in candidates:
            trial.release(replica)
        assert place(trial, request).placement is None
    else:
        assert set(plan.victims) <= set(candidates)
        trial = inventory.copy()
        for replica in plan.victims:
            trial.release(replica)
        assert_valid(trial, request, plan.placement)
        trial.apply_request(plan.placement, request)
        assert_consistent(trial)
    room = headroom(inventory, request, limit=20)
    trial = inventory.copy()
    for i in range(room):
        placement = place(trial, request).placement
        assert placement is not None
        assert_valid(trial, request, placement)
        trial.apply_request(placement, request, f"h{i}")
    if room < 20:
        assert place(trial, request).placement is None
    assert (inventory.claims, {i: inventory.memory_claimed(i) for i in inventory.nodes}) == before
