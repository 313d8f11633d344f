"""The placement snapshot and its results, as plain dataclasses (no Django).

Nodes and their GPU slots are read-only once an `Inventory` holds them: placing, applying
and releasing change only the inventory's claims and its indexes, which is why
`Inventory.copy()` can share the node objects and stay cheap.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from agent.probes.mig import slice_parent

if TYPE_CHECKING:
    from .reasons import Reason

CPU = "cpu"
# Cores are fractional and summed; a claim this close to the limit still fits.
CORE_EPSILON = 1e-9


@dataclass(slots=True)
class GpuSlot:
    """One device of a node: a whole card, or a slice of one (a MIG device, an AMD compute
    partition). A claim of a slice and a claim of its card never overlap: the inventory keeps a
    slot whose card or slice (or memory-sharing sibling) is claimed from being handed out."""

    index: int
    gpu_class: str
    healthy: bool = True
    # Something outside the claims list holds it (a replica id, or another process).
    claimed_by: str | None = None
    # Cards sharing an NVLink/NVSwitch (or XGMI) domain inside the node share an id; None = unknown.
    nvlink_group: str | None = None
    vendor: str = "nvidia"
    kind: str = "gpu"  # "gpu", "mig" (an NVIDIA MIG device), "partition" (an AMD compute partition)
    parent: int | None = None  # a slice's card
    # A card cut into slices is never offered whole: its slices are, as their own classes.
    split: bool = False
    # Slices sharing memory (compute instances of one GPU instance): one claim at a time among them.
    memory_group: str | None = None
    # Why it cannot be trusted now (its agent's words); such a slot is not healthy either.
    fault: str | None = None
    label: str = ""  # how it reads in a refusal: "GPU 0", "GPU 0 MIG 2 (1g.10gb)"
    # The part of its card it is (a 1g of 7 = 1/7): what a claim of it counts against GPU quotas.
    share: float = 1.0

    @property
    def name(self) -> str:
        return self.label or f"GPU {self.index}"


def _devices_by_class(slots: dict[int, GpuSlot], classes: frozenset[str]) -> dict[str | None, tuple[GpuSlot, ...]]:
    """A node's devices by class (None: all of them), lowest index first."""
    every = tuple(slot for _, slot in sorted(slots.items()))
    by_class: dict[str | None, tuple[GpuSlot, ...]] = {None: every}
    for cls in classes:
        by_class[cls] = tuple(slot for slot in every if slot.gpu_class == cls)
    return by_class


def _relations(gpus: list[GpuSlot]) -> dict[int, tuple[int, ...]]:
    """Index -> the indices a claim of it keeps from being handed out: a card's slices, a slice's
    card and the slices it shares memory with. Empty for a node of whole cards only."""
    children: dict[int, list[int]] = {}
    groups: dict[str, list[int]] = {}
    for g in gpus:
        if g.parent is not None:
            children.setdefault(g.parent, []).append(g.index)
        if g.memory_group is not None:
            groups.setdefault(g.memory_group, []).append(g.index)
    related: dict[int, tuple[int, ...]] = {}
    for g in gpus:
        found: list[int] = list(children.get(g.index, ()))
        if g.parent is not None:
            found.append(g.parent)
        if g.memory_group is not None:
            found += [i for i in groups[g.memory_group] if i != g.index]
        if found:
            related[g.index] = tuple(dict.fromkeys(found))
    return related


@dataclass(slots=True)
class NodeSnapshot:
    id: int
    name: str
    ready: bool = True
    cordoned: bool = False
    cordon_reason: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    memory_total_bytes: int | None = None  # None: the agent did not say; the node stays usable
    cpus: int | None = None  # None: the agent did not say; the node stays usable
    gpus: list[GpuSlot] = field(default_factory=list)
    engines: frozenset[str] | None = None  # None: the agent did not say, do not filter
    # Engine -> what its install on the node is doing, in the node's words ("installing: ...").
    engine_status: dict[str, str] = field(default_factory=dict)
    # Engine -> the build the agent installed ("cuda-13.3-x64", "vulkan-x64", "rocm-7.2-x64", "cu129");
    # an engine named in agent.yaml is not listed (its build is the operator's word).
    engine_builds: dict[str, str] = field(default_factory=dict)
    # The fabric a replica across nodes may form on, for the built-in grouping; None: on none. The
    # fabrics app replaces that grouping with the physical fabrics its agents report (`extra`).
    fabric: str | None = None
    weights: frozenset[str] = frozenset()  # model sources (paths on the node) whose weights it holds, whole
    # The directories it reports what it holds for: a source inside one and not held there is not on
    # the node. None: it reports none (an older agent, no model_dirs), so nothing is refused for it.
    weight_dirs: frozenset[str] | None = None
    # Those of weight_dirs whose scan stopped at its bounds (a huge tree): a source in one of them
    # and no other that is not listed held may still be there (unknown, not refused).
    partial_dirs: frozenset[str] = frozenset()
    # What the node says of the weights it was told to fetch (the mirror), by the directory they go
    # to: (state, reason), state one of "held", "fetching" (the reason: the file), "refused", "failed".
    fetches: dict[str, tuple[str, str]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # contributed by other apps' snapshot fields
    status: str = ""  # why it is not ready, in words, for the reason shown


@dataclass(frozen=True, slots=True)
class Claim:
    replica: str
    shard: int
    node_id: int
    gpu_indices: tuple[int, ...] = ()
    memory_bytes: int = 0
    cpu_cores: float = 0.0
    owner: tuple[str, ...] = ()
    capacity_class: str = "standard"
    model: str = ""
    above_minimum: bool = False


@dataclass(frozen=True, slots=True)
class CapacityQuota:
    gpus: int | None = None
    cpu_cores: float | None = None
    memory_bytes: int | None = None
    replicas: int | None = None


class ClassDevices(NamedTuple):
    """A node's devices of one class, as they are whatever is claimed (Inventory.class_devices)."""

    total: int
    unhealthy: int
    untrusted: GpuSlot | None  # the first with a fault
    split: int  # cards cut into slices
    slices: frozenset[str]  # the classes of those slices, on the node


class Usage(NamedTuple):
    gpus: float  # cards: a slice counts by its share of its card
    cores: float
    memory: int
    replicas: int


@dataclass(slots=True)
class ProfileSpec:
    id: int
    name: str
    priority: int  # the larger number is tried first
    engine: str
    accelerator: str  # "cpu" or a GPU class such as "H100-80GB"
    gpus_per_shard: int = 0
    nodes_per_replica: int = 1
    memory_bytes: int = 0  # per shard; 0 claims nothing
    cpu_cores: float = 0  # per shard; 0 claims nothing
    node_selector: dict[str, str] = field(default_factory=dict)
    # The fields plugins declared (registry.register_profile_field) by name, for their rules: a
    # replica kept within one rack, what a shard draws. Read with registry.profile_field().
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_cpu(self) -> bool:
        return self.accelerator == CPU

    @property
    def gpus_needed(self) -> int:
        """GPUs per shard; a CPU profile claims none whatever gpus_per_shard says."""
        return 0 if self.is_cpu else max(self.gpus_per_shard, 0)

    @property
    def nodes_needed(self) -> int:
        return max(self.nodes_per_replica, 1)


@dataclass(slots=True)
class ReplicaRequest:
    model: str
    profiles: list[ProfileSpec]
    owner: tuple[str, ...] = ()
    capacity_class: str = "standard"
    replica_id: str = ""
    source: str = ""  # where the model's weights are on a node (the catalog's source): what holders hold


@dataclass(slots=True)
class Rejection:
    profile_id: int
    profile_name: str
    node_id: int | None
    node_name: str | None
    code: str
    message: str
    params: dict[str, Any]
    # The English msgid behind `message`, for translation on the Django side.
    template: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile_id": self.profile_id,
            "profile": self.profile_name,
            "node_id": self.node_id,
            "node": self.node_name,
            "code": self.code,
            "message": self.message,
            "template": self.template,
            "params": dict(self.params),
        }


@dataclass(frozen=True, slots=True)
class ShardPlan:
    rank: int
    node_id: int
    node_name: str
    gpu_indices: tuple[int, ...]
    memory_bytes: int
    cpu_cores: float


Group = tuple[str, ...]  # one part per pre-filter that groups: ("ib:0x...",), ("ib:0x...", "rack-4")


@dataclass(slots=True)
class PreFilterResult:
    """What a pre-filter makes of the nodes for one profile (see registry.py).

    `nodes`: the node ids the replica may use at all (None: every node); a node outside it is
    refused with `refuse(node)`. `groups`: for a replica across nodes, node id -> the groups it can
    form one in (a node absent from it is in none, and refused); `prefer`: node id -> finer groups,
    each `(group, part)`, a replica that fits whole inside one is placed there first (one leaf of a
    fabric). `notes(node_id)`: what explain shows of the node ({"fabric": ..., "leaf": ...}).
    `label(group part)`: how a group reads in a refusal. `tier(group part)`: groups of a lower tier are
    taken before any of a higher one whatever their scores (one NVLink domain before one InfiniBand
    fabric); None: every group is tier 0.
    """

    nodes: Collection[int] | None = None
    refuse: Callable[[NodeSnapshot], Reason] | None = None
    groups: Mapping[int, tuple[str, ...]] | None = None
    prefer: Mapping[int, tuple[tuple[str, str], ...]] | None = None
    notes: Callable[[int], dict[str, str]] | None = None
    label: Callable[[str], str] | None = None
    tier: Callable[[str], int] | None = None


@dataclass(slots=True)
class Placement:
    profile: ProfileSpec
    shards: list[ShardPlan]
    rejections: list[Rejection] = field(default_factory=list)
    # For a replica across nodes: the group it was formed in (its fabric), and the finer group
    # (leaf) when the whole replica fits in one; None otherwise.
    group: Group | None = None
    subgroup: str | None = None

    @property
    def node_ids(self) -> list[int]:
        return [s.node_id for s in self.shards]

    @property
    def gpus(self) -> int:
        return sum(len(s.gpu_indices) for s in self.shards)


@dataclass(slots=True)
class PlacementResult:
    placement: Placement | None
    rejections: list[Rejection]

    @property
    def placed(self) -> bool:
        return self.placement is not None


@dataclass(slots=True)
class NodeVerdict:
    node_id: int
    node_name: str
    reasons: list[Rejection]
    fits: bool
    score: float | None
    # For a node that fits: each scorer's weighted part of its score, by the scorer's name.
    scores: dict[str, float] | None = None
    # The groups it can form a replica across nodes in, and the finer ones (pre-filters'), and
    # what the pre-filters say of it (its fabric and leaf).
    groups: tuple[Group, ...] = ()
    prefer: tuple[tuple[Group, str], ...] = ()
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class ProfileExplain:
    profile: ProfileSpec
    fits: bool
    nodes: list[NodeVerdict]
    # Refusals that concern the profile rather than one node: quota, fabric, "no node fits".
    reasons: list[Rejection] = field(default_factory=list)
    placement: Placement | None = None
    # With a limit on the nodes spelled out: how many more fit, and the others refused, counted by
    # the code of the first reason met (nodes without the profile's GPU class under that reason),
    # each with the first such refusal as an example.
    more_fit: int = 0
    more_refused: dict[str, tuple[int, Rejection]] = field(default_factory=dict)


@dataclass(slots=True)
class PreemptionPlan:
    victims: list[str]  # replica ids to stop, cheapest first
    placement: Placement  # where the request goes once they are stopped


class PlacementConflict(ValueError):
    """apply() was asked to hand out a GPU, memory or cores that are not there."""


class _Owned:
    __slots__ = ("cores", "gpus", "memory", "replicas")

    def __init__(self) -> None:
        self.gpus = 0.0
        self.cores = 0.0
        self.memory = 0
        self.replicas: dict[str, int] = {}  # replica -> claims counted

    def copy(self) -> _Owned:
        other = _Owned()
        other.gpus, other.cores, other.memory, other.replicas = self.gpus, self.cores, self.memory, dict(self.replicas)
        return other


_DRY_SEQ = 1 << 62
# Quota usage is kept rounded to this many decimals, so that seven 1/7 slices make one card again.
_GPU_DIGITS = 9


class _Sum:
    """Key -> the sum of weigh(claim) over the claims `counts` accepts, kept as claims come and go."""

    __slots__ = ("counts", "members", "totals", "weigh")

    def __init__(self, weigh: Callable[[Claim], Mapping[str, float] | None], counts: Callable[[Claim], bool]) -> None:
        self.weigh = weigh
        self.counts = counts
        self.totals: dict[str, float] = {}
        self.members: dict[int, Mapping[str, float]] = {}

    def add(self, claim: Claim) -> None:
        if not self.counts(claim):
            return
        weights = self.weigh(claim)
        if not weights:
            return
        self.members[id(claim)] = weights
        totals = self.totals
        for key, value in weights.items():
            totals[key] = totals.get(key, 0.0) + value

    def remove(self, claim: Claim) -> None:
        weights = self.members.pop(id(claim), None)
        if weights:
            totals = self.totals
            for key, value in weights.items():
                totals[key] -= value

    def copy(self) -> _Sum:
        other = _Sum(self.weigh, self.counts)
        other.totals = dict(self.totals)
        other.members = dict(self.members)
        return other


class Inventory:
    """Nodes, the claims against them and the capacity quotas, indexed for placement.

    Change claims only through `apply`, `add_claim` and `release`: they keep the indexes
    (claimed GPUs, memory and cores owed per node, free GPUs per class, usage per owner) in step.
    Claims are kept oldest first; preemption takes the newest of equal cost first.
    """

    def __init__(
        self,
        nodes: dict[int, NodeSnapshot],
        claims: list[Claim] | None = None,
        quotas: dict[str, CapacityQuota] | None = None,
    ) -> None:
        self.nodes = nodes
        self._claims: dict[int, Claim] = {}  # id -> claim, oldest first (see `claims`)
        self.quotas: dict[str, CapacityQuota] = dict(quotas or {})
        # Static: never changes after construction, shared by copies.
        ordered = sorted(nodes.values(), key=lambda n: (n.name, n.id))
        self._order: list[int] = [n.id for n in ordered]
        self._rank: dict[int, int] = {n.id: i for i, n in enumerate(ordered)}
        self._slots: dict[int, dict[int, GpuSlot]] = {n.id: {g.index: g for g in n.gpus} for n in ordered}
        self._classes: dict[int, frozenset[str]] = {n.id: frozenset(g.gpu_class for g in n.gpus) for n in ordered}
        # node -> class -> its devices of the class (None: every class), lowest index first: what
        # free_gpus walks, so that a node of 8 cards and 56 slices is not sorted per question.
        self._by_class: dict[int, dict[str | None, tuple[GpuSlot, ...]]] = {
            n.id: _devices_by_class(self._slots[n.id], self._classes[n.id]) for n in ordered
        }
        # Per node with slices: what a claim of each device keeps from being handed out.
        self._related: dict[int, dict[int, tuple[int, ...]]] = {
            n.id: related for n in ordered if (related := _relations(n.gpus))
        }
        # Per node with a slice: device index -> its share of its card (what its claim counts in quotas).
        self._shares: dict[int, dict[int, float]] = {
            n.id: {g.index: g.share for g in n.gpus} for n in ordered if any(g.share != 1.0 for g in n.gpus)
        }
        self._gpuless: list[int] = [n.id for n in ordered if not n.gpus]  # in rank order
        self._gpu_nodes: list[int] = [n.id for n in ordered if n.gpus]
        self._weights: dict[str, list[int]] = {}
        for n in ordered:
            for model in n.weights:
                self._weights.setdefault(model, []).append(n.id)
        self._class_nodes: dict[str, list[int]] = {}
        for n in ordered:
            for cls in sorted(self._classes[n.id]):
                self._class_nodes.setdefault(cls, []).append(n.id)
        # Pre-filters' own indexes of the (static) nodes, built on first use and shared by copies.
        self._plugin_index: dict[tuple[str, Callable[[Inventory], Any]], Any] = {}
        # What follows from the nodes alone (never from claims), computed once and shared by copies.
        self._memo: dict[Any, Any] = {}
        # Mutable: claims and what follows from them.
        self._owner: dict[int, dict[int, str]] = {n.id: {} for n in ordered}
        # node -> index -> how many claims of a related device (its card, a slice of it, a
        # memory-sharing sibling) keep it from being handed out; only nodes with such claims.
        self._blocks: dict[int, dict[int, int]] = {}
        self._mem: dict[int, int] = dict.fromkeys(nodes, 0)
        self._cores: dict[int, float] = dict.fromkeys(nodes, 0.0)
        self._replicas: dict[str, list[Claim]] = {}
        self._slot_claims: dict[str, list[tuple[int, int]]] = {}
        self._usage: dict[str, _Owned] = {}
        # replica -> how new it is: a numeric replica id is its own (ids are handed out in creation
        # order, so a snapshot read in any order and one kept up to date agree); others, a dry run's,
        # are newer than all of those, in the order they first claimed.
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._models: dict[str, dict[int, int]] = {}  # model -> node id -> its shards there
        # Tallies: name -> (node id -> its domain, model -> domain -> the model's shards there).
        self._tallies: dict[str, tuple[Mapping[int, Any], dict[str, dict[Any, int]]]] = {}
        self._sums: dict[str, _Sum] = {}  # name -> a sum over claims (claim_sum)
        for n in ordered:
            for g in n.gpus:
                if g.claimed_by is not None:
                    self._owner[n.id][g.index] = g.claimed_by
                    self._slot_claims.setdefault(g.claimed_by, []).append((n.id, g.index))
        for claim in claims or ():
            self._add(claim, check=False)
        # free[node][class] and buckets[class][k] = ranks (sorted) of nodes with k free GPUs of class.
        self._free: dict[int, dict[str, int]] = {}
        self._buckets: dict[str, list[list[int]]] = {}
        for n in ordered:
            counts = dict.fromkeys(self._classes[n.id], 0)
            for g in n.gpus:
                if self._available(n.id, g.index):
                    counts[g.gpu_class] += 1
            self._free[n.id] = counts
            for cls, k in counts.items():
                self._bucket(cls, k).append(self._rank[n.id])  # appended in rank order: sorted

    @property
    def claims(self) -> list[Claim]:
        """Every claim, oldest first (kept by identity, so a release costs no walk of them all)."""
        return list(self._claims.values())

    # -- copying -------------------------------------------------------------------------------

    def copy(self) -> Inventory:
        """A copy to place on (dry runs): claims and indexes are copied, nodes are shared."""
        other = Inventory.__new__(Inventory)
        other.nodes = self.nodes
        other._claims = dict(self._claims)
        other.quotas = dict(self.quotas)
        for name in (
            "_order",
            "_rank",
            "_slots",
            "_classes",
            "_by_class",
            "_gpuless",
            "_gpu_nodes",
            "_related",
            "_shares",
            "_weights",
            "_class_nodes",
            "_plugin_index",
            "_memo",
        ):
            setattr(other, name, getattr(self, name))
        other._owner = {k: dict(v) for k, v in self._owner.items()}
        other._blocks = {k: dict(v) for k, v in self._blocks.items()}
        other._mem = dict(self._mem)
        other._cores = dict(self._cores)
        other._replicas = {k: list(v) for k, v in self._replicas.items()}
        other._slot_claims = {k: list(v) for k, v in self._slot_claims.items()}
        other._usage = {k: v.copy() for k, v in self._usage.items()}
        other._seq = dict(self._seq)
        other._next_seq = self._next_seq
        other._models = {k: dict(v) for k, v in self._models.items()}
        other._tallies = {
            name: (keys, {model: dict(counts) for model, counts in by_model.items()})
            for name, (keys, by_model) in self._tallies.items()
        }
        other._sums = {k: v.copy() for k, v in self._sums.items()}
        other._free = {k: dict(v) for k, v in self._free.items()}
        other._buckets = {k: [list(b) for b in v] for k, v in self._buckets.items()}
        return other

    # -- reading -------------------------------------------------------------------------------

    def memory_claimed(self, node_id: int) -> int:
        return self._mem[node_id]

    def cores_claimed(self, node_id: int) -> float:
        return self._cores[node_id]

    def memory_free(self, node_id: int) -> int | None:
        total = self.nodes[node_id].memory_total_bytes
        return None if total is None else max(total - self._mem[node_id], 0)

    def cores_free(self, node_id: int) -> float | None:
        cpus = self.nodes[node_id].cpus
        return None if cpus is None else max(cpus - self._cores[node_id], 0.0)

    def is_claimed(self, node_id: int, index: int) -> bool:
        return index in self._owner[node_id]

    def gpu_owner(self, node_id: int, index: int) -> str | None:
        return self._owner[node_id].get(index)

    def free_gpus(self, node_id: int, gpu_class: str | None = None) -> list[GpuSlot]:
        """Healthy, unclaimed GPUs of the node (of one class if given), lowest index first: not a
        split card, and no claim of its card, its slices or its memory-sharing siblings."""
        slots = self._by_class[node_id].get(gpu_class, ())
        owned = self._owner[node_id]
        blocks = self._blocks.get(node_id)
        # _available() inlined: this runs for every node of the class a slice profile walks.
        return [
            slot
            for slot in slots
            if slot.healthy and not slot.split and slot.index not in owned and not (blocks and blocks.get(slot.index))
        ]

    def class_devices(self, node_id: int, gpu_class: str) -> ClassDevices:
        """What the node's devices of the class are, whatever is claimed (a refusal's numbers)."""

        def build() -> ClassDevices:
            node = self.nodes[node_id]
            of_class = [g for g in node.gpus if g.gpu_class == gpu_class]
            untrusted = next((g for g in of_class if g.fault), None)
            split = sum(1 for g in of_class if g.split)
            prefix = gpu_class + "-"
            slices = (
                frozenset(g.gpu_class for g in node.gpus if g.parent is not None and g.gpu_class.startswith(prefix))
                if split
                else frozenset()
            )
            unhealthy = sum(1 for g in of_class if not g.healthy)
            return ClassDevices(len(of_class), unhealthy, untrusted, split, slices)

        return self.memo(("class_devices", node_id, gpu_class), build)  # type: ignore[no-any-return]

    def has_slices(self, node_id: int) -> bool:
        """Whether the node has devices a claim of another keeps from being handed out."""
        return node_id in self._related

    def related(self, node_id: int, index: int) -> tuple[int, ...]:
        """What a claim of the device keeps from being handed out (a slice gone from the snapshot
        still names its card by its index)."""
        found = self._related.get(node_id, {}).get(index)
        if found is not None:
            return found
        parent = slice_parent(index)
        return () if parent is None else (parent,)

    def blocker(self, node_id: int, index: int) -> str | None:
        """The replica whose claim of a related device keeps this one from being handed out (a claim
        of a slice gone from the snapshot keeps its card, which no longer lists it as a slice)."""
        if not self._blocks.get(node_id, {}).get(index):
            return None
        owned = self._owner.get(node_id, {})
        return next((replica for other, replica in owned.items() if index in self.related(node_id, other)), "?")

    def free_count(self, node_id: int, gpu_class: str) -> int:
        return self._free[node_id].get(gpu_class, 0)

    def free_total(self, node_id: int) -> int:
        """The node's free healthy GPUs, of every class."""
        return sum(self._free[node_id].values())

    def free_in_all(self) -> int:
        """Free healthy GPUs on all nodes, of every class (read from the free-count buckets)."""
        return sum(k * len(bucket) for buckets in self._buckets.values() for k, bucket in enumerate(buckets))

    def gpu_classes(self, node_id: int) -> frozenset[str]:
        return self._classes[node_id]

    def rank(self, node_id: int) -> int:
        """The node's position by (name, id): the final tie-break."""
        return self._rank[node_id]

    def replica_claims(self, replica_id: str) -> list[Claim]:
        return list(self._replicas.get(replica_id, ()))

    def replica_ids(self) -> list[str]:
        return list(self._replicas)

    def replica_seq(self, replica_id: str) -> int:
        return self._seq.get(replica_id, -1)

    def usage(self, owner_key: str) -> Usage:
        u = self._usage.get(owner_key)
        if u is None:
            return Usage(0, 0.0, 0, 0)
        return Usage(u.gpus, u.cores, u.memory, len(u.replicas))

    def claim_gpus(self, claim: Claim) -> float:
        """The cards a claim counts against GPU quotas: a whole card 1, a slice its share of its card
        (a 1g of 7 = 1/7). A slice gone from the snapshot counts as its whole card (its share is no
        longer known, and a quota errs on the side of what it may have held)."""
        shares = self._shares.get(claim.node_id)
        if shares is None:
            return float(len(claim.gpu_indices))
        return sum(shares.get(index, 1.0) for index in claim.gpu_indices)

    def class_share(self, gpu_class: str) -> float:
        """The part of a card one device of the class is (1 for a whole card, 1/7 for a 1g MIG slice
        of an H100), as the nodes' devices of that class say; 1 where none is known."""

        def build() -> float:
            shares = {
                slot.share
                for node_id in self.class_nodes(gpu_class)
                for slot in self.nodes[node_id].gpus
                if slot.gpu_class == gpu_class
            }
            return max(shares, default=1.0)

        return float(self.memo(("class_share", gpu_class), build))

    def weights_nodes(self, source: str) -> list[int]:
        """Nodes that hold the weights at `source` (a model's source), in name order."""
        return self._weights.get(source, []) if source else []

    # The capacity index the pipeline walks (read-only views; do not change them).

    @property
    def order(self) -> list[int]:
        """Node ids by (name, id); a node's rank is its position here."""
        return self._order

    def free_buckets(self, gpu_class: str) -> list[list[int]]:
        """[k] = ranks, ascending, of the nodes with exactly k free healthy GPUs of the class."""
        return self._buckets.get(gpu_class, [])

    def gpuless_nodes(self) -> list[int]:
        return self._gpuless

    def gpu_nodes(self) -> list[int]:
        return self._gpu_nodes

    def class_nodes(self, gpu_class: str) -> list[int]:
        """Nodes with at least one GPU of the class, in rank order."""
        return self._class_nodes.get(gpu_class, [])

    def model_shards(self, model: str) -> Mapping[int, int]:
        """Node id -> how many shards of the model's replicas it holds now (claims as they change)."""
        return self._models.get(model, {})

    def model_tally(self, name: str, model: str, keys: Callable[[], Mapping[int, Any]]) -> Mapping[Any, int]:
        """The model's shards counted by a node's domain (its rack, say): `keys()` maps node ids to
        their domain (nodes it leaves out count under None) and is asked once per snapshot; the
        counts are kept as claims change, so reading them costs nothing per placement."""
        tally = self._tallies.get(name)
        if tally is None:
            of = keys()
            by_model: dict[str, dict[Any, int]] = {}
            for each, shards in self._models.items():
                counts = by_model[each] = {}
                for node_id, count in shards.items():
                    key = of.get(node_id)
                    counts[key] = counts.get(key, 0) + count
            tally = self._tallies[name] = (of, by_model)
        return tally[1].get(model, {})

    def claim_sum(
        self,
        name: str,
        weigh: Callable[[Claim], Mapping[str, float] | None],
        counts: Callable[[Claim], bool],
    ) -> Mapping[str, float]:
        """Key -> the sum of `weigh(claim)` over the claims that `counts`, kept up to date as claims
        are applied and released (and carried by copies): a placement reads it without walking
        every claim. Built from the claims there are on first use under `name`."""
        found = self._sums.get(name)
        if found is None:
            found = self._sums[name] = _Sum(weigh, counts)
            for claim in self._claims.values():
                found.add(claim)
        return found.totals

    def _count(self, model: str, node_id: int, delta: int) -> None:
        for keys, by_model in self._tallies.values():
            counts = by_model.setdefault(model, {})
            key = keys.get(node_id)
            counts[key] = counts.get(key, 0) + delta
            if not counts[key]:
                del counts[key]

    def plugin_index(self, name: str, build: Callable[[Inventory], Any]) -> Any:
        """A plugin's index of the nodes, built once per snapshot (nodes never change in one)."""
        key = (name, build)
        index = self._plugin_index.get(key)
        if index is None:
            index = self._plugin_index[key] = build(self)
        return index

    def renew_index(self, name: str, renew: Callable[[Inventory, Any], Any]) -> None:
        """A node field that plugin index `name` reads has changed (a simulated fleet's measured
        power draw catching up with its claims): `renew(inventory, index)` gives the index built so
        far its new form. The sums over claims are dropped with it, since a sum may be kept for one
        form of an index."""
        for key in [key for key in self._plugin_index if key[0] == name]:
            self._plugin_index[key] = renew(self, self._plugin_index[key])
        self._sums.clear()

    def memo(self, key: Any, build: Callable[[], Any]) -> Any:
        """A value that depends on the nodes only (not on claims), built once per snapshot."""
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = build()
        return found

    # -- changing ------------------------------------------------------------------------------

    def apply(
        self,
        placement: Placement,
        replica_id: str,
        *,
        model: str = "",
        owner: tuple[str, ...] = (),
        capacity_class: str = "standard",
        above_minimum: bool = False,
    ) -> list[Claim]:
        """Claim what a placement chose, as replica `replica_id`; raises PlacementConflict, claiming
        nothing, when a GPU is taken or unhealthy, or memory or cores would be over-committed."""
        if replica_id in self._replicas:
            raise PlacementConflict(f"replica {replica_id} already holds claims")
        claims = [
            Claim(
                replica_id,
                s.rank,
                s.node_id,
                tuple(s.gpu_indices),
                s.memory_bytes,
                s.cpu_cores,
                tuple(owner),
                capacity_class,
                model,
                above_minimum,
            )
            for s in placement.shards
        ]
        if len({c.node_id for c in claims}) != len(claims):
            raise PlacementConflict(f"replica {replica_id} has two shards on one node")
        for claim in claims:
            self._check(claim)
        for claim in claims:
            self._add(claim, check=False)
        return claims

    def apply_request(
        self,
        placement: Placement,
        request: ReplicaRequest,
        replica_id: str | None = None,
        *,
        above_minimum: bool = False,
    ) -> list[Claim]:
        return self.apply(
            placement,
            replica_id or request.replica_id,
            model=request.model,
            owner=request.owner,
            capacity_class=request.capacity_class,
            above_minimum=above_minimum,
        )

    def add_claim(self, claim: Claim) -> None:
        """Record one existing claim (checked like apply)."""
        self._add(claim, check=True)

    def release(self, replica_id: str) -> list[Claim]:
        """Drop every claim of a replica (replicas fail, and are released, whole), and free any GPU
        slot the snapshot marked as claimed by it."""
        claims = self._replicas.pop(replica_id, [])
        self._seq.pop(replica_id, None)
        for tally in self._sums.values():
            for claim in claims:
                tally.remove(claim)
        for claim in claims:
            self._claims.pop(id(claim), None)
        for claim in claims:
            shards = self._models.get(claim.model) if claim.model else None
            if shards is not None and claim.node_id in shards:
                shards[claim.node_id] -= 1
                if not shards[claim.node_id]:
                    del shards[claim.node_id]
                if self._tallies:
                    self._count(claim.model, claim.node_id, -1)
            owned = self._owner.get(claim.node_id)
            if owned is not None:
                for index in claim.gpu_indices:
                    if owned.get(index) == replica_id:
                        del owned[index]
                        if self._available(claim.node_id, index):
                            self._freed(claim.node_id, index, +1)
                        self._relate(claim.node_id, index, -1)
                self._mem[claim.node_id] -= claim.memory_bytes
                self._cores[claim.node_id] -= claim.cpu_cores
            gpus = self.claim_gpus(claim) if claim.owner and claim.gpu_indices else 0.0
            for key in claim.owner:
                u = self._usage[key]
                u.gpus = round(u.gpus - gpus, _GPU_DIGITS)
                u.cores -= claim.cpu_cores
                u.memory -= claim.memory_bytes
                u.replicas.pop(replica_id, None)
        for node_id, index in self._slot_claims.pop(replica_id, []):
            owned = self._owner[node_id]
            if owned.get(index) == replica_id:
                del owned[index]
                if self._available(node_id, index):
                    self._freed(node_id, index, +1)
        return claims

    # -- internals -----------------------------------------------------------------------------

    def _bucket(self, cls: str, k: int) -> list[int]:
        buckets = self._buckets.setdefault(cls, [])
        while len(buckets) <= k:
            buckets.append([])
        return buckets[k]

    def _available(self, node_id: int, index: int) -> bool:
        """Whether the device may be handed out now: healthy, not split, unclaimed, and no claim of
        a related device (its card, one of its slices, a memory-sharing sibling)."""
        slot = self._slots[node_id].get(index)
        if slot is None or not slot.healthy or slot.split or index in self._owner[node_id]:
            return False
        blocks = self._blocks.get(node_id)
        return not (blocks and blocks.get(index))

    def _relate(self, node_id: int, index: int, delta: int) -> None:
        """A claim of `index` was added (+1) or released (-1): count it against the related devices,
        moving them in or out of the free counts as they become taken or free."""
        related = self.related(node_id, index)
        if not related:
            return
        indexed = hasattr(self, "_free")
        blocks = self._blocks.setdefault(node_id, {})
        for other in related:
            before = indexed and self._available(node_id, other)
            count = blocks.get(other, 0) + delta
            if count > 0:
                blocks[other] = count
            else:
                blocks.pop(other, None)
            if indexed and before != self._available(node_id, other):
                self._freed(node_id, other, -1 if before else +1)
        if not blocks:
            del self._blocks[node_id]

    def _freed(self, node_id: int, index: int, delta: int) -> None:
        slot = self._slots[node_id].get(index)
        if slot is None or not slot.healthy:
            return
        cls = slot.gpu_class
        counts = self._free[node_id]
        before = counts[cls]
        counts[cls] = before + delta
        rank = self._rank[node_id]
        old = self._buckets[cls][before]
        del old[bisect.bisect_left(old, rank)]
        bisect.insort(self._bucket(cls, before + delta), rank)

    def _check(self, claim: Claim) -> None:
        node = self.nodes.get(claim.node_id)
        if node is None:
            raise PlacementConflict(f"no node {claim.node_id}")
        slots = self._slots[claim.node_id]
        owned = self._owner[claim.node_id]
        if len(set(claim.gpu_indices)) != len(claim.gpu_indices):
            raise PlacementConflict(f"{node.name}: a GPU is listed twice in {claim.gpu_indices}")
        for index in claim.gpu_indices:
            slot = slots.get(index)
            if slot is None or not slot.healthy:
                raise PlacementConflict(f"{node.name}: GPU {index} is missing or unhealthy")
            if slot.split:
                raise PlacementConflict(f"{node.name}: {slot.name} is split into slices, which are claimed instead")
            if index in owned:
                raise PlacementConflict(f"{node.name}: GPU {index} is claimed by {owned[index]}")
            blocker = self.blocker(claim.node_id, index)
            if blocker is not None:
                raise PlacementConflict(f"{node.name}: {slot.name} overlaps a device replica {blocker} claims")
            if set(self.related(claim.node_id, index)) & set(claim.gpu_indices):
                raise PlacementConflict(f"{node.name}: {slot.name} overlaps another device of the same claim")
        total = node.memory_total_bytes
        if claim.memory_bytes and total is not None and self._mem[claim.node_id] + claim.memory_bytes > total:
            raise PlacementConflict(f"{node.name}: memory would be over-committed")
        cpus = node.cpus
        if claim.cpu_cores and cpus is not None and self._cores[claim.node_id] + claim.cpu_cores > cpus + CORE_EPSILON:
            raise PlacementConflict(f"{node.name}: CPU cores would be over-committed")

    def _add(self, claim: Claim, *, check: bool) -> None:
        if check:
            self._check(claim)
        indexed = hasattr(self, "_free")  # during __init__ the free counts are built afterwards
        self._claims[id(claim)] = claim
        if indexed:
            for tally in self._sums.values():
                tally.add(claim)
        self._replicas.setdefault(claim.replica, []).append(claim)
        if claim.replica not in self._seq:
            if claim.replica.isascii() and claim.replica.isdigit():
                self._seq[claim.replica] = int(claim.replica)
            else:
                self._seq[claim.replica] = _DRY_SEQ + self._next_seq
                self._next_seq += 1
        if claim.model:
            shards = self._models.setdefault(claim.model, {})
            shards[claim.node_id] = shards.get(claim.node_id, 0) + 1
            if self._tallies:
                self._count(claim.model, claim.node_id, +1)
        owned = self._owner.get(claim.node_id)
        if owned is not None:  # a claim on a node outside the snapshot still counts against quotas
            for index in claim.gpu_indices:
                if index in owned:
                    continue  # a snapshot that claims a GPU twice: it stays claimed by the first
                free = indexed and self._available(claim.node_id, index)
                owned[index] = claim.replica
                if free:
                    self._freed(claim.node_id, index, -1)
                self._relate(claim.node_id, index, +1)
            self._mem[claim.node_id] += claim.memory_bytes
            self._cores[claim.node_id] += claim.cpu_cores
        gpus = self.claim_gpus(claim) if claim.owner and claim.gpu_indices else 0.0
        for key in claim.owner:
            u = self._usage.get(key)
            if u is None:
                u = self._usage[key] = _Owned()
            u.gpus = round(u.gpus + gpus, _GPU_DIGITS)
            u.cores += claim.cpu_cores
            u.memory += claim.memory_bytes
            u.replicas[claim.replica] = u.replicas.get(claim.replica, 0) + 1
