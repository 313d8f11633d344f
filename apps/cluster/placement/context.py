"""What a filter or scorer is told about the replica being placed."""

from __future__ import annotations

from typing import Any

from .model import Inventory, ProfileSpec, ReplicaRequest
from .registry import Registry


class PlacementContext:
    """One profile of one request, against one inventory.

    `gpu_class` is None for a CPU profile; `gpus`, `memory` and `cores` are what one shard
    claims on its node; `nodes` is how many nodes the replica spans (one shard per node).
    `shard` is the rank being placed for a single-node replica (0); for a multi-node replica
    the shards are chosen together and it is None. `scratch` is per-profile room for plugins
    to cache what they compute once (keyed by plugin name).
    """

    __slots__ = (
        "cores",
        "gpu_class",
        "gpus",
        "inventory",
        "memory",
        "multi_node",
        "nodes",
        "profile",
        "registry",
        "request",
        "scratch",
        "shard",
    )

    def __init__(self, inventory: Inventory, request: ReplicaRequest, profile: ProfileSpec, registry: Registry) -> None:
        self.inventory = inventory
        self.request = request
        self.profile = profile
        self.registry = registry
        self.gpu_class: str | None = None if profile.is_cpu else profile.accelerator
        self.gpus = profile.gpus_needed
        self.nodes = profile.nodes_needed
        self.memory = max(int(profile.memory_bytes), 0)
        self.cores = max(float(profile.cpu_cores), 0.0)
        self.multi_node = self.nodes > 1
        self.shard: int | None = None if self.multi_node else 0
        self.scratch: dict[str, Any] = {}
