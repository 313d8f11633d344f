"""Replicas across nodes placed by physical fabric, leaf and cable, through place() and explain()."""

from __future__ import annotations

from typing import Any

import pytest

from apps.cluster.placement import REGISTRY, Inventory, Registry, explain, place
from apps.fabrics import placement as fabric_plugins
from tests.placement.builders import gpu_node, gpu_profile, req

FABRIC_A = "ib:0x0002c90300000001"
FABRIC_B = "ib:0x0002c90300000099"


@pytest.fixture
def registry() -> Registry:
    registry = REGISTRY.copy()
    fabric_plugins.register(registry)
    return registry


def on(name: str = "ib-a", identity: str | None = FABRIC_A, **kw: Any) -> dict[str, Any]:
    return {"name": name, "kind": "ib", "identity": identity, "problem": "", "hcas": ["mlx5_0"], **kw}


def node(node_id: int, name: str, *attachments: dict[str, Any], free: int = 8) -> Any:
    claimed = {i: "busy" for i in range(8 - free)}
    return gpu_node(node_id, name, claimed=claimed, extra={"fabrics": list(attachments)})


def test_one_name_over_two_fabrics_is_two_groups_and_a_replica_takes_one(registry: Registry) -> None:
    # Four nodes all say "ib-a", but two see one subnet manager and two another: the emptiest pair
    # by score would be split across them, which would hang on the first collective.
    nodes = {
        1: node(1, "a1", on(identity=FABRIC_A), free=8),
        2: node(2, "a2", on(identity=FABRIC_A), free=4),
        3: node(3, "b1", on(identity=FABRIC_B), free=8),
        4: node(4, "b2", on(identity=FABRIC_B), free=2),
    }
    result = place(Inventory(nodes), req(gpu_profile(gpus=2, nodes=2)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == (FABRIC_A,)
    assert sorted(s.node_name for s in result.placement.shards) == ["a1", "a2"]


def test_two_names_of_one_fabric_form_one_group(registry: Registry) -> None:
    nodes = {1: node(1, "a", on("ib-a")), 2: node(2, "b", on("compute"))}
    result = place(Inventory(nodes), req(gpu_profile(gpus=8, nodes=2)), registry=registry)
    assert result.placement is not None and result.placement.group == (FABRIC_A,)


def test_nodes_that_cannot_say_are_kept_apart_from_those_that_can(registry: Registry) -> None:
    nodes = {
        1: node(1, "known", on(identity=FABRIC_A)),
        2: node(2, "unknown1", on(identity=None)),
        3: node(3, "unknown2", on(identity=None)),
    }
    inventory = Inventory(nodes)
    result = place(inventory, req(gpu_profile(gpus=8, nodes=2)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == ("unverified:ib-a",)
    assert sorted(s.node_name for s in result.placement.shards) == ["unknown1", "unknown2"]
    three = place(inventory, req(gpu_profile(gpus=8, nodes=3)), registry=registry)
    assert three.placement is None
    messages = [r.message for r in three.rejections if r.node_name is None]
    assert "only 1 nodes of fabric ib-a (" + FABRIC_A + ") can take a shard, needs 3" in messages
    assert "only 2 nodes of fabric ib-a (unverified) can take a shard, needs 3" in messages


def test_a_node_whose_adapters_sit_on_two_fabrics_is_refused_with_why(registry: Registry) -> None:
    split = on(problem="its adapters for ib-a see two subnet managers: mlx5_0 ib:0x01, mlx5_1 ib:0x02")
    nodes = {1: node(1, "split", split), 2: node(2, "ok", on()), 3: node(3, "ok2", on())}
    inventory = Inventory(nodes)
    result = place(inventory, req(gpu_profile(gpus=8, nodes=3)), registry=registry)
    assert result.placement is None
    [refusal] = [r for r in result.rejections if r.node_name == "split"]
    assert refusal.code == "fabric_split"
    assert "two subnet managers: mlx5_0 ib:0x01, mlx5_1 ib:0x02" in refusal.message
    [explained] = explain(inventory, req(gpu_profile(gpus=8, nodes=3)), registry=registry)
    verdict = next(v for v in explained.nodes if v.node_name == "split")
    assert [r.code for r in verdict.reasons] == ["fabric_split"]
    # A single-node replica does not care.
    assert place(inventory, req(gpu_profile(gpus=8)), registry=registry).placement is not None


def test_a_replica_takes_one_leaf_when_one_holds_it_whole(registry: Registry) -> None:
    # By score alone (the emptiest nodes) the replica would take n1 and n3, on two leaves.
    nodes = {
        1: node(1, "n1", on(leaf="0xL1", leaf_name="lf01"), free=8),
        2: node(2, "n2", on(leaf="0xL1", leaf_name="lf01"), free=2),
        3: node(3, "n3", on(leaf="0xL2", leaf_name="lf02"), free=8),
        4: node(4, "n4", on(leaf="0xL3", leaf_name="lf03"), free=2),
    }
    inventory = Inventory(nodes)
    result = place(inventory, req(gpu_profile(gpus=2, nodes=2)), registry=registry)
    assert result.placement is not None
    assert sorted(s.node_name for s in result.placement.shards) == ["n1", "n2"]
    assert result.placement.subgroup == "0xL1"
    # Three nodes fit in no leaf: the fabric's best three, across leaves.
    wide = place(inventory, req(gpu_profile(gpus=2, nodes=3)), registry=registry)
    assert wide.placement is not None and wide.placement.subgroup is None
    assert sorted(s.node_name for s in wide.placement.shards) == ["n1", "n2", "n3"]
    # explain names the fabric and leaf of every node it considered.
    [explained] = explain(inventory, req(gpu_profile(gpus=2, nodes=2)), registry=registry)
    assert {v.node_name: v.notes["leaf"] for v in explained.nodes} == {
        "n1": "lf01",
        "n2": "lf01",
        "n3": "lf02",
        "n4": "lf03",
    }
    assert all(v.notes["fabric"] == f"ib-a ({FABRIC_A})" for v in explained.nodes)


def test_a_node_whose_cable_trained_short_goes_last(registry: Registry) -> None:
    nodes = {
        1: node(1, "fast1", on()),
        2: node(2, "short", on(short=True)),
        3: node(3, "fast2", on(), free=4),
    }
    result = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2)), registry=registry)
    assert result.placement is not None
    assert sorted(s.node_name for s in result.placement.shards) == ["fast1", "fast2"]


def test_a_node_on_no_fabric_never_takes_a_shard(registry: Registry) -> None:
    nodes = {1: node(1, "a", on()), 2: gpu_node(2, "bare")}
    result = place(Inventory(nodes), req(gpu_profile(gpus=8, nodes=2)), registry=registry)
    assert result.placement is None
    [refusal] = [r for r in result.rejections if r.node_name == "bare"]
    assert refusal.message == "node bare is on no fabric, and a replica across 2 nodes needs one"
