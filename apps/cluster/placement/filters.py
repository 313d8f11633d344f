"""Built-in filters (hard constraints on a node) and checks (on the whole replica).

Each returns the reason, with its numbers, or None. Registered on import.
"""

from __future__ import annotations

from collections.abc import Iterator

from . import reasons
from .context import PlacementContext
from .gpus import usable
from .model import CORE_EPSILON, Inventory, NodeSnapshot, PreFilterResult
from .reasons import Reason
from .registry import REGISTRY, Registry, SnapshotField

# The node's status as the cluster app reads it (an apps.cluster.choices.NodeStatus value: "ready",
# "unreachable", ...), put by apps.cluster.inventory and the simulator: named when the node is refused
# as not ready and its snapshot says no reason in words (`NodeSnapshot.status`).
NODE_STATUS: SnapshotField[str] = SnapshotField("status")


def ready(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    if node.ready:
        return None
    return reasons.not_ready(node.name, node.status or str(NODE_STATUS.get(node) or "unknown"))


def not_cordoned(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    if not node.cordoned:
        return None
    return reasons.cordoned(node.name, node.cordon_reason or "no reason given")


def _inside(path: str, directory: str) -> bool:
    return path.startswith(directory.rstrip("/") + "/")


def fetch_of(node: NodeSnapshot, source: str) -> tuple[str, str] | None:
    """What the node says of fetching the weights a source is in: (state, reason), or None."""
    return next((state for directory, state in node.fetches.items() if _inside(source, directory)), None)


def weights_on_node(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """A source the node refused or failed to fetch is not placed there, with the node's reason; a
    source inside a directory the node reports its weights for must be held there whole: an engine
    started on a file that is not there (or half there) fails, the node having said so."""
    source = ctx.request.source
    if source in node.weights:
        return None
    fetch = fetch_of(node, source) if node.fetches else None
    if fetch is not None and fetch[0] == "refused":
        return reasons.weights_refused(node.name, source, fetch[1])
    if fetch is not None and fetch[0] == "failed":
        return reasons.weights_failed(node.name, source, fetch[1])
    partial = node.partial_dirs
    if any(_inside(source, directory) for directory in node.weight_dirs or () if directory not in partial):
        if fetch is not None and fetch[0] == "fetching":
            return reasons.weights_fetching(node.name, source, fetch[1])
        return reasons.source_missing(node.name, source)
    return None


def weights_can_arrive(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """For a source the node has yet to be told to fetch (a model about to be declared from the
    mirror): refused where the node already refused or failed it, or where it reports the
    directories it keeps models in and the source is inside none of them (its agent would refuse
    the fetch). A node that reports none stays usable."""
    source = ctx.request.source
    if source in node.weights:
        return None
    fetch = fetch_of(node, source) if node.fetches else None
    if fetch is not None and fetch[0] in ("refused", "failed"):
        return weights_on_node(ctx, node)
    dirs = node.weight_dirs
    if dirs and not any(_inside(source, directory) for directory in dirs):
        return reasons.weights_outside(node.name, source, reasons.listing(dirs))
    return None


def _local_source(ctx: PlacementContext) -> bool:
    return ctx.request.source.startswith("/")


def node_selector(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    selector = ctx.profile.node_selector
    if not selector:
        return None
    labels = node.labels
    for key in sorted(selector):
        if labels.get(key) != selector[key]:
            return reasons.missing_label(node.name, key, selector[key], labels.get(key))
    return None


def gpu_class(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """Only GPUs of the profile's class are ever considered; a CPU profile needs none."""
    cls = ctx.gpu_class
    if cls is None:
        return None
    inventory = ctx.inventory
    classes = inventory.gpu_classes(node.id)
    if cls in classes:
        return None
    # The same for every placement on this snapshot: kept, as a profile that fits nowhere refuses
    # every node without its class again.
    return inventory.memo(  # type: ignore[no-any-return]
        ("gpu_class", node.id, cls), lambda: reasons.no_gpu_class(node.name, cls, classes)
    )


def free_gpus(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """Enough healthy, unclaimed GPUs of the class (a node without the class is gpu_class's refusal).

    A card split into slices is never counted (its slices are, as their own classes), nor a slice
    whose card, or a slice sharing its memory, is claimed; one shard takes one MIG slice at most
    (a CUDA process uses one MIG device), and never two slices that share memory."""
    cls = ctx.gpu_class
    need = ctx.gpus
    if cls is None or not need:
        return None
    inventory = ctx.inventory
    if cls not in inventory.gpu_classes(node.id):
        return None
    free = inventory.free_count(node.id, cls)
    if free >= need:
        # One free device is always one a shard can hold (nothing of its own claim to overlap).
        if need == 1 or not inventory.has_slices(node.id):
            return None
        return _slices_fit(ctx, node, cls, free, need)
    # Follows from the node and the two numbers alone: kept for the next profile refused there.
    return inventory.memo(  # type: ignore[no-any-return]
        ("free_gpus", node.id, cls, free, need), lambda: _too_few(inventory, node, cls, free, need)
    )


def _slices_fit(ctx: PlacementContext, node: NodeSnapshot, cls: str, free: int, need: int) -> Reason | None:
    inventory = ctx.inventory
    slots = inventory.free_gpus(node.id, cls)
    if need > 1 and any(slot.kind == "mig" for slot in slots):
        return reasons.mig_one_per_process(node.name, cls, need)
    together = len(usable(inventory, node.id, slots, need))
    return None if together >= need else reasons.gpus_overlap(node.name, cls, free, together, need)


def _too_few(inventory: Inventory, node: NodeSnapshot, cls: str, free: int, need: int) -> Reason:
    devices = inventory.class_devices(node.id, cls)  # what does not change with claims, worked out once
    untrusted = devices.untrusted
    if untrusted is not None and untrusted.fault:
        return reasons.gpus_untrusted(node.name, cls, free, need, untrusted.name, untrusted.fault)
    if devices.split:
        return reasons.gpus_split(node.name, cls, free, need, devices.split, devices.slices)
    return reasons.too_few_gpus(node.name, cls, free, need, devices.total, devices.unhealthy)


#: What each engine build drives, by the start of its key (the agent's install manifest): a CPU
#: build none, a CUDA build NVIDIA cards and MIG slices, a Vulkan build whole cards of either
#: vendor (it sees no MIG slice or compute partition), a ROCm build AMD cards and partitions.
_NVIDIA = frozenset({("nvidia", "gpu"), ("nvidia", "mig")})
_AMD = frozenset({("amd", "gpu"), ("amd", "partition")})
BUILD_DRIVES: tuple[tuple[str, frozenset[tuple[str, str]]], ...] = (
    ("cpu-", frozenset()),
    ("source-", frozenset()),
    ("cuda-", _NVIDIA),
    ("cu", _NVIDIA),
    ("vulkan-", frozenset({("nvidia", "gpu"), ("amd", "gpu")})),
    ("rocm", _AMD),
    ("hip-", _AMD),
)
_DEVICE_WORDS = {
    ("nvidia", "gpu"): "NVIDIA",
    ("nvidia", "mig"): "NVIDIA MIG",
    ("amd", "gpu"): "AMD",
    ("amd", "partition"): "AMD XCP",
}


def build_drives(build: str) -> frozenset[tuple[str, str]] | None:
    """(vendor, kind) of the devices an engine build drives; None for a build llmgw does not know."""
    return next((drives for prefix, drives in BUILD_DRIVES if build.startswith(prefix)), None)


def engine_build(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """The node's build of the profile's engine must drive the class's devices: an AMD card is never
    given to a CPU or CUDA build, a MIG slice never to a Vulkan one. A build the node does not
    name (an engine named in agent.yaml) is the operator's word and is not refused."""
    cls = ctx.gpu_class
    build = node.engine_builds.get(ctx.profile.engine) if cls is not None and node.engine_builds else None
    if cls is None or build is None:
        return None
    drives = build_drives(build)
    if drives is None:
        return None
    kinds = {(g.vendor, g.kind) for g in node.gpus if g.gpu_class == cls}
    missing = kinds - drives
    if not missing:
        return None
    words = reasons.listing(_DEVICE_WORDS.get(kind, f"{kind[0]} {kind[1]}") for kind in missing)
    return reasons.engine_cannot_drive(node.name, ctx.profile.engine, build, cls, words)


def memory(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """The claim against the node's total less what it already owes; 0 claims nothing, and a node
    that reports no memory stays usable."""
    need = ctx.memory
    total = node.memory_total_bytes
    if not need or total is None:
        return None
    claimed = ctx.inventory.memory_claimed(node.id)
    if claimed + need <= total:
        return None
    return reasons.too_little_memory(node.name, max(total - claimed, 0), total, need)


def cpu_cores(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """Cores reserved out of the node's CPUs, as memory is; a node that reports no CPUs stays usable."""
    need = ctx.cores
    cpus = node.cpus
    if not need or cpus is None:
        return None
    claimed = ctx.inventory.cores_claimed(node.id)
    if claimed + need <= cpus + CORE_EPSILON:
        return None
    return reasons.too_few_cores(node.name, max(cpus - claimed, 0.0), cpus, need)


def engine(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    engines = node.engines
    if engines is None or ctx.profile.engine in engines:
        return None
    status = node.engine_status.get(ctx.profile.engine)
    if status:
        return reasons.engine_not_yet(node.name, ctx.profile.engine, status)
    return reasons.no_engine(node.name, ctx.profile.engine, engines)


def fabric_index(inventory: Inventory) -> dict[int, tuple[str, ...]]:
    """Node id -> the fabric it is on, for the nodes on one."""
    return {node_id: (node.fabric,) for node_id, node in inventory.nodes.items() if node.fabric is not None}


def fabric(ctx: PlacementContext, index: dict[int, tuple[str, ...]]) -> PreFilterResult:
    """A replica across nodes is formed on one fabric, so a node on none cannot take a shard of one.
    The fabrics app replaces this (same name) with the physical fabrics its agents report."""
    need = ctx.nodes
    return PreFilterResult(groups=index, refuse=lambda node: reasons.no_fabric(node.name, need))


def quota(ctx: PlacementContext) -> Iterator[Reason]:
    """Every owner key the replica counts against must have room for the whole replica. A slice
    counts by its share of its card: a 1g.10gb of an H100 is 1/7 of a GPU."""
    inventory = ctx.inventory
    n = ctx.nodes
    cores, mem = ctx.cores * n, ctx.memory * n
    gpus = float(ctx.gpus * n)
    if gpus and ctx.gpu_class is not None:
        gpus = round(gpus * inventory.class_share(ctx.gpu_class), 9)
    for key in ctx.request.owner:
        limit = inventory.quotas.get(key)
        if limit is None:
            continue
        used = inventory.usage(key)
        if limit.gpus is not None and gpus and used.gpus + gpus > limit.gpus + CORE_EPSILON:
            yield reasons.quota_gpus(key, used.gpus, limit.gpus, gpus)
        if limit.cpu_cores is not None and cores and used.cores + cores > limit.cpu_cores + CORE_EPSILON:
            yield reasons.quota_cores(key, used.cores, limit.cpu_cores, cores)
        if limit.memory_bytes is not None and mem and used.memory + mem > limit.memory_bytes:
            yield reasons.quota_memory(key, used.memory, limit.memory_bytes, mem)
        if limit.replicas is not None and used.replicas + 1 > limit.replicas:
            yield reasons.quota_replicas(key, used.replicas, limit.replicas)


def register(registry: Registry) -> None:
    """Register the built-ins on a registry (done for REGISTRY on import)."""
    registry.register_filter(ready, name="ready", order=10)
    registry.register_filter(not_cordoned, name="cordon", order=11)
    registry.register_filter(
        node_selector, name="node_selector", order=20, applies=lambda ctx: bool(ctx.profile.node_selector)
    )
    registry.register_filter(gpu_class, name="gpu_class", order=30, applies=lambda ctx: ctx.gpu_class is not None)
    registry.register_filter(
        free_gpus, name="free_gpus", order=40, applies=lambda ctx: ctx.gpu_class is not None and ctx.gpus > 0
    )
    registry.register_filter(memory, name="memory", order=50, applies=lambda ctx: ctx.memory > 0)
    registry.register_filter(cpu_cores, name="cpu_cores", order=60, applies=lambda ctx: ctx.cores > 0)
    registry.register_filter(engine, name="engine", order=70)
    registry.register_filter(engine_build, name="engine_build", order=71, applies=lambda ctx: ctx.gpu_class is not None)
    registry.register_filter(weights_on_node, name="weights", order=75, applies=_local_source)
    registry.register_prefilter(
        fabric, name="fabric", order=80, index=fabric_index, applies=lambda ctx: ctx.multi_node, static=True
    )
    registry.register_check(quota, name="quota", order=10)


register(REGISTRY)
