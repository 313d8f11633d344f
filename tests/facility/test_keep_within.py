"""A replica across nodes kept within one rack (profile keep_within), on top of its fabric."""

from __future__ import annotations

from typing import Any

import pytest

from apps.cluster.placement import Inventory, Registry, builtin_registry, explain, place
from apps.fabrics import placement as fabric_plugins
from apps.facility import placement as facility_plugins
from tests.placement.builders import gpu_node, gpu_profile, req

IB = "ib:0x0002c90300000001"


@pytest.fixture
def registry() -> Registry:
    registry = builtin_registry()
    fabric_plugins.register(registry)
    facility_plugins.register(registry)
    return registry


def node(node_id: int, name: str, rack: str | None, *, free: int = 8, held: bool = False) -> Any:
    place = {"site": None, "room": None, "row": None, "rack": rack, "pdu": None}
    facility = {"location": place, "held": [{"domain": f"rack={rack}", "reason": "works"}] if held else []}
    fabrics = [{"name": "ib-a", "kind": "ib", "identity": IB, "problem": "", "hcas": ["mlx5_0"]}]
    claimed = {i: "busy" for i in range(8 - free)}
    return gpu_node(node_id, name, claimed=claimed, extra={"fabrics": fabrics, "facility": facility})


def within(level: str = "rack", **kw: Any) -> Any:
    profile = gpu_profile(gpus=8, nodes=2, **kw)
    profile.extra["keep_within"] = level
    return profile


def test_a_replica_kept_within_a_rack_takes_two_nodes_of_one_rack(registry: Registry) -> None:
    # By score the two emptiest nodes are in different racks.
    nodes = {1: node(1, "a1", "r1"), 2: node(2, "b1", "r2"), 3: node(3, "b2", "r2"), 4: node(4, "c1", "r3")}
    result = place(Inventory(nodes), req(within()), registry=registry)
    assert result.placement is not None
    assert sorted(s.node_name for s in result.placement.shards) == ["b1", "b2"]
    assert result.placement.group == (IB, "rack=r2")
    # Without keep_within any two nodes of the fabric will do.
    free = place(Inventory(nodes), req(gpu_profile(gpus=8, nodes=2)), registry=registry)
    assert free.placement is not None and free.placement.group == (IB,)


def test_no_rack_holds_the_replica_whole_and_the_refusal_says_so(registry: Registry) -> None:
    nodes = {1: node(1, "a1", "r1"), 2: node(2, "b1", "r2"), 3: node(3, "x1", None)}
    result = place(Inventory(nodes), req(within()), registry=registry)
    assert result.placement is None
    messages = [r.message for r in result.rejections]
    assert "node x1 does not say its rack, and profile 2x8xH100-80GB keeps a replica within one rack" in messages
    assert f"only 1 nodes of fabric ib-a ({IB})/rack=r1 can take a shard, needs 2" in messages
    [explained] = explain(Inventory(nodes), req(within()), registry=registry)
    assert {v.node_name: v.notes.get("rack") for v in explained.nodes} == {"a1": "r1", "b1": "r2", "x1": None}


def test_a_held_rack_is_left_out_of_a_kept_replica_too(registry: Registry) -> None:
    nodes = {i: node(i, f"n{i}", "r1" if i < 3 else "r2", held=i < 3) for i in range(1, 5)}
    result = place(Inventory(nodes), req(within()), registry=registry)
    assert result.placement is not None
    assert sorted(s.node_name for s in result.placement.shards) == ["n3", "n4"]
    [explained] = explain(Inventory(nodes), req(within()), registry=registry)
    refused = {v.node_name: [r.code for r in v.reasons] for v in explained.nodes}
    assert refused == {"n1": ["facility_held"], "n2": ["facility_held"], "n3": [], "n4": []}


@pytest.mark.django_db
def test_keep_within_is_declared_in_the_model_file_and_a_wrong_level_is_refused() -> None:
    from apps.catalog import services as catalog
    from apps.catalog.models import Profile
    from apps.cluster.inventory import profile_spec

    spec = {
        "name": "big",
        "source": "/models/big",
        "profiles": [
            {"name": "2x8", "engine": "vllm", "accelerator": "H100-80GB", "gpus_per_shard": 8, "nodes_per_replica": 2}
        ],
    }
    spec["profiles"][0]["keep_within"] = "rack"
    catalog.apply_models([spec], actor=None)
    profile = Profile.objects.get(model__name="big")
    assert profile.keep_within == "rack" and profile_spec(profile).extra["keep_within"] == "rack"
    spec["profiles"][0]["keep_within"] = "rak"
    with pytest.raises(catalog.SpecError) as refused:
        catalog.apply_models([spec], actor=None)
    assert "Expected one of site, room, row, rack, pdu; got “rak”." in str(refused.value.errors)
    assert Profile.objects.get(model__name="big").keep_within == "rack"  # nothing written
    # Left out: back to the default (anywhere), as every field a spec leaves out.
    del spec["profiles"][0]["keep_within"]
    catalog.apply_models([spec], actor=None)
    assert Profile.objects.get(model__name="big").keep_within == ""


def capped(node_id: int, name: str, rack: str, drawn: float) -> Any:
    snapshot = node(node_id, name, rack)
    snapshot.extra["facility"]["caps"] = {f"rack={rack}": 12000}
    snapshot.extra["facility"]["draw_w"] = drawn
    return snapshot


def test_a_replica_across_nodes_counts_whole_against_a_rack_cap(registry: Registry) -> None:
    # Rack r1 has 7.2 kW left of 12 kW: one 8 x H100 shard (5.6 kW) would fit, the replica (11.2 kW) does not.
    nodes = {1: capped(1, "a1", "r1", 2400.0), 2: capped(2, "a2", "r1", 2400.0)}
    nodes.update({3: capped(3, "b1", "r2", 0.0), 4: capped(4, "b2", "r2", 0.0)})
    result = place(Inventory(nodes), req(within()), registry=registry)
    assert result.placement is not None
    assert sorted(s.node_name for s in result.placement.shards) == ["b1", "b2"]
    [explained] = explain(Inventory(nodes), req(within()), registry=registry)
    a1 = next(v for v in explained.nodes if v.node_name == "a1")
    assert [r.message for r in a1.reasons] == ["rack=r1: 4.8 kW of 12.0 kW drawn, this replica adds 11.2 kW"]
