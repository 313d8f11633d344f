"""Which GPUs of a node a shard takes."""

from __future__ import annotations

from .model import GpuSlot, Inventory

__all__ = ["choose_gpus", "usable"]


def usable(inventory: Inventory, node_id: int, free: list[GpuSlot], limit: int | None = None) -> list[GpuSlot]:
    """Of the free devices, those one shard can hold together, lowest index first: no two of them
    a card and its slice, or slices sharing memory. With `limit`, the first that many only."""
    taken: list[GpuSlot] = []
    kept: set[int] = set()
    for slot in free:
        if limit is not None and len(taken) >= limit:
            break
        if kept.isdisjoint(inventory.related(node_id, slot.index)):
            taken.append(slot)
            kept.add(slot.index)
    return taken


def _apart(inventory: Inventory, node_id: int, free: list[GpuSlot], need: int) -> tuple[int, ...] | None:
    chosen = usable(inventory, node_id, free, need)
    return tuple(slot.index for slot in chosen) if len(chosen) >= need else None


def choose_gpus(inventory: Inventory, node_id: int, gpu_class: str, need: int) -> tuple[int, ...] | None:
    """`need` free healthy GPUs of the class, or None if the node has fewer.

    Where the NVLink topology is known, the shard stays inside one NVLink group when one has
    room, taking the group that fits with the fewest free cards left over so that big groups
    stay whole for big shards (ties: the group with the lowest index). Otherwise the lowest
    free indices.
    """
    if need <= 0:
        return ()
    free = inventory.free_gpus(node_id, gpu_class)
    if len(free) < need:
        return None
    if inventory.has_slices(node_id):
        return _apart(inventory, node_id, free, need)
    groups: dict[str, list[GpuSlot]] = {}
    for slot in free:
        if slot.nvlink_group is not None:
            groups.setdefault(slot.nvlink_group, []).append(slot)
    fitting = [(len(slots) - need, slots[0].index, key) for key, slots in groups.items() if len(slots) >= need]
    if fitting:
        key = min(fitting)[2]
        return tuple(slot.index for slot in groups[key][:need])
    return tuple(slot.index for slot in free[:need])
