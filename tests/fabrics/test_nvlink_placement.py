"""Replicas across nodes placed inside a multi-node NVLink domain first, InfiniBand the fallback.

Two simulated GB200 NVL72 racks (18 trays x 4 GPUs each) on one InfiniBand fabric, with trays
dropping out: a card not joined, IMEX down, a fabric manager restart taking every card at once.
"""

from __future__ import annotations

from typing import Any

import pytest

from apps.cluster.placement import REGISTRY, Inventory, Registry, explain, place
from apps.fabrics import placement as fabric_plugins
from tests.placement.builders import gpu_node, gpu_profile, req

GB200 = "GB200"
IB = "ib:0x0002c90300000001"
RACK_A = "3b4f1a2c-9d0e-4b7f-8a61-5c2d9e0f7a11.7"
RACK_B = "77aa0c1e-5b2d-4e8f-9c3a-1d2e3f4a5b6c.2"


@pytest.fixture
def registry() -> Registry:
    registry = REGISTRY.copy()
    fabric_plugins.register(registry)
    return registry


def tray(
    node_id: int,
    name: str,
    domain: str | None,
    *,
    ready: bool = True,
    problems: tuple[str, ...] = (),
    ib: bool = True,
    free: int = 4,
) -> Any:
    extra: dict[str, Any] = {}
    if ib:
        extra["fabrics"] = [{"name": "ib-a", "kind": "ib", "identity": IB, "problem": "", "hcas": ["mlx5_0"]}]
    if domain is not None:
        label = domain.split("-")[0] + "…/" + domain.rpartition(".")[2]
        extra["nvlink"] = {"domain": domain, "label": label, "ready": ready, "problems": list(problems)}
    claimed = {i: "busy" for i in range(4 - free)}
    return gpu_node(node_id, name, gpus=4, gpu_class=GB200, claimed=claimed, extra=extra)


def racks(out: dict[str, tuple[str, ...]] | None = None, **kw: Any) -> dict[int, Any]:
    """Two racks of 18 trays; `out`: tray name -> what keeps it out of its domain."""
    out = out or {}
    nodes = {}
    for rack, domain in enumerate((RACK_A, RACK_B)):
        for t in range(18):
            node_id = rack * 100 + t + 1
            name = f"{'ab'[rack]}{t + 1:02d}"
            problems = out.get(name, ())
            nodes[node_id] = tray(node_id, name, domain, ready=not problems, problems=problems, **kw)
    return nodes


def names(result: Any) -> list[str]:
    return sorted(s.node_name for s in result.placement.shards)


def test_a_replica_across_trays_is_formed_inside_one_domain(registry: Registry) -> None:
    result = place(Inventory(racks()), req(gpu_profile(gpus=4, nodes=16, gpu_class=GB200)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == ("nvlink:" + RACK_A,)
    assert all(n.startswith("a") for n in names(result))


def test_the_domain_wins_over_emptier_nodes_on_infiniband(registry: Registry) -> None:
    # Rack A's trays are half used, two IB-only nodes are empty: by score alone the replica would
    # take the empty ones; it stays inside the domain.
    nodes = {k: v for k, v in racks(free=2).items() if k < 100}
    nodes[900] = tray(900, "ib1", None)
    nodes[901] = tray(901, "ib2", None)
    result = place(Inventory(nodes), req(gpu_profile(gpus=2, nodes=2, gpu_class=GB200)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == ("nvlink:" + RACK_A,)
    assert "ib1" not in names(result) and "ib2" not in names(result)


def test_trays_out_of_their_domain_are_left_out_and_explain_says_why(registry: Registry) -> None:
    out = {f"a{t:02d}": ("GPU 2: fabric In Progress",) for t in range(1, 4)}
    out["a04"] = ("IMEX is WAITING_FOR_PEERS",)
    inventory = Inventory(racks(out))
    profile = gpu_profile(gpus=4, nodes=14, gpu_class=GB200)
    result = place(inventory, req(profile), registry=registry)
    assert result.placement is not None
    assert result.placement.group == ("nvlink:" + RACK_A,)
    assert not set(names(result)) & {"a01", "a02", "a03", "a04"}
    [explained] = explain(inventory, req(profile), registry=registry)
    notes = {v.node_name: v.notes.get("nvlink") for v in explained.nodes}
    assert notes["a05"] == "3b4f1a2c…/7"
    assert notes["a02"] == "3b4f1a2c…/7: GPU 2: fabric In Progress"
    assert notes["a04"] == "3b4f1a2c…/7: IMEX is WAITING_FOR_PEERS"


def test_fifteen_ready_trays_needed_and_fourteen_left_falls_back_to_infiniband(registry: Registry) -> None:
    # Rack A lost four trays and rack B five: neither holds 15 ready trays, the IB fabric does.
    out = {f"a{t:02d}": ("GPU 0: fabric unhealthy",) for t in range(1, 5)}
    out |= {f"b{t:02d}": ("no IMEX channel",) for t in range(1, 6)}
    result = place(Inventory(racks(out)), req(gpu_profile(gpus=4, nodes=15, gpu_class=GB200)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == (IB,)


def test_a_fabric_manager_restart_drops_a_whole_rack_to_infiniband(registry: Registry) -> None:
    out = {f"a{t:02d}": ("GPU 0: fabric In Progress", "GPU 1: fabric In Progress") for t in range(1, 19)}
    out |= {f"b{t:02d}": ("GPU 3: fabric In Progress",) for t in range(1, 19)}
    result = place(Inventory(racks(out)), req(gpu_profile(gpus=4, nodes=4, gpu_class=GB200)), registry=registry)
    assert result.placement is not None
    assert result.placement.group == (IB,)


def test_a_tray_out_of_its_domain_and_on_no_other_fabric_is_refused_with_the_reason(registry: Registry) -> None:
    nodes = {
        1: tray(1, "t1", RACK_A, ib=False),
        2: tray(2, "t2", RACK_A, ib=False),
        3: tray(3, "t3", RACK_A, ib=False, ready=False, problems=("IMEX is not installed",)),
    }
    result = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=3, gpu_class=GB200)), registry=registry)
    assert result.placement is None
    [refusal] = [r for r in result.rejections if r.node_name == "t3"]
    assert refusal.code == "nvlink_out"
    assert refusal.message == (
        "node t3 is kept out of NVLink domain 3b4f1a2c…/7 (IMEX is not installed) and is on no other fabric"
    )
    # Two trays still form a replica of two inside the domain, without InfiniBand.
    two = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=2, gpu_class=GB200)), registry=registry)
    assert two.placement is not None and two.placement.group == ("nvlink:" + RACK_A,)
    assert names(two) == ["t1", "t2"]


def test_a_replica_on_one_node_ignores_domains(registry: Registry) -> None:
    nodes = racks({"a01": ("GPU 0: fabric In Progress",)})
    result = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=1, gpu_class=GB200)), registry=registry)
    assert result.placement is not None and result.placement.group is None


def test_without_domains_placement_is_as_before(registry: Registry) -> None:
    # No node in a domain: no tier, the leaf and fabric choice of the fabrics plugin alone.
    nodes = {i: tray(i, f"n{i}", None) for i in range(1, 5)}
    result = place(Inventory(nodes), req(gpu_profile(gpus=4, nodes=3, gpu_class=GB200)), registry=registry)
    assert result.placement is not None and result.placement.group == (IB,)
