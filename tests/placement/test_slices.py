"""MIG slices and AMD compute partitions as devices of their own: placed by their class, never
overlapping a claim of their card (or a slice sharing their memory), a split card never offered
whole, an untrusted one never used, and an engine build that cannot drive them refused."""

from __future__ import annotations

import pytest

from apps.cluster.placement import GpuSlot, Inventory, NodeSnapshot, PlacementConflict, explain, place
from apps.cluster.placement.model import Claim
from tests.placement.builders import gpu_profile, req

H100 = "H100-80GB"
SLICE = "H100-80GB-1g.10gb"
BIG = "H100-80GB-3g.40gb"


def mig_node(
    node_id: int = 1, *, split: bool = True, fault: str | None = None, engine_builds: dict[str, str] | None = None
) -> NodeSnapshot:
    """An H100 in MIG mode as the H100 capture has it (3g.40gb, 2g.20gb, two 1g.10gb) and a whole one."""
    slots = [GpuSlot(0, H100, split=split, label="GPU 0", fault=fault, healthy=fault is None)]
    for number, profile in enumerate(("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")):
        slots.append(
            GpuSlot(
                1000 + number,
                f"{H100}-{profile}",
                kind="mig",
                parent=0,
                memory_group=f"0:gi{number}",
                label=f"GPU 0 MIG {number} ({profile})",
                fault=fault,
                healthy=fault is None,
            )
        )
    slots.append(GpuSlot(1, H100, label="GPU 1"))
    return NodeSnapshot(id=node_id, name=f"mig-{node_id}", gpus=slots, engine_builds=engine_builds or {})


def test_a_slice_profile_is_placed_on_a_slice_and_the_card_is_never_given_whole() -> None:
    inventory = Inventory({1: mig_node()})
    result = place(inventory, req(gpu_profile(gpu_class=SLICE)))
    assert result.placement is not None and result.placement.shards[0].gpu_indices == (1002,)
    inventory.apply_request(result.placement, req(gpu_profile(gpu_class=SLICE)), "r1")
    second = place(inventory, req(gpu_profile(gpu_class=SLICE)))
    assert second.placement is not None and second.placement.shards[0].gpu_indices == (1003,)
    # The whole-card class finds GPU 1 only: GPU 0 is split.
    whole = place(inventory, req(gpu_profile(gpu_class=H100, gpus=2)))
    assert whole.placement is None
    assert "1 of them are split into slices, which are placed as their own classes (H100-80GB-1g.10gb, " in (
        whole.rejections[0].message
    )


def test_a_claim_of_a_slice_never_overlaps_a_claim_of_its_card() -> None:
    # The card is whole now (MIG turned off) while a replica placed on one of its slices still runs:
    # the card is not handed out until that replica stops.
    node = NodeSnapshot(id=1, name="n", gpus=[GpuSlot(0, H100, label="GPU 0")])
    inventory = Inventory({1: node}, claims=[Claim("7", 0, 1, (1002,))])
    assert inventory.free_count(1, H100) == 0
    result = place(inventory, req(gpu_profile(gpu_class=H100)))
    assert result.placement is None
    with pytest.raises(PlacementConflict, match="overlaps a device replica 7 claims"):
        inventory.add_claim(Claim("8", 0, 1, (0,)))
    inventory.release("7")
    assert inventory.free_count(1, H100) == 1
    # And the other way: a replica on the whole card keeps every slice of it from being handed out.
    split = Inventory({1: mig_node(split=False)}, claims=[Claim("9", 0, 1, (0,))])
    assert split.free_count(1, SLICE) == 0 and split.free_count(1, BIG) == 0
    assert place(split, req(gpu_profile(gpu_class=SLICE))).placement is None
    split.release("9")
    assert split.free_count(1, SLICE) == 2


def test_slices_sharing_memory_are_held_one_at_a_time() -> None:
    node = NodeSnapshot(
        id=1,
        name="h200",
        gpus=[
            GpuSlot(0, "H200-141GB", split=True),
            GpuSlot(1000, "H200-141GB-1c.3g.71gb", kind="mig", parent=0, memory_group="0:gi2"),
            GpuSlot(1001, "H200-141GB-2c.3g.71gb", kind="mig", parent=0, memory_group="0:gi2"),
        ],
    )
    inventory = Inventory({1: node})
    first = place(inventory, req(gpu_profile(gpu_class="H200-141GB-1c.3g.71gb")))
    assert first.placement is not None
    inventory.apply_request(first.placement, req(gpu_profile(gpu_class="H200-141GB-1c.3g.71gb")), "r1")
    assert inventory.free_count(1, "H200-141GB-2c.3g.71gb") == 0


def test_partitions_of_one_memory_partition_are_not_taken_together_by_one_shard() -> None:
    slots = [GpuSlot(0, "MI300X-192GB", vendor="amd", split=True)]
    slots += [
        GpuSlot(
            1000 + i, "MI300X-192GB-cpx.nps4", vendor="amd", kind="partition", parent=0, memory_group=f"0:mem{i // 2}"
        )
        for i in range(8)
    ]
    inventory = Inventory({1: NodeSnapshot(id=1, name="mi300x", gpus=slots)})
    four = place(inventory, req(gpu_profile(gpu_class="MI300X-192GB-cpx.nps4", gpus=4)))
    assert four.placement is not None and four.placement.shards[0].gpu_indices == (1000, 1002, 1004, 1006)
    five = place(inventory, req(gpu_profile(gpu_class="MI300X-192GB-cpx.nps4", gpus=5)))
    assert five.placement is None
    assert "8 free MI300X-192GB-cpx.nps4 slices and 4 of them can be held together" in five.rejections[0].message


def test_one_shard_takes_one_mig_slice_at_most() -> None:
    inventory = Inventory({1: mig_node()})
    result = place(inventory, req(gpu_profile(gpu_class=SLICE, gpus=2)))
    assert result.placement is None
    assert "a CUDA process uses one MIG device, so a shard cannot take 2" in result.rejections[0].message


def test_an_untrusted_layout_is_never_placed_on_and_says_why() -> None:
    inventory = Inventory({1: mig_node(fault="nvidia-smi -L lists 3 MIG device(s) on GPU 0, -q describes 4")})
    result = place(inventory, req(gpu_profile(gpu_class=SLICE)))
    assert result.placement is None
    assert "GPU 0 MIG 2 (1g.10gb) cannot be trusted now: nvidia-smi -L lists 3" in result.rejections[0].message


def test_an_engine_build_that_cannot_drive_the_devices_is_refused_with_the_build() -> None:
    amd = NodeSnapshot(
        id=2, name="mi300x", gpus=[GpuSlot(0, "MI300X-192GB", vendor="amd")], engine_builds={"llama.cpp": "cpu-x64"}
    )
    inventory = Inventory({1: mig_node(engine_builds={"llama.cpp": "vulkan-x64"}), 2: amd})
    profile = gpu_profile(gpu_class="MI300X-192GB", engine="llama.cpp")
    result = place(inventory, req(profile))
    assert result.placement is None
    message = next(r.message for r in result.rejections if r.node_name == "mi300x")
    assert message == "node mi300x runs the cpu-x64 build of llama.cpp, which cannot drive MI300X-192GB (AMD)"
    mig = place(inventory, req(gpu_profile(gpu_class=SLICE, engine="llama.cpp")))
    assert "runs the vulkan-x64 build of llama.cpp, which cannot drive H100-80GB-1g.10gb (NVIDIA MIG)" in (
        mig.rejections[0].message
    )
    rocm = NodeSnapshot(
        id=2,
        name="mi300x",
        gpus=[GpuSlot(0, "MI300X-192GB", vendor="amd")],
        engine_builds={"llama.cpp": "rocm-7.2-x64"},
    )
    assert place(Inventory({2: rocm}), req(profile)).placement is not None


def test_explain_names_the_slices_a_node_refuses_or_takes() -> None:
    inventory = Inventory(
        {1: mig_node(), 2: mig_node(2)}, claims=[Claim("5", 0, 1, (1002,)), Claim("6", 0, 1, (1003,))]
    )
    (verdict,) = explain(inventory, req(gpu_profile(gpu_class=SLICE)))
    assert verdict.fits and [n.node_name for n in verdict.nodes if n.fits] == ["mig-2"]
    refused = next(n for n in verdict.nodes if not n.fits)
    assert refused.reasons[0].message == "node mig-1 has 0 free healthy H100-80GB-1g.10gb GPUs, needs 1"
    assert verdict.placement is not None and verdict.placement.shards[0].gpu_indices == (1002,)
