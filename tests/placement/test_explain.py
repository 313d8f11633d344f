"""explain(): every node, every reason, and the score of what fits."""

from __future__ import annotations

from apps.cluster.placement import CapacityQuota, Claim, Inventory, explain, place

from .builders import A100, GIB, cpu_node, cpu_profile, gpu_node, gpu_profile, req


def test_explain_lists_every_reason_of_every_node() -> None:
    nodes = {
        1: gpu_node(
            1,
            "bad",
            gpu_class=A100,
            ready=False,
            status="offline",
            cordoned=True,
            cordon_reason="maintenance",
            labels={"pool": "chat"},
            engines=frozenset({"llama.cpp"}),
            memory_gb=16,
        ),
        2: gpu_node(2, "good", labels={"pool": "coding"}, memory_gb=512),
        3: gpu_node(3, "full", labels={"pool": "coding"}, memory_gb=64, claimed={i: "x" for i in range(7)}),
    }
    claims = [Claim("x", 0, 3, (), 60 * GIB, 0, (), "standard", "other", False)]
    inventory = Inventory(nodes, claims)
    profile = gpu_profile(gpus=2, memory_gb=24, selector={"pool": "coding"})
    [result] = explain(inventory, req(profile))
    assert result.fits and result.reasons == []
    assert result.placement is not None and result.placement.shards[0].node_name == "good"
    by_name = {v.node_name: v for v in result.nodes}
    assert [r.message for r in by_name["bad"].reasons] == [
        "node bad is not ready (offline)",
        "node bad is cordoned: maintenance",
        "node bad lacks label pool=coding",
        "node bad has no H100-80GB GPUs (it has A100-80GB)",
        "node bad has 16 GB of memory free of 16, needs 24",
        "node bad does not run the vllm engine",
    ]
    assert [r.message for r in by_name["full"].reasons] == [
        "node full has 1 free healthy H100-80GB GPUs, needs 2",
        "node full has 4 GB of memory free of 64, needs 24",
    ]
    assert [r.code for r in by_name["bad"].reasons] == [
        "not_ready",
        "cordoned",
        "label",
        "gpu_class",
        "memory",
        "engine",
    ]
    good = by_name["good"]
    assert good.fits and good.reasons == [] and good.score is not None
    assert not by_name["bad"].fits and by_name["bad"].score is None
    assert [v.node_name for v in result.nodes] == ["good", "bad", "full"]  # what fits first, then by name


def test_explain_orders_fitting_nodes_by_score_and_agrees_with_place() -> None:
    nodes = {i: gpu_node(i, f"n{i}", claimed={j: "x" for j in range(i)}) for i in range(6)}
    inventory = Inventory(nodes)
    request = req(gpu_profile(gpus=2))
    [result] = explain(inventory, request)
    fitting = [v for v in result.nodes if v.fits]
    assert [v.node_name for v in fitting] == ["n5", "n4", "n3", "n2", "n1", "n0"]
    assert [v.score for v in fitting] == sorted((v.score for v in fitting), reverse=True)  # type: ignore[misc]
    placed = place(inventory, request).placement
    assert placed is not None and result.placement is not None
    assert placed.shards == result.placement.shards


def test_explain_profile_level_reasons() -> None:
    inventory = Inventory(
        {1: gpu_node(1, "a", fabric="ib-a"), 2: gpu_node(2, "b", fabric="ib-b")},
        [Claim("old", 0, 1, (0,), 0, 0, ("team:1",), "standard", "x", False)],
        {"team:1": CapacityQuota(gpus=4, replicas=1)},
    )
    quota_limited, multi = explain(
        inventory,
        req(gpu_profile(1, gpus=4, priority=2), gpu_profile(2, gpus=4, nodes=2, name="2x4"), owner=("team:1",)),
    )
    assert not quota_limited.fits
    assert [r.message for r in quota_limited.reasons] == [
        "quota of team:1: 1 of 4 GPUs in use, needs 4 more",
        "quota of team:1: 1 of 1 replicas in use, needs 1 more",
    ]
    # Every node would take a shard; the quota alone refuses.
    assert all(v.fits for v in quota_limited.nodes)
    assert not multi.fits
    assert [r.code for r in multi.reasons] == ["quota_gpus", "quota_replicas"]
    [alone] = explain(inventory, req(gpu_profile(2, gpus=4, nodes=2, name="2x4")))
    assert [r.message for r in alone.reasons] == [
        "only 1 nodes of fabric ib-a can take a shard, needs 2",
        "only 1 nodes of fabric ib-b can take a shard, needs 2",
        "no fabric has 2 nodes that can take a shard of profile 2x4 (2 fabrics tried)",
    ]


def test_explain_cpu_nodes_and_no_fit_summary() -> None:
    inventory = Inventory({1: cpu_node(1, "c1", memory_gb=8), 2: cpu_node(2, "c2", memory_gb=16)})
    [result] = explain(inventory, req(cpu_profile(memory_gb=24, name="cpu-24")))
    assert not result.fits
    assert [r.message for v in result.nodes for r in v.reasons] == [
        "node c1 has 8 GB of memory free of 8, needs 24",
        "node c2 has 16 GB of memory free of 16, needs 24",
    ]
    assert [r.message for r in result.reasons] == ["no node can take profile cpu-24: 2 of 2 nodes refused it"]
    assert result.nodes[0].reasons[0].to_dict()["params"]["need_gb"] == "24"


def test_a_placed_replica_is_judged_on_its_own_nodes_without_its_own_claim_and_with_its_siblings_once() -> None:
    """A 4-core node running two replicas of 2 cores each: each of them fits where it runs (its own
    claim released, its sibling's counted once); one more replica fits nowhere, both counted."""
    from apps.cluster.placement import judge

    node = cpu_node(1, "vm", cpus=4)
    claims = [Claim(rid, 0, 1, (), 0, 2.0, (), "standard", "m", False) for rid in ("r1", "r2")]
    inventory = Inventory({1: node}, claims)
    profile = cpu_profile(cores=2)
    request = req(profile)
    for rid in ("r1", "r2"):
        without = inventory.copy()
        without.release(rid)
        reasons, (verdict,) = judge(without, request, profile, [1])
        assert reasons == [] and verdict.fits and verdict.score is not None and verdict.scores
    [next_one] = explain(inventory, request)
    assert not next_one.fits
    assert [r.message for r in next_one.nodes[0].reasons] == ["node vm has 0 of 4 CPU cores free, needs 2"]
    # Released, the inventory itself is unchanged: the next replica still sees both claims.
    assert inventory.cores_claimed(1) == 4.0

    cordoned = cpu_node(1, "vm", cpus=4, cordoned=True, cordon_reason="fan")
    reasons, (verdict,) = judge(Inventory({1: cordoned}, claims[1:]), request, profile, [1])
    assert not verdict.fits and [r.message for r in verdict.reasons] == ["node vm is cordoned: fan"]
