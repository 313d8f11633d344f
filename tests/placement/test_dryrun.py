"""Dry runs: headroom, and what preemption would stop to place a model below its minimum."""

from __future__ import annotations

from apps.cluster.placement import (
    CapacityQuota,
    Claim,
    Inventory,
    headroom,
    place,
    plan_preemption,
    preemption_candidates,
)

from .builders import A100, GIB, cpu_node, cpu_profile, gpu_node, gpu_profile, req


def claim(
    replica: str,
    node: int,
    gpus: tuple[int, ...],
    cls: str,
    *,
    model: str = "other",
    above: bool = False,
    owner: tuple[str, ...] = (),
    memory: int = 0,
) -> Claim:
    return Claim(replica, 0, node, gpus, memory, 0, owner, cls, model, above)


def test_preemption_picks_a_lower_class() -> None:
    inventory = Inventory(
        {1: gpu_node(1, "a")},
        [claim("std", 1, (0, 1, 2, 3), "standard"), claim("opp", 1, (4, 5, 6, 7), "opportunistic")],
    )
    plan = plan_preemption(inventory, req(gpu_profile(gpus=4), capacity_class="standard"))
    assert plan is not None
    assert plan.victims == ["opp"]
    assert plan.placement.shards[0].gpu_indices == (4, 5, 6, 7)
    assert inventory.replica_ids() == ["std", "opp"]  # nothing was stopped on the real inventory


def test_same_class_only_what_grew_above_its_minimum() -> None:
    at_minimum = Inventory({1: gpu_node(1, "a", gpus=4)}, [claim("std", 1, (0, 1, 2, 3), "standard")])
    assert plan_preemption(at_minimum, req(gpu_profile(gpus=4))) is None
    grown = Inventory({1: gpu_node(1, "a", gpus=4)}, [claim("std", 1, (0, 1, 2, 3), "standard", above=True)])
    plan = plan_preemption(grown, req(gpu_profile(gpus=4)))
    assert plan is not None and plan.victims == ["std"]
    # A higher class is never stopped, grown or not.
    critical = Inventory({1: gpu_node(1, "a", gpus=4)}, [claim("crit", 1, (0, 1, 2, 3), "critical", above=True)])
    assert plan_preemption(critical, req(gpu_profile(gpus=4))) is None


def test_never_the_requests_own_model() -> None:
    inventory = Inventory({1: gpu_node(1, "a", gpus=4)}, [claim("mine", 1, (0, 1, 2, 3), "opportunistic", model="m")])
    assert preemption_candidates(inventory, req(gpu_profile(gpus=4), model="m")) == []
    assert plan_preemption(inventory, req(gpu_profile(gpus=4), model="m", capacity_class="critical")) is None


def test_stops_nothing_when_even_every_candidate_makes_no_room() -> None:
    inventory = Inventory(
        {1: gpu_node(1, "a")},
        [claim("opp", 1, (0, 1), "opportunistic"), claim("crit", 1, (2, 3, 4, 5, 6, 7), "critical")],
    )
    assert plan_preemption(inventory, req(gpu_profile(gpus=4))) is None
    assert len(inventory.free_gpus(1)) == 0 and inventory.replica_ids() == ["opp", "crit"]


def test_cheapest_first_and_newest_of_equals() -> None:
    nodes = {1: gpu_node(1, "a", gpus=4), 2: gpu_node(2, "b", gpus=4)}
    claims = [
        claim("big", 1, (0, 1, 2, 3), "opportunistic"),
        claim("old", 2, (0, 1), "opportunistic"),
        claim("new", 2, (2, 3), "opportunistic"),
        claim("std", 2, (), "standard", above=True),
    ]
    inventory = Inventory(nodes, claims)
    request = req(gpu_profile(gpus=2), capacity_class="standard")
    # Lower class first, then fewer GPUs, then the newest; "std" is of the same class but grew above its minimum.
    assert preemption_candidates(inventory, request) == ["new", "old", "big", "std"]
    plan = plan_preemption(inventory, request)
    assert plan is not None and plan.victims == ["new"]
    assert preemption_candidates(inventory, req(gpu_profile(gpus=2), capacity_class="opportunistic")) == []


def test_victims_the_room_did_not_need_are_given_back() -> None:
    nodes = {1: gpu_node(1, "a"), 2: gpu_node(2, "b")}
    claims = [
        claim("small", 1, (0,), "opportunistic"),
        claim("crit-a", 1, (1, 2, 3, 4, 5, 6, 7), "critical"),
        claim("large", 2, (0, 1, 2, 3), "opportunistic"),
        claim("crit-b", 2, (4, 5, 6, 7), "critical"),
    ]
    inventory = Inventory(nodes, claims)
    plan = plan_preemption(inventory, req(gpu_profile(gpus=4)))
    assert plan is not None and plan.victims == ["large"]
    assert plan.placement.shards[0].node_name == "b"


def test_victims_on_nodes_the_request_cannot_use_are_left_alone() -> None:
    nodes = {1: gpu_node(1, "a100", gpu_class=A100, gpus=4), 2: gpu_node(2, "h100", gpus=4)}
    claims = [
        claim("a100-opp", 1, (0, 1, 2, 3), "opportunistic"),
        claim("h100-opp", 2, (0, 1, 2, 3), "standard", above=True),
    ]
    plan = plan_preemption(Inventory(nodes, claims), req(gpu_profile(gpus=4)))
    assert plan is not None and plan.victims == ["h100-opp"]


def test_preemption_can_make_room_in_a_quota() -> None:
    nodes = {1: gpu_node(1, "a")}
    claims = [claim("opp", 1, (0, 1, 2, 3), "opportunistic", owner=("team:1",))]
    inventory = Inventory(nodes, claims, {"team:1": CapacityQuota(gpus=4)})
    request = req(gpu_profile(gpus=4), owner=("team:1",))
    assert place(inventory, request).placement is None
    plan = plan_preemption(inventory, request)
    assert plan is not None and plan.victims == ["opp"]


def test_a_request_that_fits_needs_no_victims() -> None:
    plan = plan_preemption(Inventory({1: gpu_node(1)}), req(gpu_profile(gpus=4)))
    assert plan is not None and plan.victims == [] and plan.placement.shards[0].node_id == 1


def test_headroom_counts_and_leaves_the_inventory_alone() -> None:
    inventory = Inventory({1: gpu_node(1, "a", claimed={0: "x"}), 2: gpu_node(2, "b", unhealthy=(7,))})
    request = req(gpu_profile(gpus=2))
    assert headroom(inventory, request) == 3 + 3
    assert headroom(inventory, request, limit=4) == 4
    assert len(inventory.free_gpus(1)) == 7 and inventory.claims == []
    assert headroom(inventory, req(gpu_profile(gpus=8))) == 0


def test_headroom_of_a_cpu_model_counts_memory_and_cores() -> None:
    inventory = Inventory({1: cpu_node(1, memory_gb=100, cpus=64), 2: cpu_node(2, memory_gb=64, cpus=8)})
    assert headroom(inventory, req(cpu_profile(memory_gb=20, cores=4))) == 5 + 2
    assert headroom(inventory, req(cpu_profile())) == 1000  # claims nothing: only the limit stops it


def test_headroom_respects_quotas() -> None:
    inventory = Inventory({1: gpu_node(1)}, quotas={"team:1": CapacityQuota(replicas=3)})
    assert headroom(inventory, req(gpu_profile(gpus=1), owner=("team:1",))) == 3


def test_headroom_with_preemption() -> None:
    claims = [claim(f"opp{i}", 1, (2 * i, 2 * i + 1), "opportunistic", memory=GIB) for i in range(4)]
    inventory = Inventory({1: gpu_node(1, "a", memory_gb=100)}, claims)
    request = req(gpu_profile(gpus=2), capacity_class="standard")
    assert headroom(inventory, request) == 0
    assert headroom(inventory, request, preempt=True) == 4
    assert headroom(inventory, req(gpu_profile(gpus=2), capacity_class="opportunistic"), preempt=True) == 0
    assert inventory.replica_ids() == ["opp0", "opp1", "opp2", "opp3"]
