"""What the facility rules read per candidate is worked out once (each capped node's domains with
their caps and known draws, each node's rack and PDU) and once per placement (what the claims add
per domain, the model's shards per rack and PDU): claims applied and released in one run, draws
renewed and dry-run copies must all be seen by the next candidate, as if nothing were kept."""

from __future__ import annotations

from typing import Any

from apps.cluster.placement import Inventory, PlacementContext, Registry, builtin_registry, explain, place
from apps.facility import placement as facility_plugins
from tests.placement.builders import gpu_node, gpu_profile, req


def registry() -> Registry:
    found = builtin_registry()
    facility_plugins.register(found)
    return found


def node(
    node_id: int,
    rack: str | None,
    pdu: str | None = None,
    *,
    free: int = 8,
    caps: dict[str, int] | None = None,
    draw: float | None = None,
) -> Any:
    place = {"site": None, "room": None, "row": None, "rack": rack, "pdu": pdu}
    facility: dict[str, Any] = {"location": place, "held": []}
    if caps:
        facility["caps"] = caps
    if draw is not None:
        facility["draw_w"] = draw
    claimed = {i: "busy" for i in range(8 - free)}
    return gpu_node(node_id, f"n{node_id}", claimed=claimed, extra={"facility": facility})


def two_cards(replica_id: str, model: str = "m") -> Any:
    return req(gpu_profile(gpus=2), model=model, replica_id=replica_id)  # 2 x H100: 1.4 kW by TDP


def place_one(inventory: Inventory, request: Any, plugins: Registry) -> str | None:
    result = place(inventory, request, registry=plugins)
    if result.placement is None:
        return None
    inventory.apply_request(result.placement, request)
    return result.placement.shards[0].node_name


def messages(inventory: Inventory, request: Any, plugins: Registry, name: str) -> list[str]:
    [explained] = explain(inventory, request, registry=plugins)
    return [r.message for v in explained.nodes if v.node_name == name for r in v.reasons]


def test_a_claim_on_one_node_of_a_pdu_is_seen_by_the_next_candidate_on_that_pdu() -> None:
    # n1 and n2 share PDU p1 (1.5 kW cap, nothing drawn yet) and are the tightest fits; n3 is elsewhere.
    p1 = {"pdu=p1": 1500}
    nodes = {
        1: node(1, "r1", "p1", free=4, caps=p1, draw=0.0),
        2: node(2, "r2", "p1", free=4, caps=p1, draw=0.0),
        3: node(3, "r3", "p2"),
    }
    inventory, plugins = Inventory(nodes), registry()
    assert place_one(inventory, two_cards("a"), plugins) == "n1"
    # In the same run: n2 has the cards, but its PDU now draws n1's new shard.
    assert place_one(inventory, two_cards("b"), plugins) == "n3"
    refused = messages(inventory, two_cards("c"), plugins, "n2")
    assert refused == ["pdu=p1: 1.4 kW of 1.5 kW drawn, this replica adds 1.4 kW"]


def test_two_placements_in_one_run_do_not_both_take_the_last_watts_of_a_cap() -> None:
    # Rack r1: 3 kW cap, 1 kW drawn: room for one 1.4 kW replica, not two.
    nodes = {1: node(1, "r1", caps={"rack=r1": 3000}, draw=1000.0), 2: node(2, "r1", caps={"rack=r1": 3000}, draw=0.0)}
    inventory, plugins = Inventory(nodes), registry()
    assert place_one(inventory, two_cards("a"), plugins) is not None
    second = place(inventory, two_cards("b"), registry=plugins)
    assert second.placement is None
    assert "rack=r1: 2.4 kW of 3.0 kW drawn, this replica adds 1.4 kW" in {r.message for r in second.rejections}
    # Released, its watts are free again for the next placement of the run.
    inventory.release("a")
    assert place_one(inventory, two_cards("c"), plugins) is not None


def test_a_dry_run_on_a_copy_leaves_the_inventory_its_watts() -> None:
    nodes = {1: node(1, "r1", caps={"rack=r1": 2000}, draw=0.0)}
    inventory, plugins = Inventory(nodes), registry()
    assert place(inventory, two_cards("probe"), registry=plugins).placement is not None  # sums built here
    dry = inventory.copy()
    assert place_one(dry, two_cards("a"), plugins) == "n1"
    assert place(dry, two_cards("b"), registry=plugins).placement is None
    assert place_one(inventory, two_cards("a"), plugins) == "n1"


def test_renewed_draws_are_what_the_next_placement_reads() -> None:
    nodes = {1: node(1, "r1", caps={"rack=r1": 5000}, draw=1000.0), 2: node(2, "r2", free=6)}
    inventory, plugins = Inventory(nodes), registry()
    assert place(inventory, two_cards("a"), registry=plugins).placement.shards[0].node_name == "n2"  # type: ignore[union-attr]
    # The rack's measured draw catches up (the simulator renews it as claims change).
    nodes[1].extra["facility"]["draw_w"] = 4000.0
    inventory.renew_index(facility_plugins.INDEX, facility_plugins.renew_draws)
    refused = messages(inventory, two_cards("a"), plugins, "n1")
    assert refused == ["rack=r1: 4.0 kW of 5.0 kW drawn, this replica adds 1.4 kW"]
    nodes[1].extra["facility"]["draw_w"] = 0.0
    inventory.renew_index(facility_plugins.INDEX, facility_plugins.renew_draws)
    assert messages(inventory, two_cards("a"), plugins, "n1") == []


def test_the_power_cap_is_asked_only_where_it_can_refuse() -> None:
    plugins = registry()
    [entry] = [e for e in plugins.filters() if e.name == facility_plugins.POWER]
    applies = entry.applies
    assert applies is not None

    def asked(nodes: dict[int, Any], gpu_class: str = "H100-80GB") -> bool:
        request = req(gpu_profile(gpus=2, gpu_class=gpu_class))
        return bool(applies(PlacementContext(Inventory(nodes), request, request.profiles[0], plugins)))

    capped = {1: node(1, "r1", caps={"rack=r1": 2000}, draw=0.0)}
    assert asked(capped)
    assert not asked({1: node(1, "r1")})  # no cap anywhere
    assert not asked(capped, gpu_class="X9-1TB")  # what a shard draws is unknown: never refused
    # Unknown draw passes a full rack, as before.
    full = {1: node(1, "r1", caps={"rack=r1": 2000}, draw=1900.0)}
    request = req(gpu_profile(gpus=2, gpu_class="X9-1TB"))
    assert messages(Inventory(full), request, plugins, "n1") == ["node n1 has no X9-1TB GPUs (it has H100-80GB)"]


def test_spread_reads_claims_and_releases_of_the_run_and_counts_unlocated_nodes_together() -> None:
    nodes = {1: node(1, "r1", "p1", free=4), 2: node(2, "r2", "p2"), 3: node(3, None, free=6), 4: node(4, None)}
    inventory, plugins = Inventory(nodes), registry()
    one = req(gpu_profile(gpus=1), replica_id="a")
    assert place_one(inventory, one, plugins) == "n1"
    assert place_one(inventory, req(gpu_profile(gpus=1), replica_id="b"), plugins) == "n3"
    # n3 and n4 say no rack: they count as one, which now holds a shard of the model.
    [explained] = explain(inventory, req(gpu_profile(gpus=1)), registry=plugins)
    scores = {v.node_name: v.scores.get("facility.spread") for v in explained.nodes if v.scores}
    assert scores == {"n1": 0.75, "n2": 1.5, "n3": 0.75, "n4": 0.75}
    inventory.release("a")
    [explained] = explain(inventory, req(gpu_profile(gpus=1)), registry=plugins)
    assert {v.node_name: v.scores.get("facility.spread") for v in explained.nodes if v.scores}["n1"] == 1.5
