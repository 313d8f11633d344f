"""Where place() puts replicas: packing, spreading, weights, NVLink, memory, cores, profiles, fabrics."""

from __future__ import annotations

import random

import pytest

from apps.cluster.placement import (
    Claim,
    Inventory,
    Placement,
    PlacementConflict,
    ShardPlan,
    choose_gpus,
    place,
)

from .builders import A100, GIB, H100, cpu_node, cpu_profile, gpu_node, gpu_profile, req


def only_node(result_placement: Placement | None) -> str:
    assert result_placement is not None
    assert len(result_placement.shards) == 1
    return result_placement.shards[0].node_name


def test_single_node_replicas_fill_partly_used_nodes_first() -> None:
    nodes = {1: gpu_node(1, "a"), 2: gpu_node(2, "b", claimed={0: "x", 1: "x", 2: "x", 3: "x"}), 3: gpu_node(3, "c")}
    inventory = Inventory(nodes)
    assert only_node(place(inventory, req(gpu_profile(gpus=2))).placement) == "b"


def test_best_fit_takes_the_node_left_with_the_least() -> None:
    nodes = {
        1: gpu_node(1, "a", gpus=8, claimed={i: "x" for i in range(5)}),  # 3 free
        2: gpu_node(2, "b", gpus=8, claimed={i: "x" for i in range(6)}),  # 2 free
        3: gpu_node(3, "c", gpus=8),
    }
    inventory = Inventory(nodes)
    assert only_node(place(inventory, req(gpu_profile(gpus=2))).placement) == "b"
    assert only_node(place(inventory, req(gpu_profile(gpus=3))).placement) == "a"
    assert only_node(place(inventory, req(gpu_profile(gpus=4))).placement) == "c"


def test_packing_keeps_a_whole_node_for_a_big_model() -> None:
    inventory = Inventory({1: gpu_node(1, "a"), 2: gpu_node(2, "b")})
    small = req(gpu_profile(gpus=1))
    for i in range(8):
        placement = place(inventory, small).placement
        assert placement is not None
        inventory.apply_request(placement, small, f"s{i}")
    assert {c.node_id for c in inventory.claims} == {1}
    big = place(inventory, req(gpu_profile(gpus=8))).placement
    assert big is not None and big.shards[0].node_name == "b"


def test_multi_node_replicas_take_the_emptiest_nodes() -> None:
    nodes = {
        1: gpu_node(1, "a", fabric="ib", claimed={0: "x"}),
        2: gpu_node(2, "b", fabric="ib"),
        3: gpu_node(3, "c", fabric="ib", claimed={0: "x", 1: "x"}),
        4: gpu_node(4, "d", fabric="ib"),
    }
    placement = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2))).placement
    assert placement is not None
    assert [s.node_name for s in placement.shards] == ["b", "d"]
    assert [s.rank for s in placement.shards] == [0, 1]


def test_weights_are_a_preference_not_a_filter() -> None:
    nodes = {
        1: gpu_node(1, "a", claimed={i: "x" for i in range(6)}),
        2: gpu_node(2, "b", weights=frozenset({"m"})),
        3: gpu_node(3, "c", weights=frozenset({"m"}), claimed={i: "x" for i in range(4)}),
    }
    inventory = Inventory(nodes)
    # b and c hold the weights; c is the fuller of the two. a is fuller still, but must fetch them.
    assert only_node(place(inventory, req(gpu_profile(gpus=2), model="m")).placement) == "c"
    assert only_node(place(inventory, req(gpu_profile(gpus=2), model="other")).placement) == "a"
    # Of the holders only b has room for 5; with no holder that fits, another node is used all the same.
    assert only_node(place(inventory, req(gpu_profile(gpus=5), model="m")).placement) == "b"
    inventory2 = Inventory({1: gpu_node(1, "a"), 2: gpu_node(2, "b", gpus=2, weights=frozenset({"m"}))})
    assert only_node(place(inventory2, req(gpu_profile(gpus=4), model="m")).placement) == "a"


def test_multi_node_prefers_nodes_holding_the_weights() -> None:
    nodes = {
        i: gpu_node(
            i, f"n{i}", fabric="ib-a" if i < 4 else "ib-b", weights=frozenset({"big"}) if i >= 4 else frozenset()
        )
        for i in range(1, 7)
    }
    placement = place(Inventory(nodes), req(gpu_profile(gpus=8, nodes=2), model="big")).placement
    assert placement is not None
    assert [s.node_name for s in placement.shards] == ["n4", "n5"]


@pytest.mark.parametrize(
    ("need", "expected"),
    [
        (1, (6,)),  # the group with one free card left, so the bigger groups stay whole
        (2, (4, 5)),
        (3, (0, 1, 2)),
        (4, (0, 1, 2, 3)),
        (5, (0, 1, 2, 3, 4)),  # no group has room: lowest free indices
        (8, None),
    ],
)
def test_nvlink_groups(need: int, expected: tuple[int, ...] | None) -> None:
    groups: list[str | None] = ["g0"] * 4 + ["g1"] * 2 + ["g2"] * 2
    node = gpu_node(1, "a", groups=groups, claimed={7: "x"})
    assert choose_gpus(Inventory({1: node}), 1, H100, need) == expected


def test_nvlink_unknown_takes_lowest_free_indices() -> None:
    node = gpu_node(1, "a", claimed={0: "x", 2: "x"}, unhealthy=(3,))
    inventory = Inventory({1: node})
    assert choose_gpus(inventory, 1, H100, 3) == (1, 4, 5)
    placement = place(inventory, req(gpu_profile(gpus=3))).placement
    assert placement is not None and placement.shards[0].gpu_indices == (1, 4, 5)


def test_place_keeps_a_shard_inside_one_nvlink_group() -> None:
    groups: list[str | None] = ["g0"] * 4 + ["g1"] * 4
    node = gpu_node(1, "a", groups=groups, claimed={0: "x"})
    inventory = Inventory({1: node})
    placement = place(inventory, req(gpu_profile(gpus=4))).placement
    assert placement is not None and placement.shards[0].gpu_indices == (4, 5, 6, 7)


def test_cpu_profile_with_no_memory_claims_nothing() -> None:
    inventory = Inventory({1: cpu_node(1, "c", memory_gb=8, cpus=4)})
    request = req(cpu_profile(memory_gb=0, cores=0))
    for i in range(20):
        placement = place(inventory, request).placement
        assert placement is not None
        assert placement.shards[0].memory_bytes == 0 and placement.shards[0].gpu_indices == ()
        inventory.apply_request(placement, request, f"r{i}")
    assert inventory.memory_claimed(1) == 0 and inventory.cores_claimed(1) == 0


def test_cpu_profile_claims_no_gpu_and_keeps_off_gpu_nodes() -> None:
    nodes = {1: gpu_node(1, "a-gpu", memory_gb=1024, cpus=128), 2: cpu_node(2, "z-cpu", memory_gb=64, cpus=16)}
    inventory = Inventory(nodes)
    profile = cpu_profile(memory_gb=24, cores=4)
    profile.gpus_per_shard = 2  # meaningless for a CPU profile: it claims no GPU
    request = req(profile)
    placed = []
    for i in range(3):
        placement = place(inventory, request).placement
        assert placement is not None and placement.shards[0].gpu_indices == ()
        inventory.apply_request(placement, request, f"r{i}")
        placed.append(placement.shards[0].node_name)
    # Two fit on the CPU node (48 of 64 GB); only then does a GPU node take one.
    assert placed == ["z-cpu", "z-cpu", "a-gpu"]
    assert inventory.free_gpus(1) == inventory.nodes[1].gpus


def test_memory_is_never_handed_out_twice() -> None:
    inventory = Inventory({1: cpu_node(1, "small", memory_gb=31, cpus=None)})
    request = req(cpu_profile(memory_gb=16))
    first = place(inventory, request).placement
    assert first is not None
    inventory.apply_request(first, request, "one")
    second = place(inventory, request)
    assert second.placement is None
    assert [r.message for r in second.rejections if r.node_id == 1] == [
        "node small has 15 GB of memory free of 31, needs 16"
    ]


def test_two_15_gb_claims_fit_31_gb_and_a_third_is_refused() -> None:
    inventory = Inventory({1: cpu_node(1, "small", memory_gb=31)})
    request = req(cpu_profile(memory_gb=15))
    for i in range(2):
        placement = place(inventory, request).placement
        assert placement is not None
        inventory.apply_request(placement, request, f"r{i}")
    third = place(inventory, request)
    assert third.placement is None
    assert [r.message for r in third.rejections if r.node_id == 1] == [
        "node small has 1 GB of memory free of 31, needs 15"
    ]


def test_cores_are_reserved_like_memory() -> None:
    inventory = Inventory({1: cpu_node(1, "c", cpus=16, memory_gb=None)})
    request = req(cpu_profile(cores=6))
    for i in range(2):
        placement = place(inventory, request).placement
        assert placement is not None
        inventory.apply_request(placement, request, f"r{i}")
    refused = place(inventory, request)
    assert [r.message for r in refused.rejections if r.node_id == 1] == ["node c has 4 of 16 CPU cores free, needs 6"]


def test_a_node_that_reports_no_memory_or_cpus_stays_usable() -> None:
    inventory = Inventory({1: cpu_node(1, "old-agent", memory_gb=None, cpus=None)})
    placement = place(inventory, req(cpu_profile(memory_gb=500, cores=100))).placement
    assert placement is not None and placement.shards[0].node_name == "old-agent"


def test_engines_none_does_not_filter() -> None:
    inventory = Inventory({1: gpu_node(1, engines=None), 2: gpu_node(2, engines=frozenset())})
    assert only_node(place(inventory, req(gpu_profile(engine="sglang"))).placement) == "gpu-1"


def test_larger_priority_is_tried_first_and_earlier_refusals_are_kept() -> None:
    inventory = Inventory({1: gpu_node(1, "a", gpu_class=A100, gpus=8)})
    h100 = gpu_profile(1, gpus=8, gpu_class=H100, priority=10, name="fast")
    a100 = gpu_profile(2, gpus=8, gpu_class=A100, priority=5, name="slower")
    result = place(inventory, req(a100, h100))
    assert result.placement is not None and result.placement.profile.name == "slower"
    assert [r.message for r in result.placement.rejections] == [
        "node a has no H100-80GB GPUs (it has A100-80GB)",
        "no node can take profile fast: 1 of 1 nodes refused it",
    ]
    assert result.rejections == result.placement.rejections
    # Both fit: the higher priority wins, whatever the list order.
    inventory = Inventory({1: gpu_node(1, "a", gpu_class=A100), 2: gpu_node(2, "b", gpu_class=H100)})
    for profiles in ((a100, h100), (h100, a100)):
        placed = place(inventory, req(*profiles)).placement
        assert placed is not None and placed.profile.name == "fast"


def test_multi_node_stays_on_one_fabric_and_never_uses_nodes_on_none() -> None:
    nodes = {
        1: gpu_node(1, "a", fabric=None),
        2: gpu_node(2, "b", fabric=None),
        3: gpu_node(3, "c", fabric="ib-a"),
        4: gpu_node(4, "d", fabric="ib-b"),
        5: gpu_node(5, "e", fabric="ib-b", gpu_class=A100),
    }
    inventory = Inventory(nodes)
    assert place(inventory, req(gpu_profile(gpus=8, nodes=2))).placement is None
    nodes[6] = gpu_node(6, "f", fabric="ib-b")
    placement = place(Inventory(nodes), req(gpu_profile(gpus=8, nodes=2))).placement
    assert placement is not None and [s.node_name for s in placement.shards] == ["d", "f"]


def test_multi_node_cpu_replica() -> None:
    nodes = {i: cpu_node(i, f"c{i}", fabric="eth" if i < 3 else "ib") for i in range(1, 6)}
    placement = place(Inventory(nodes), req(cpu_profile(memory_gb=32, cores=8, nodes=3))).placement
    assert placement is not None
    assert [s.node_name for s in placement.shards] == ["c3", "c4", "c5"]


def test_same_input_same_output() -> None:
    rng = random.Random(5)
    nodes = {
        i: gpu_node(
            i,
            f"n{i:02d}",
            gpus=8,
            claimed={j: "x" for j in range(rng.randrange(8))},
            fabric=rng.choice(["a", "b", None]),
        )
        for i in range(1, 40)
    }
    profiles = [gpu_profile(1, gpus=2), gpu_profile(2, gpus=4, nodes=2, priority=-1)]
    first = place(Inventory(nodes), req(*profiles))
    shuffled = dict(sorted(nodes.items(), key=lambda _: rng.random()))
    again = place(Inventory(shuffled), req(*reversed(profiles)))
    assert first.placement is not None and again.placement is not None
    assert first.placement.shards == again.placement.shards
    assert first.rejections == again.rejections


def test_apply_refuses_a_taken_gpu_and_release_frees_the_replica_whole() -> None:
    nodes = {
        1: gpu_node(1, "a", fabric="ib", memory_gb=100, claimed={7: "legacy"}),
        2: gpu_node(2, "b", fabric="ib", memory_gb=100),
    }
    inventory = Inventory(nodes)
    request = req(gpu_profile(gpus=4, nodes=2, memory_gb=10), owner=("team:1",))
    placement = place(inventory, request).placement
    assert placement is not None
    inventory.apply_request(placement, request, "r1")
    assert inventory.usage("team:1") == (8, 0.0, 20 * GIB, 1)
    clash = Placement(placement.profile, [ShardPlan(0, 1, "a", (placement.shards[0].gpu_indices[0],), 0, 0)])
    with pytest.raises(PlacementConflict):
        inventory.apply(clash, "r2")
    assert inventory.replica_ids() == ["r1"]
    with pytest.raises(PlacementConflict):
        inventory.apply(Placement(placement.profile, [ShardPlan(0, 1, "a", (7,), 0, 0)]), "r3")
    with pytest.raises(PlacementConflict):
        inventory.apply(Placement(placement.profile, [ShardPlan(0, 1, "a", (), 91 * GIB, 0)]), "r4")
    assert len(inventory.release("r1")) == 2
    assert inventory.usage("team:1") == (0, 0.0, 0, 0)
    assert inventory.memory_claimed(1) == inventory.memory_claimed(2) == 0
    assert len(inventory.free_gpus(1)) == 7 and len(inventory.free_gpus(2)) == 8
    inventory.release("legacy")  # a slot the snapshot marked as claimed is freed by its replica's release
    assert len(inventory.free_gpus(1)) == 8


def test_copy_is_independent() -> None:
    inventory = Inventory(
        {1: gpu_node(1, memory_gb=64)}, [Claim("old", 0, 1, (0,), GIB, 1, ("t",), "standard", "x", False)]
    )
    copy = inventory.copy()
    request = req(gpu_profile(gpus=7, memory_gb=4))
    placement = place(copy, request).placement
    assert placement is not None
    copy.apply_request(placement, request, "new")
    copy.release("old")
    assert inventory.replica_ids() == ["old"] and len(inventory.free_gpus(1)) == 7
    assert inventory.memory_claimed(1) == GIB and inventory.usage("t").gpus == 1
    assert len(copy.free_gpus(1)) == 1 and copy.memory_claimed(1) == 4 * GIB


def test_only_gpus_of_the_profile_class_on_a_mixed_node() -> None:
    node = gpu_node(1, "mixed", gpus=4, gpu_class=A100)
    node.gpus.extend(gpu_node(9, gpus=4, gpu_class=H100).gpus)
    for i, slot in enumerate(node.gpus):
        slot.index = i
    placement = place(Inventory({1: node}), req(gpu_profile(gpus=3, gpu_class=H100))).placement
    assert placement is not None and placement.shards[0].gpu_indices == (4, 5, 6)
