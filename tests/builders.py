"""Database builders for tests: one way to make a node, a model and a running replica.

    node = make_node("gpu1", gpus=8)                         # ready, heartbeating, 8 H100s
    node = make_node("l4-1", cards=[{"index": 0, "gpu_class": "L4", ...}])  # the sample's own GPU figures
    model = make_model("qwen", replicas=2, gpus=1)           # one vLLM profile on H100s
    model = make_model("small", memory_gb=2, cores=1)        # one llama.cpp CPU profile
    model = make_model("both", accelerators=(H100, "cpu"), gpus=1)  # a profile on each
    model = make_model("opt", external_url="https://api.example/v1")  # served by a provider
    replica = make_replica(model, node, state="ready")       # placed, with its rank-0 shard
    replica = make_replica(model, state="pending")           # not placed: no shard

Every field can be given (a node's status, labels, hardware; a model's class, limits, owner;
a replica's message); what is not given takes the value a real registration or apply would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.utils import timezone

from apps.catalog.models import Model, Profile
from apps.cluster import history, reports
from apps.cluster.choices import NodeStatus, ReplicaState, ShardState
from apps.cluster.models import Gpu, Node, Replica, Shard

__all__ = ["GB", "H100", "make_model", "make_node", "make_replica", "node_sample"]

GB = 1024**3
H100 = "H100-80GB"
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_MIB = 81559


def node_sample(*, gpus: int = 0, cpus: int = 64, memory_gb: float = 512) -> dict[str, Any]:
    """A heartbeat's sample as an agent sends it: its figures, and each GPU's."""
    return {
        "cpus": cpus,
        "cpu_utilization_pct": 12.5,
        "load": [1.5, 1.2, 1.0],
        "memory_total_bytes": int(memory_gb * GB),
        "memory_available_bytes": int(memory_gb * GB * 0.75),
        "memory_used_bytes": int(memory_gb * GB * 0.25),
        "gpus": [
            {
                "index": i,
                "gpu_class": H100,
                "utilization_gpu_pct": 50.0,
                "memory_total_mib": H100_MIB,
                "memory_used_mib": 1024,
                "temperature_gpu_c": 41,
                "power_draw_w": 120.5,
            }
            for i in range(gpus)
        ],
    }


def make_node(
    name: str = "gpu1",
    *,
    gpus: int = 0,
    gpu_class: str = H100,
    cpus: int = 64,
    memory_gb: float = 512,
    sample: bool | dict[str, Any] = True,
    sample_age: timedelta = timedelta(0),
    address: str = "10.0.0.1",
    engines: tuple[str, ...] = ("llama.cpp", "vllm"),
    cards: Sequence[dict[str, Any]] | None = None,
    heartbeat: bool = False,
    **fields: Any,
) -> Node:
    """A registered node whose agent heartbeats now (or `sample_age` ago), with `gpus` cards.

    `sample`: True for node_sample's figures, False for none yet, or a dict: the sample as sent.
    `cards`: each GPU's figures as the sample reports them (index, gpu_class, utilization_gpu_pct...),
    in place of node_sample's; the node has a card of that index and class for each (`gpus` follows).
    `heartbeat`: also do what a heartbeat does beyond the node's row: add the sample to the node's
    history (what the charts draw) and write its GPUs' health.
    """
    if cards is not None:
        gpus = len(cards)
    now = timezone.now()
    if isinstance(sample, dict):
        reading: dict[str, Any] | None = sample
    elif sample:
        reading = node_sample(gpus=gpus, cpus=cpus, memory_gb=memory_gb)
        if cards is not None:
            reading["gpus"] = [dict(card) for card in cards]
    else:
        reading = None
    values: dict[str, Any] = {
        "status": NodeStatus.READY,
        "agent_version": "0.1.0",
        "address": address,
        "registered_at": now,
        "last_seen_at": now - sample_age,
        "hardware": {
            "cpus": cpus,
            "memory_total_bytes": int(memory_gb * GB),
            "gpu_count": gpus,
            "engines": list(engines),
            "os": "Ubuntu 22.04.4 LTS",
            "kernel": "5.15.0-105-generic",
        },
        "sample": reading,
        "sampled_at": now - sample_age if reading is not None else None,
    }
    values.update(fields)
    node = Node.objects.create(name=name, **values)
    if cards is None:
        rows = [
            Gpu(node=node, index=i, gpu_class=gpu_class, name=H100_NAME, memory_total_mib=H100_MIB) for i in range(gpus)
        ]
    else:
        rows = [
            Gpu(
                node=node,
                index=card["index"],
                gpu_class=card.get("gpu_class", gpu_class),
                name=card.get("name", H100_NAME if card.get("gpu_class", gpu_class) == H100 else ""),
                memory_total_mib=card.get("memory_total_mib") or H100_MIB,
            )
            for card in cards
        ]
    Gpu.objects.bulk_create(rows)
    if heartbeat and node.sample is not None:
        history.append_histories({node.pk: node.sample})
        reports.write_gpu_health(node.pk, reports.sample_health(node.sample), None)
    return node


def make_model(
    name: str,
    *,
    replicas: int = 1,
    max_replicas: int | None = None,
    gpus: int = 0,
    memory_gb: float = 0,
    cores: float = 0,
    engine: str | None = None,
    accelerator: str | None = None,
    parallel: int = 4,
    capacity_class: str = "",
    source: str | None = None,
    profile: str = "default",
    accelerators: Sequence[str] = (),
    external_url: str = "",
    **fields: Any,
) -> Model:
    """A model with one profile: on `gpus` cards of `accelerator` (H100 by default), or on the CPU.

    `accelerators`: a profile on each of these instead, named after it in lower case ("h100-80gb",
    "cpu"); each GPU one on `gpus` cards (1 unless given), the CPU one on none.
    `external_url`: served by that outside provider (as `external_model`, "gpt-x" unless given):
    no profile and no replicas of its own.
    """
    if external_url:
        fields.setdefault("external_model", "gpt-x")
        return Model.objects.create(
            name=name,
            min_replicas=0,
            max_replicas=0,
            capacity_class=capacity_class,
            source=source or "",
            external_url=external_url,
            **fields,
        )
    model = Model.objects.create(
        name=name,
        min_replicas=replicas,
        max_replicas=max(max_replicas or replicas, 1),
        capacity_class=capacity_class,
        source=source or f"/models/{name}",
        **fields,
    )
    if accelerators:
        profiles = [(each.lower(), each, 0 if each == "cpu" else gpus or 1) for each in accelerators]
    else:
        profiles = [(profile, accelerator or (H100 if gpus else "cpu"), gpus)]
    for profile_name, on, cards in profiles:
        Profile.objects.create(
            model=model,
            name=profile_name,
            engine=engine or ("vllm" if cards else "llama.cpp"),
            accelerator=on,
            gpus_per_shard=cards,
            memory_bytes=int(memory_gb * GB),
            cpu_cores=cores,
            parallel=parallel,
        )
    return model


def make_replica(
    model: Model,
    node: Node | None = None,
    *,
    state: str = ReplicaState.READY,
    port: int | None = None,
    gpu_indices: tuple[int, ...] = (),
    secret: str = "s",
    profile: str | None = None,
    also_on: Sequence[Node] = (),
    **fields: Any,
) -> Replica:
    """A replica of the model placed on the node, with its rank-0 shard (ready when the replica is).

    Without a node it is not placed: no shard (a pending replica). `also_on`: the nodes of its further
    shards, rank 1, 2... (a replica spanning several nodes). `profile`: the name of the model's profile
    it runs (its first by priority unless given). `fields`: the replica's own (message, rejections...).
    """
    profiles = model.profiles.order_by("-priority", "name")
    chosen = profiles.get(name=profile) if profile is not None else profiles.first()
    ready = state == ReplicaState.READY
    values: dict[str, Any] = {
        "placed_at": timezone.now() if node is not None else None,
        "ready_at": timezone.now() if ready else None,
        **fields,
    }
    replica = Replica.objects.create(model=model, profile=chosen, state=state, **values)
    for rank, on in enumerate([node, *also_on] if node is not None else []):
        Shard.objects.create(
            replica=replica,
            rank=rank,
            node=on,
            port=port or 20000 + replica.pk,
            secret=secret,
            gpu_indices=list(gpu_indices),
            memory_bytes=chosen.memory_bytes if chosen else 0,
            cpu_cores=chosen.cpu_cores if chosen else 0,
            state=ShardState.READY if ready else ShardState.ASSIGNED,
        )
    return replica
