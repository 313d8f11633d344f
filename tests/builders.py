"""Database builders for tests: one way to make a node, a model and a running replica.

    node = make_node("gpu1", gpus=8)                         # ready, heartbeating, 8 H100s
    model = make_model("qwen", replicas=2, gpus=1)           # one vLLM profile on H100s
    model = make_model("small", memory_gb=2, cores=1)        # one llama.cpp CPU profile
    replica = make_replica(model, node, state="ready")       # placed, with its rank-0 shard

Every field can be given (a node's status, labels, hardware; a model's class, limits, owner);
what is not given takes the value a real registration or apply would give.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone

from apps.catalog.models import Model, Profile
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState
from apps.cluster.models import Gpu, Node, Replica, Shard

__all__ = ["GB", "H100", "make_model", "make_node", "make_replica", "node_sample"]

GB = 1024**3
H100 = "H100-80GB"


def node_sample(*, gpus: int = 0, cpus: int = 64, memory_gb: float = 512) -> dict[str, Any]:
    """A heartbeat's sample as an agent sends it: its figures, and each GPU's."""
    return {
        "cpus": cpus, "cpu_utilization_pct": 12.5, "load": [1.5, 1.2, 1.0],
        "memory_total_bytes": int(memory_gb * GB), "memory_available_bytes": int(memory_gb * GB * 0.75),
        "memory_used_bytes": int(memory_gb * GB * 0.25),
        "gpus": [{"index": i, "gpu_class": H100, "utilization_gpu_pct": 50.0, "memory_total_mib": 81559,
                  "memory_used_mib": 1024, "temperature_gpu_c": 41, "power_draw_w": 120.5} for i in range(gpus)],
    }


def make_node(name: str = "gpu1", *, gpus: int = 0, gpu_class: str = H100, cpus: int = 64, memory_gb: float = 512,
              sample: bool = True, sample_age: timedelta = timedelta(0), address: str = "10.0.0.1",
              engines: tuple[str, ...] = ("llama.cpp", "vllm"), **fields: Any) -> Node:
    """A registered node whose agent heartbeats now (or `sample_age` ago), with `gpus` cards."""
    now = timezone.now()
    values: dict[str, Any] = {
        "status": NodeStatus.READY, "agent_version": "0.1.0", "address": address, "registered_at": now,
        "last_seen_at": now - sample_age,
        "hardware": {"cpus": cpus, "memory_total_bytes": int(memory_gb * GB), "gpu_count": gpus,
                     "engines": list(engines), "os": "Ubuntu 22.04.4 LTS", "kernel": "5.15.0-105-generic"},
        "sample": node_sample(gpus=gpus, cpus=cpus, memory_gb=memory_gb) if sample else None,
        "sampled_at": now - sample_age if sample else None,
    }
    values.update(fields)
    node = Node.objects.create(name=name, **values)
    Gpu.objects.bulk_create([Gpu(node=node, index=i, gpu_class=gpu_class, name="NVIDIA H100 80GB HBM3",
                                 memory_total_mib=81559) for i in range(gpus)])
    return node


def make_model(name: str, *, replicas: int = 1, max_replicas: int | None = None, gpus: int = 0, memory_gb: float = 0,
               cores: float = 0, engine: str | None = None, accelerator: str | None = None, parallel: int = 4,
               capacity_class: str = "", source: str | None = None, profile: str = "default",
               **fields: Any) -> Model:
    """A model with one profile: on `gpus` cards of `accelerator` (H100 by default), or on the CPU."""
    model = Model.objects.create(name=name, min_replicas=replicas, max_replicas=max(max_replicas or replicas, 1),
                                 capacity_class=capacity_class, source=source or f"/models/{name}", **fields)
    accelerator = accelerator or (H100 if gpus else "cpu")
    Profile.objects.create(model=model, name=profile, engine=engine or ("vllm" if gpus else "llama.cpp"),
                           accelerator=accelerator, gpus_per_shard=gpus, memory_bytes=int(memory_gb * GB),
                           cpu_cores=cores, parallel=parallel)
    return model


def make_replica(model: Model, node: Node, *, state: str = ReplicaState.READY, port: int | None = None,
                 gpu_indices: tuple[int, ...] = (), secret: str = "s") -> Replica:
    """A replica of the model placed on the node, with its rank-0 shard (ready when the replica is)."""
    profile = model.profiles.order_by("-priority", "name").first()
    replica = Replica.objects.create(model=model, profile=profile, state=state, placed_at=timezone.now(),
                                     ready_at=timezone.now() if state == ReplicaState.READY else None)
    Shard.objects.create(replica=replica, node=node, port=port or 20000 + replica.pk, secret=secret,
                         gpu_indices=list(gpu_indices), memory_bytes=profile.memory_bytes if profile else 0,
                         cpu_cores=profile.cpu_cores if profile else 0,
                         state=ShardState.READY if state == ReplicaState.READY else ShardState.ASSIGNED)
    return replica
