"""Small builders for placement tests."""

from __future__ import annotations

from typing import Any

from apps.cluster.placement import GpuSlot, NodeSnapshot, ProfileSpec, ReplicaRequest

GIB = 1024**3
H100 = "H100-80GB"
A100 = "A100-80GB"
L40S = "L40S-48GB"


def gpu_node(
    node_id: int,
    name: str | None = None,
    *,
    gpus: int = 8,
    gpu_class: str = H100,
    groups: list[str | None] | None = None,
    unhealthy: tuple[int, ...] = (),
    claimed: dict[int, str] | None = None,
    memory_gb: float | None = None,
    cpus: int | None = None,
    **kw: Any,
) -> NodeSnapshot:
    claimed = claimed or {}
    slots = [
        GpuSlot(
            i,
            gpu_class,
            healthy=i not in unhealthy,
            claimed_by=claimed.get(i),
            nvlink_group=groups[i] if groups else None,
        )
        for i in range(gpus)
    ]
    memory = None if memory_gb is None else int(memory_gb * GIB)
    return NodeSnapshot(
        id=node_id, name=name or f"gpu-{node_id}", gpus=slots, memory_total_bytes=memory, cpus=cpus, **kw
    )


def cpu_node(
    node_id: int, name: str | None = None, *, memory_gb: float | None = 64, cpus: int | None = 16, **kw: Any
) -> NodeSnapshot:
    memory = None if memory_gb is None else int(memory_gb * GIB)
    return NodeSnapshot(id=node_id, name=name or f"cpu-{node_id}", memory_total_bytes=memory, cpus=cpus, **kw)


def gpu_profile(
    pid: int = 1,
    *,
    gpus: int = 1,
    gpu_class: str = H100,
    nodes: int = 1,
    priority: int = 0,
    memory_gb: float = 0,
    cores: float = 0,
    engine: str = "vllm",
    name: str | None = None,
    selector: dict[str, str] | None = None,
) -> ProfileSpec:
    return ProfileSpec(
        id=pid,
        name=name or f"{nodes}x{gpus}x{gpu_class}",
        priority=priority,
        engine=engine,
        accelerator=gpu_class,
        gpus_per_shard=gpus,
        nodes_per_replica=nodes,
        memory_bytes=int(memory_gb * GIB),
        cpu_cores=cores,
        node_selector=selector or {},
    )


def cpu_profile(
    pid: int = 1,
    *,
    memory_gb: float = 0,
    cores: float = 0,
    priority: int = 0,
    nodes: int = 1,
    engine: str = "llama.cpp",
    name: str = "cpu",
    selector: dict[str, str] | None = None,
) -> ProfileSpec:
    return ProfileSpec(
        id=pid,
        name=name,
        priority=priority,
        engine=engine,
        accelerator="cpu",
        nodes_per_replica=nodes,
        memory_bytes=int(memory_gb * GIB),
        cpu_cores=cores,
        node_selector=selector or {},
    )


def req(
    *profiles: ProfileSpec,
    model: str = "m",
    owner: tuple[str, ...] = (),
    capacity_class: str = "standard",
    replica_id: str = "r",
) -> ReplicaRequest:
    # The weights of model "m" are its source "m" here: nodes built with weights={"m"} hold them.
    return ReplicaRequest(
        model=model,
        profiles=list(profiles),
        owner=owner,
        capacity_class=capacity_class,
        source=model,
        replica_id=replica_id,
    )
