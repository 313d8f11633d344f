"""Plugins from other apps: filters, scorers, checks and snapshot fields."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apps.cluster.placement import (
    REGISTRY,
    Inventory,
    NodeSnapshot,
    PlacementContext,
    Reason,
    Registry,
    explain,
    gettext_noop,
    place,
    register_filter,
    register_snapshot_field,
    snapshot_field,
)

from .builders import cpu_profile, gpu_node, gpu_profile, req


def held(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    domain = ctx.registry.snapshot_field(node, "facility.hold")
    if domain is None:
        return None
    return Reason(
        "held", gettext_noop("node %(node)s is in held domain %(domain)s"), {"node": node.name, "domain": domain}
    )


def rack_b(ctx: PlacementContext, node: NodeSnapshot) -> float:
    return 1.0 if node.labels.get("rack") == "b" else 0.0


@pytest.fixture
def registry() -> Registry:
    registry = REGISTRY.copy()
    registry.register_snapshot_field("facility.hold", None)
    registry.register_filter(held, name="facility.hold", order=25)
    return registry


def test_a_plugin_filter_refuses_and_explains(registry: Registry) -> None:
    nodes = {1: gpu_node(1, "a", extra={"facility.hold": "row-3"}), 2: gpu_node(2, "b")}
    inventory = Inventory(nodes)
    placement = place(inventory, req(gpu_profile()), registry=registry).placement
    assert placement is not None and placement.shards[0].node_name == "b"
    assert [r.message for r in placement.rejections] == ["node a is in held domain row-3"]
    [result] = explain(inventory, req(gpu_profile()), registry=registry)
    assert [r.message for v in result.nodes for r in v.reasons] == ["node a is in held domain row-3"]
    # The global registry is untouched.
    assert place(inventory, req(gpu_profile())).placement.shards[0].node_name == "a"  # type: ignore[union-attr]


def test_a_plugin_scorer_weighs_in(registry: Registry) -> None:
    nodes = {
        1: gpu_node(1, "a", labels={"rack": "a"}),
        2: gpu_node(2, "b", labels={"rack": "b"}),
        3: gpu_node(3, "c", labels={"rack": "a"}, claimed={0: "x"}),
    }
    inventory = Inventory(nodes)
    placement = place(inventory, req(gpu_profile()), registry=registry).placement
    assert placement is not None and placement.shards[0].node_name == "c"
    registry.register_scorer(rack_b, name="facility.rack", weight=0.5)
    # c's packing edge (1/7 against 1/8) is smaller than rack b's half point.
    placement = place(inventory, req(gpu_profile()), registry=registry).placement
    assert placement is not None and placement.shards[0].node_name == "b"
    registry.register_scorer(rack_b, name="facility.rack", weight=0.001)  # registering again replaces
    placement = place(inventory, req(gpu_profile()), registry=registry).placement
    assert placement is not None and placement.shards[0].node_name == "c"


def test_a_plugin_check(registry: Registry) -> None:
    def no_friday(ctx: PlacementContext) -> Iterator[Reason]:
        if ctx.request.model == "friday":
            yield Reason("freeze", gettext_noop("model %(model)s is frozen"), {"model": ctx.request.model})

    registry.register_check(no_friday, name="freeze", order=50)
    inventory = Inventory({1: gpu_node(1)})
    result = place(inventory, req(gpu_profile(), model="friday"), registry=registry)
    assert result.placement is None and [r.message for r in result.rejections] == ["model friday is frozen"]
    assert place(inventory, req(gpu_profile(), model="monday"), registry=registry).placement is not None


def test_unregister_and_bad_weights() -> None:
    registry = REGISTRY.copy()
    registry.unregister("engine")
    inventory = Inventory({1: gpu_node(1, engines=frozenset())})
    assert place(inventory, req(gpu_profile()), registry=registry).placement is not None
    assert place(inventory, req(gpu_profile())).placement is None
    with pytest.raises(ValueError, match="negative"):
        registry.register_scorer(rack_b, name="x", weight=-1)


def test_module_level_registration() -> None:
    register_snapshot_field("test.zone", "none")
    try:
        node = gpu_node(1)
        assert snapshot_field(node, "test.zone") == "none"
        node.extra["test.zone"] = "z1"
        assert snapshot_field(node, "test.zone") == "z1"
        register_filter(held, name="test.filter", order=99)
        assert "test.filter" in [e.name for e in REGISTRY.filters()]
    finally:
        REGISTRY.unregister("test.filter")
    assert "test.filter" not in [e.name for e in REGISTRY.filters()]
    assert [e.name for e in REGISTRY.filters()] == [
        "ready",
        "cordon",
        "node_selector",
        "gpu_class",
        "free_gpus",
        "memory",
        "cpu_cores",
        "engine",
        "engine_build",
        "weights",
    ]
    assert [e.name for e in REGISTRY.prefilters()] == ["fabric"]
    assert [e.name for e in REGISTRY.scorers()] == ["binpack", "weights", "spare_gpus"]
    assert [e.name for e in REGISTRY.checks()] == ["quota"]


def test_a_filter_that_does_not_apply_to_a_profile_is_never_called_for_it(registry: Registry) -> None:
    calls: list[str] = []

    def on_gpu_profiles_only(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
        calls.append(node.name)
        return Reason("gpu_only", gettext_noop("node %(node)s is refused"), {"node": node.name})

    registry.register_filter(
        on_gpu_profiles_only, name="facility.gpu_only", order=90, applies=lambda ctx: ctx.gpu_class is not None
    )
    inventory = Inventory({1: gpu_node(1, "a")})
    cpu = cpu_profile(2, memory_gb=1, cores=1)
    assert place(inventory, req(cpu), registry=registry).placement is not None
    [result] = explain(inventory, req(cpu), registry=registry)
    assert result.fits and calls == []
    # For a profile it applies to, it runs and refuses, in place and in explain alike.
    assert place(inventory, req(gpu_profile()), registry=registry).placement is None
    [result] = explain(inventory, req(gpu_profile()), registry=registry)
    assert [r.code for v in result.nodes for r in v.reasons] == ["gpu_only"]
    assert calls
