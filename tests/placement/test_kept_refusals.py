"""What placement keeps per snapshot to stay fast on a fleet with MIG slices: each node's devices
by class, the refusals of nodes the capacity index skips (kept by the node's free count), and a
slice's claim counted against its card. Each must follow the claims as they change."""

from __future__ import annotations

import pytest

from apps.cluster.placement import (
    REGISTRY,
    GpuSlot,
    Inventory,
    NodeSnapshot,
    PlacementConflict,
    PlacementContext,
    place,
)
from apps.cluster.placement.model import Claim
from apps.cluster.placement.reasons import Reason, gettext_noop
from tests.placement.builders import L40S, cpu_node, gpu_node, gpu_profile, req

H100 = "H100-80GB"
SLICE = "H100-80GB-1g.10gb"


def card_with_slices(node_id: int = 1) -> NodeSnapshot:
    """Card 0 whole (MIG off) but still listing two 1g.10gb slices, slices 1000 and 1001 sharing
    memory, and a plain card 1: a claim of either slice keeps card 0 and the other slice back."""
    return NodeSnapshot(
        id=node_id,
        name=f"h100-{node_id}",
        gpus=[
            GpuSlot(0, H100, label="GPU 0"),
            GpuSlot(1000, SLICE, kind="mig", parent=0, memory_group="0:gi0", share=1 / 7),
            GpuSlot(1001, SLICE, kind="mig", parent=0, memory_group="0:gi0", share=1 / 7),
            GpuSlot(1, H100, label="GPU 1"),
        ],
    )


def by_node(rejections: list, node: str) -> list[str]:  # type: ignore[type-arg]
    return [r.message for r in rejections if r.node_name == node]


def test_a_slice_then_its_card_in_one_run_the_card_is_refused() -> None:
    inventory = Inventory({1: card_with_slices()})
    one_slice = req(gpu_profile(gpu_class=SLICE), replica_id="s")
    first = place(inventory, one_slice)
    assert first.placement is not None and first.placement.shards[0].gpu_indices == (1000,)
    inventory.apply_request(first.placement, one_slice)
    # The sibling sharing its memory and the card are no longer free, in the index and the lists.
    assert [slot.index for slot in inventory.free_gpus(1)] == [1]
    assert place(inventory, req(gpu_profile(gpu_class=SLICE))).placement is None
    two_cards = place(inventory, req(gpu_profile(gpu_class=H100, gpus=2)))
    assert two_cards.placement is None
    assert by_node(two_cards.rejections, "h100-1") == ["node h100-1 has 1 free healthy H100-80GB GPUs, needs 2"]
    one_card = place(inventory, req(gpu_profile(gpu_class=H100)))
    assert one_card.placement is not None and one_card.placement.shards[0].gpu_indices == (1,)
    with pytest.raises(PlacementConflict, match="overlaps a device replica s claims"):
        inventory.add_claim(Claim("c", 0, 1, (0,)))
    # Once the slice is let go, the card is whole again, and both cards fit.
    inventory.release("s")
    again = place(inventory, req(gpu_profile(gpu_class=H100, gpus=2)))
    assert again.placement is not None and again.placement.shards[0].gpu_indices == (0, 1)


def test_a_card_claimed_first_keeps_its_slices_back_in_one_run() -> None:
    inventory = Inventory({1: card_with_slices()})
    card = req(gpu_profile(gpu_class=H100, gpus=2), replica_id="c")
    placed = place(inventory, card)
    assert placed.placement is not None
    inventory.apply_request(placed.placement, card)
    refused = place(inventory, req(gpu_profile(gpu_class=SLICE)))
    assert refused.placement is None
    assert by_node(refused.rejections, "h100-1") == ["node h100-1 has 0 free healthy H100-80GB-1g.10gb GPUs, needs 1"]
    inventory.release("c")
    assert place(inventory, req(gpu_profile(gpu_class=SLICE))).placement is not None


def test_a_kept_refusal_says_the_free_count_of_the_moment() -> None:
    nodes = {1: gpu_node(1, "a"), 2: gpu_node(2, "b", gpu_class=L40S), 3: cpu_node(3, "c")}
    inventory = Inventory(nodes, claims=[Claim("1", 0, 1, (0, 1))])
    eight = req(gpu_profile(gpus=8))
    refused = place(inventory, eight)
    assert refused.placement is None
    assert by_node(refused.rejections, "a") == ["node a has 6 free healthy H100-80GB GPUs, needs 8"]
    assert by_node(refused.rejections, "b") == ["node b has no H100-80GB GPUs (it has L40S-48GB)"]
    assert by_node(refused.rejections, "c") == ["node c has no H100-80GB GPUs (it has none)"]
    # A dry run's copy shares what is kept, and says its own count.
    trial = inventory.copy()
    trial.add_claim(Claim("2", 0, 1, (2, 3, 4)))
    assert by_node(place(trial, eight).rejections, "a") == ["node a has 3 free healthy H100-80GB GPUs, needs 8"]
    assert by_node(place(inventory, eight).rejections, "a") == ["node a has 6 free healthy H100-80GB GPUs, needs 8"]
    inventory.release("1")
    fits = place(inventory, eight)
    assert fits.placement is not None and fits.placement.node_ids == [1]


def test_refusals_are_not_kept_when_a_filter_reading_claims_comes_before_free_gpus() -> None:
    held: set[str] = {"a"}

    def hold(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
        if node.name not in held:
            return None
        return Reason("held", gettext_noop("node %(node)s is held"), {"node": node.name})

    registry = REGISTRY.copy()
    registry.register_filter(hold, name="test.hold", order=35)
    inventory = Inventory({1: gpu_node(1, "a", gpus=4), 2: gpu_node(2, "b", gpus=4)})
    eight = req(gpu_profile(gpus=8))
    first = place(inventory, eight, registry=registry)
    assert by_node(first.rejections, "a") == ["node a is held"]
    held.clear()
    second = place(inventory, eight, registry=registry)
    assert by_node(second.rejections, "a") == ["node a has 4 free healthy H100-80GB GPUs, needs 8"]
    # And one before gpu_class, for a node without the class.
    held.add("b")
    registry.register_filter(hold, name="test.hold", order=5)
    inventory = Inventory({1: gpu_node(1, "a", gpus=4), 2: gpu_node(2, "b", gpu_class=L40S)})
    assert by_node(place(inventory, eight, registry=registry).rejections, "b") == ["node b is held"]
    held.clear()
    assert by_node(place(inventory, eight, registry=registry).rejections, "b") == [
        "node b has no H100-80GB GPUs (it has L40S-48GB)"
    ]


def test_kept_refusals_are_dropped_when_they_outgrow_the_fleet(monkeypatch: pytest.MonkeyPatch) -> None:
    from apps.cluster.placement import pipeline

    monkeypatch.setattr(pipeline, "_KEPT_PER_NODE", 1)
    inventory = Inventory({1: gpu_node(1, "a")})
    eight = req(gpu_profile(gpus=8))
    for count in range(1, 6):  # a new count on every placement: more kept than the limit allows
        inventory.add_claim(Claim(str(count), 0, 1, (count,)))
        said = by_node(place(inventory, eight).rejections, "a")
        assert said == [f"node a has {8 - count} free healthy H100-80GB GPUs, needs 8"]
    kept = [value for key, value in inventory._memo.items() if key[0] == "short_refusals"]
    assert len(kept) == 1 and len(kept[0]) <= 2
