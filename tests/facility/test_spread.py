"""A model's replicas spread across racks and PDUs, placed one after another as the reconciler does."""

from __future__ import annotations

from typing import Any

from apps.cluster.placement import Inventory, Registry, builtin_registry, explain, place
from apps.facility import placement as facility_plugins
from tests.placement.builders import gpu_node, gpu_profile, req


def registry() -> Registry:
    found = builtin_registry()
    facility_plugins.register(found)
    return found


def node(node_id: int, rack: str | None, pdu: str | None = None, free: int = 8) -> Any:
    place = {"site": None, "room": None, "row": None, "rack": rack, "pdu": pdu}
    claimed = {i: "busy" for i in range(8 - free)}
    return gpu_node(node_id, f"n{node_id}", claimed=claimed, extra={"facility": {"location": place, "held": []}})


def place_all(inventory: Inventory, count: int, plugins: Registry, model: str = "m") -> list[str]:
    placed = []
    for i in range(count):
        request = req(gpu_profile(gpus=1), model=model, replica_id=f"{model}-{i}")
        result = place(inventory, request, registry=plugins)
        assert result.placement is not None
        inventory.apply_request(result.placement, request)
        placed.append(result.placement.shards[0].node_name)
    return placed


def test_replicas_of_one_model_go_to_different_racks_before_packing_one() -> None:
    # n1 is half used: binpack alone puts every replica there.
    nodes = {1: node(1, "r1", free=4), 2: node(2, "r1"), 3: node(3, "r2"), 4: node(4, "r3")}
    packed = place_all(Inventory(dict(nodes)), 3, builtin_registry())
    assert packed == ["n1", "n1", "n1"]
    spread = place_all(Inventory(dict(nodes)), 3, registry())
    racks = {"n1": "r1", "n2": "r1", "n3": "r2", "n4": "r3"}
    assert sorted(racks[n] for n in spread) == ["r1", "r2", "r3"]
    # A fourth goes back to the tightest fit once every rack holds one.
    inventory = Inventory(dict(nodes))
    assert place_all(inventory, 4, registry())[3] == "n1"


def test_other_models_do_not_count_and_pdus_spread_too() -> None:
    nodes = {1: node(1, "r1", "p1", free=4), 2: node(2, "r2", "p1"), 3: node(3, "r3", "p2")}
    inventory = Inventory(nodes)
    place_all(inventory, 1, registry(), model="other")
    first, second = place_all(inventory, 2, registry())
    assert first == "n1"  # the other model's replica there does not push this one away
    assert second == "n3"  # r2 and r3 are both free of the model, but r2 shares n1's PDU
    [explained] = explain(inventory, req(gpu_profile(gpus=1), model="m"), registry=registry())
    scores = {v.node_name: v.scores.get("facility.spread") for v in explained.nodes}
    # Weighted 1.5: n2's rack holds none of the model and its PDU one, n1 and n3 one of each.
    assert scores == {"n1": 0.75, "n2": 1.125, "n3": 0.75}


def test_without_locations_spread_changes_nothing() -> None:
    nodes = {1: gpu_node(1, "n1", claimed={0: "busy"}), 2: gpu_node(2, "n2")}
    assert place_all(Inventory(dict(nodes)), 2, registry()) == place_all(Inventory(dict(nodes)), 2, builtin_registry())
