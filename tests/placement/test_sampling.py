"""On a large fleet the walk scores a sample of the nodes that pass every filter, and explain spells out
a limited number of nodes and counts the rest.

The thresholds are the registry's (1,000 nodes and 100 by default); here they are lowered so a
fleet of tens of nodes behaves as one of thousands.
"""

from __future__ import annotations

from typing import Any

import pytest

from apps.cluster.placement import REGISTRY, Inventory, PlacementContext, Registry, explain, place
from apps.fabrics import placement as fabric_plugins
from apps.facility import placement as facility_plugins

from .builders import A100, cpu_profile, gpu_node, gpu_profile, req


def sampled(above: int = 10, size: int = 5, registry: Registry | None = None) -> Registry:
    registry = (registry or REGISTRY).copy()
    registry.sample_above = above
    registry.sample_size = size
    return registry


def last_best(ctx: PlacementContext, node: Any) -> float:
    """A plugin that likes the node with the highest id: the last of the walk."""
    return node.id / 1000


def fleet(count: int = 40, **kw: Any) -> dict[int, Any]:
    return {i: gpu_node(i, f"n{i:03d}", **kw) for i in range(1, count + 1)}


def test_below_the_threshold_every_candidate_is_scored() -> None:
    registry = sampled(above=100)
    registry.register_scorer(last_best, name="test.last", weight=1.0)
    result = place(Inventory(fleet()), req(gpu_profile(gpus=8)), registry=registry)
    assert result.placement is not None and result.placement.shards[0].node_name == "n040"


def test_above_it_the_best_of_the_sample_wins() -> None:
    registry = sampled(above=10, size=5)
    registry.register_scorer(last_best, name="test.last", weight=1.0)
    result = place(Inventory(fleet()), req(gpu_profile(gpus=8)), registry=registry)
    # The walk (equal built-in scores: name order) stopped after five nodes fit; the plugin chose among them.
    assert result.placement is not None and result.placement.shards[0].node_name == "n005"


def test_a_sample_never_gives_up_a_node_that_fits() -> None:
    nodes = fleet(ready=False, status="offline")
    nodes[37] = gpu_node(37, "n037")
    registry = sampled(above=10, size=5)
    registry.register_scorer(last_best, name="test.last", weight=1.0)
    result = place(Inventory(nodes), req(gpu_profile(gpus=8)), registry=registry)
    assert result.placement is not None and result.placement.shards[0].node_name == "n037"


def test_a_cpu_profile_on_gpu_nodes_is_sampled_in_chunks_and_still_fits() -> None:
    nodes = fleet(memory_gb=64, cpus=16)
    for node_id in range(1, 33):  # the first 32 have no memory left for it
        nodes[node_id] = gpu_node(node_id, f"n{node_id:03d}", memory_gb=8, cpus=16)
    result = place(Inventory(nodes), req(cpu_profile(memory_gb=16, cores=2)), registry=sampled(size=4))
    assert result.placement is not None and result.placement.shards[0].node_name == "n033"


def nvlink_tray(node_id: int, domain: str | None) -> Any:
    extra: dict[str, Any] = {
        "fabrics": [{"name": "ib-a", "kind": "ib", "identity": "ib:0x1", "problem": "", "hcas": ["mlx5_0"]}]
    }
    if domain is not None:
        extra["nvlink"] = {"domain": domain, "label": domain[:8], "ready": True, "problems": []}
    return gpu_node(node_id, f"t{node_id:03d}", gpus=4, extra=extra)


def test_a_sampled_walk_still_forms_a_replica_inside_an_nvlink_domain_found_late() -> None:
    # Thirty trays on InfiniBand only, then two of one NVLink domain at the end of the walk.
    nodes = {i: nvlink_tray(i, None) for i in range(1, 31)}
    nodes[31] = nvlink_tray(31, "d" * 36 + ".1")
    nodes[32] = nvlink_tray(32, "d" * 36 + ".1")
    registry = REGISTRY.copy()
    fabric_plugins.register(registry)
    registry = sampled(above=10, size=4, registry=registry)
    result = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == ("nvlink:" + "d" * 36 + ".1",)
    assert sorted(s.node_name for s in result.placement.shards) == ["t031", "t032"]


def test_a_sampled_multi_node_walk_stops_once_a_group_holds_the_replica() -> None:
    nodes = {i: nvlink_tray(i, None) for i in range(1, 41)}
    registry = REGISTRY.copy()
    fabric_plugins.register(registry)
    registry.register_scorer(last_best, name="test.last", weight=1.0)
    exact = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2)), registry=registry)
    assert exact.placement is not None and [s.node_name for s in exact.placement.shards] == ["t040", "t039"]
    quick = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2)), registry=sampled(size=16, registry=registry))
    assert quick.placement is not None
    assert max(s.node_id for s in quick.placement.shards) <= 32  # chosen from the sample, not the whole walk


@pytest.fixture
def mixed() -> Inventory:
    nodes = {}
    for i in range(1, 13):  # twelve H100 nodes: 1-4 full, 5 cordoned, 6-12 free
        claimed = {g: "busy" for g in range(8)} if i <= 4 else {}
        nodes[i] = gpu_node(i, f"h{i:02d}", claimed=claimed, cordoned=i == 5, cordon_reason="fan")
    for i in range(13, 21):  # eight A100 nodes
        nodes[i] = gpu_node(i, f"a{i:02d}", gpu_class=A100)
    return Inventory(nodes)


def test_explain_with_a_limit_spells_out_the_best_and_counts_the_rest(mixed: Inventory) -> None:
    registry = REGISTRY.copy()
    facility_plugins.register(registry)
    [full] = explain(mixed, req(gpu_profile(gpus=8)), registry=registry)
    [short] = explain(mixed, req(gpu_profile(gpus=8)), registry=registry, limit=3)
    assert [v.node_name for v in short.nodes] == [v.node_name for v in full.nodes][:3]
    assert [v.score for v in short.nodes] == [v.score for v in full.nodes][:3]
    assert [v.scores for v in short.nodes] == [v.scores for v in full.nodes][:3]
    assert short.fits and short.placement is not None
    assert short.placement.shards[0].node_name == full.placement.shards[0].node_name  # type: ignore[union-attr]
    fitting = sum(1 for v in full.nodes if v.fits)
    assert fitting == 7 and short.more_fit == 4
    counted = {code: count for code, (count, _) in short.more_refused.items()}
    # Nodes without the class and nodes with too few free are counted from the capacity index.
    assert counted == {"gpu_class": 8, "gpus": 4, "cordoned": 1}
    assert short.more_refused["gpu_class"][1].message == "node a13 has no H100-80GB GPUs (it has A100-80GB)"
    assert short.more_refused["gpus"][1].message == "node h01 has 0 free healthy H100-80GB GPUs, needs 8"
    assert len(short.nodes) + short.more_fit + sum(counted.values()) == len(mixed.nodes)
    assert full.more_fit == 0 and full.more_refused == {}


def test_explain_with_room_for_refused_nodes_spells_them_out_with_every_reason(mixed: Inventory) -> None:
    [full] = explain(mixed, req(gpu_profile(gpus=8)))
    [short] = explain(mixed, req(gpu_profile(gpus=8)), limit=10)
    assert [v.node_name for v in short.nodes] == [v.node_name for v in full.nodes][:10]
    assert [[r.message for r in v.reasons] for v in short.nodes] == [
        [r.message for r in v.reasons] for v in full.nodes
    ][:10]
    assert sum(count for count, _ in short.more_refused.values()) == 10


def test_a_model_tally_follows_claims_in_copies_and_releases() -> None:
    from apps.cluster.placement import ShardPlan

    inventory = Inventory(fleet(4))
    racks = {1: "r1", 2: "r1", 3: "r2"}  # node 4 says no rack

    def claim(replica: str, node_id: int, into: Inventory) -> None:
        placement = place(into, req(gpu_profile(gpus=1)), registry=REGISTRY).placement
        assert placement is not None
        placement.shards = [ShardPlan(0, node_id, f"n{node_id:03d}", (0,) if node_id != 1 else (1,), 0, 0.0)]
        into.apply(placement, replica, model="m")

    claim("a", 1, inventory)
    assert inventory.model_tally("rack", "m", lambda: racks) == {"r1": 1}
    claim("b", 3, inventory)
    claim("c", 4, inventory)
    assert inventory.model_tally("rack", "m", lambda: racks) == {"r1": 1, "r2": 1, None: 1}
    other = inventory.copy()
    other.release("b")
    assert other.model_tally("rack", "m", lambda: racks) == {"r1": 1, None: 1}
    assert inventory.model_tally("rack", "m", lambda: racks) == {"r1": 1, "r2": 1, None: 1}
    assert inventory.model_tally("rack", "other", lambda: racks) == {}
