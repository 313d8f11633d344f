"""place() and explain(): run the registered filters and scorers over an inventory.

Profiles are tried by `priority`, the LARGER number first (as the catalog orders them: "the
highest priority that fits wins"; ties by name, then id). The first profile that fits wins;
the refusals met on the way (earlier profiles' and this one's) are kept on the placement.

A node's score is the weighted sum of the scorers (each clamped to [0, 1]). The best node
has the highest score; ties go to the higher built-in score, then the node name (then id).

How place() stays fast on thousands of nodes without changing the answer: the inventory
keeps, per GPU class, the nodes bucketed by how many free GPUs of the class they have. The
built-in scorers (binpack, weights, spare_gpus) depend only on that count, on whether the
node holds the weights and on whether it has GPUs, so the nodes can be walked in descending
order of their built-in score K (a lazy merge over buckets and segments, see _Stream).
Filters run only on the nodes walked. Every other scorer adds at most its weight, so once
the next node's K plus those weights cannot beat the best node found, the walk stops. With
only the built-in scorers the first node that passes every filter in the best bucket wins.
Nodes the index skips (wrong class, too few free GPUs, memory or cores short for a CPU
profile) are exactly nodes a built-in filter refuses (gpu_class, free_gpus, memory,
cpu_cores: these four are assumed registered; the others may be replaced or removed
freely). explain() does not use the index at all.

A profile that fits nowhere refuses every node the walk did not reach, each with its first reason.
A node the index skips (no GPU of the class, or fewer free than a shard needs) is refused by a
built-in filter that reads the node and that count alone, when no other filter comes before
free_gpus: its refusal is kept per snapshot by (node, count) and given again while the count is
the same (a fallback's first profile is refused by most of the fleet on every placement).

Pre-filters (registry.py) run once per profile before the walk. The nodes one leaves out are
skipped by the walk, and refused with its reason at its place among the filters, in place()
and explain() alike, so the two cannot disagree about a node whatever a plugin decides.

Multi-node replicas (nodes_per_replica > 1) take one shard per node, all from one group of
the pre-filters' (the built-in one groups by `NodeSnapshot.fabric`; the fabrics app's by
physical fabric): a node in no group never takes a shard of one. Per group the best N nodes
are taken; the group whose N nodes score highest in sum wins (ties: group name). When a
pre-filter names finer groups (leaves), a finer group that holds N nodes is taken first, the
best of those by the same sum; the walk then looks at every candidate. A pre-filter may also put
its groups in tiers: a group of a lower tier that holds N nodes is taken before any of a higher
one (a multi-node NVLink domain before an InfiniBand fabric), again looking at every candidate.

Sampling, on a fleet larger than the registry's `sample_above` (1,000 nodes): the walk stops
once `sample_size` (100) nodes have passed every filter, and the best of those wins. Because
the walk goes in descending built-in score, the sample is the best 100 by the built-in scorers,
not an arbitrary 100. What it gives up: another scorer (spreading across racks, a fabric's
cable) chooses only among those, so a node further down the walk that it would have preferred
is not seen; a CPU profile on GPU nodes looks for its best fit among the first nodes with room
in name order rather than among all; a replica across nodes is formed from the groups (leaves,
fabrics) found in the sample, and stops early only when the best of them is of the lowest tier
(a multi-node NVLink domain when there are any). Feasibility is never given up: the walk only
stops early once something fits.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import insort
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import cast

from . import reasons
from .context import PlacementContext
from .filters import free_gpus as free_gpus_filter
from .filters import gpu_class as gpu_class_filter
from .filters import node_selector as node_selector_filter
from .filters import not_cordoned as not_cordoned_filter
from .filters import ready as ready_filter
from .gpus import choose_gpus
from .model import (
    CORE_EPSILON,
    Group,
    Inventory,
    NodeSnapshot,
    NodeVerdict,
    Placement,
    PlacementConflict,
    PlacementResult,
    PreFilterResult,
    ProfileExplain,
    ProfileSpec,
    Rejection,
    ReplicaRequest,
    ShardPlan,
)
from .reasons import Reason
from .registry import REGISTRY, FilterFn, Registry
from .scorers import INDEXED, binpack, spare_gpus, weights

Item = tuple[float, int, int]  # (built-in score K, rank, node id)

EXPLAIN_NODES = 200  # what the API and the page spell out of explain per profile; the rest are counted

_LAZY = 0
_ITER = 1


def ordered_profiles(profiles: Iterable[ProfileSpec]) -> list[ProfileSpec]:
    """The order profiles are tried in: larger priority first, then name, then id."""
    return sorted(profiles, key=lambda p: (-p.priority, p.name, p.id))


def _clamp(value: float) -> float:
    if not value > 0.0:  # also NaN
        return 0.0
    if value >= 1.0:
        return 1.0
    return value


def _item_order(item: Item) -> tuple[float, int]:
    return (-item[0], item[1])


def _left_out(node: NodeSnapshot, name: str) -> Reason:
    return reasons.left_out(node.name, name)


class _Pre:
    """The pre-filters' answers for one profile, combined: which nodes the walk may skip, the
    refusal each stands for, and the groups a replica across nodes is formed in."""

    __slots__ = (
        "group_maps",
        "labels",
        "members",
        "multi",
        "names",
        "notes",
        "prefer_maps",
        "refusers",
        "static",
        "tiers",
    )

    def __init__(self, ctx: PlacementContext) -> None:
        self.multi = ctx.multi_node
        self.members: list[Collection[int] | Mapping[int, object]] = []
        self.group_maps: list[Mapping[int, tuple[str, ...]]] = []
        self.prefer_maps: list[tuple[int, Mapping[int, tuple[tuple[str, str], ...]]]] = []
        self.labels: list[Callable[[str], str] | None] = []
        self.tiers: list[Callable[[str], int] | None] = []
        self.notes: list[Callable[[int], dict[str, str]]] = []
        self.refusers: list[tuple[int, str, FilterFn]] = []
        self.static: set[str] = set()
        self.names: list[str] = []  # the pre-filters that narrowed or grouped, in order
        inventory = ctx.inventory
        for entry in ctx.registry.prefilters():
            if entry.applies is not None and not entry.applies(ctx):
                continue
            index = inventory.plugin_index(entry.name, entry.index) if entry.index is not None else None
            result = entry.fn(ctx, index)
            if result is None:
                continue
            self._add(entry.name, entry.order, entry.static, result)

    def _add(self, name: str, order: int, static: bool, result: PreFilterResult) -> None:
        kept: list[Collection[int] | Mapping[int, object]] = []
        if result.nodes is not None:
            kept.append(result.nodes)
        if self.multi and result.groups is not None:
            if result.prefer:  # an empty map names no finer group
                self.prefer_maps.append((len(self.group_maps), result.prefer))
            self.group_maps.append(result.groups)
            self.labels.append(result.label)
            self.tiers.append(result.tier)
            kept.append(result.groups)
        if result.notes is not None:
            self.notes.append(result.notes)
        if not kept:
            return
        self.names.append(name)
        self.members.extend(kept)
        refuse = result.refuse

        def refused(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
            node_id = node.id
            for members in kept:
                if node_id not in members:
                    return refuse(node) if refuse is not None else _left_out(node, name)
            return None

        self.refusers.append((order, name, refused))
        if static:
            self.static.add(name)

    def allows(self, node_id: int) -> bool:
        return all(node_id in members for members in self.members)

    def groups(self, node_id: int) -> tuple[Group, ...]:
        """The groups the node can form a replica across nodes in (one () when nothing groups)."""
        maps = self.group_maps
        if not maps:
            return ((),)
        if len(maps) == 1:
            return tuple(dict.fromkeys((part,) for part in maps[0].get(node_id, ())))
        return tuple(dict.fromkeys(itertools.product(*(m.get(node_id, ()) for m in maps))))

    def preferred(self, node_id: int, groups: tuple[Group, ...]) -> tuple[tuple[Group, str], ...]:
        """The finer groups the node is in: (group, part) for each of its groups."""
        found: list[tuple[Group, str]] = []
        for position, prefer in self.prefer_maps:
            for part, sub in prefer.get(node_id, ()):
                for group in groups:
                    if group[position] == part:
                        found.append((group, sub))
        return tuple(dict.fromkeys(found))  # a node counts once in a group, however many adapters it has there

    def all_groups(self, ctx: PlacementContext) -> list[Group]:
        """Every group some node of the profile's GPU class (or any node) is in."""
        if not self.group_maps:
            return [()]
        inventory = ctx.inventory

        def build() -> list[Group]:
            ids = inventory.class_nodes(ctx.gpu_class) if ctx.gpu_class is not None else inventory.order
            found: set[Group] = set()
            for node_id in ids:
                if self.allows(node_id):
                    found.update(self.groups(node_id))
            return sorted(found)

        if all(name in self.static for name in self.names):
            # Only static pre-filters: the answer follows from the nodes, the same for every placement.
            # A static pre-filter may still read the profile (a plugin's field, as facility's level to
            # keep a replica within): the key names them all (scalars, as registered).
            profile = ctx.profile
            fields = tuple(sorted(profile.extra.items()))
            key = ("all_groups", profile.id, profile.name, profile.accelerator, fields, tuple(self.names))
            return inventory.memo(key, build)  # type: ignore[no-any-return]
        return build()

    @property
    def tiered(self) -> bool:
        return any(tier is not None for tier in self.tiers)

    def tier(self, group: Group) -> int:
        total = 0
        for position, part in enumerate(group):
            tier = self.tiers[position] if position < len(self.tiers) else None
            if tier is not None:
                total += tier(part)
        return total

    def label(self, group: Group) -> str:
        parts = []
        for position, part in enumerate(group):
            label = self.labels[position] if position < len(self.labels) else None
            parts.append(label(part) if label is not None else part)
        return "/".join(parts) or "-"

    def node_notes(self, node_id: int) -> dict[str, str]:
        notes: dict[str, str] = {}
        for fn in self.notes:
            notes.update(fn(node_id))
        return notes


def static_prefilters(ctx: PlacementContext) -> list[FilterFn]:
    """The refusals of the pre-filters whose answer does not depend on claims, as filters."""
    pre = _Pre(ctx)
    return [fn for _, name, fn in pre.refusers if name in pre.static]


class _Evaluator:
    """The registered plugins bound to one profile's context."""

    __slots__ = ("ctx", "filters", "indexed", "named", "nodes", "plugins", "pmax", "pre", "sample", "walk_filters")

    def __init__(self, ctx: PlacementContext) -> None:
        registry = ctx.registry
        self.ctx = ctx
        self.nodes = ctx.inventory.nodes
        self.pre = _Pre(ctx)
        chain: list[tuple[int, str, FilterFn]] = [
            (e.order, e.name, e.fn) for e in registry.filters() if e.applies is None or e.applies(ctx)
        ]
        chain.extend(self.pre.refusers)
        chain.sort(key=lambda entry: (entry[0], entry[1]))
        self.filters = tuple(fn for _, _, fn in chain)
        # The walk only meets nodes the pre-filters kept (_stream skips the others), for which their
        # refusals are always None: the walk asks the other filters alone.
        refusers = {id(fn) for _, _, fn in self.pre.refusers}
        self.walk_filters = tuple(fn for fn in self.filters if id(fn) not in refusers)
        scorers = registry.scorers()
        self.indexed = tuple((e.fn, e.weight) for e in scorers if e.fn in INDEXED)
        self.plugins = tuple((e.fn, e.weight) for e in scorers if e.fn not in INDEXED)
        self.named = tuple((e.name, e.fn, e.weight) for e in scorers)
        pmax = 0.0
        for _, weight in self.plugins:
            pmax += weight
        self.pmax = pmax
        # 0: score every candidate (the exact answer); otherwise stop after this many fit.
        self.sample = registry.sample_size if len(ctx.inventory.order) > registry.sample_above else 0

    def first_reason(self, node: NodeSnapshot) -> Reason | None:
        ctx = self.ctx
        for fn in self.filters:
            reason = fn(ctx, node)
            if reason is not None:
                return reason
        return None

    def walk_reason(self, node: NodeSnapshot) -> Reason | None:
        """first_reason for a node the stream gave (one every pre-filter kept)."""
        ctx = self.ctx
        for fn in self.walk_filters:
            reason = fn(ctx, node)
            if reason is not None:
                return reason
        return None

    def key(self, node: NodeSnapshot) -> float:
        """K: the built-in (indexed) part of the score."""
        ctx = self.ctx
        total = 0.0
        for fn, weight in self.indexed:
            total += weight * _clamp(fn(ctx, node))
        return total

    def extra(self, node: NodeSnapshot) -> float:
        """The other scorers' part, at most pmax."""
        ctx = self.ctx
        total = 0.0
        for fn, weight in self.plugins:
            total += weight * _clamp(fn(ctx, node))
        return total

    def breakdown(self, node: NodeSnapshot) -> dict[str, float]:
        """Each scorer's weighted part of the node's score, by name (what explain shows)."""
        ctx = self.ctx
        return {name: weight * _clamp(fn(ctx, node)) for name, fn, weight in self.named}

    def score(self, node: NodeSnapshot) -> float:
        key = self.key(node)
        return key + self.extra(node) if self.plugins else key

    def bound(self, *, holds_weights: bool, gpuless: bool) -> float:
        """The highest K any node of a segment can have."""
        total = 0.0
        for fn, weight in self.indexed:
            if fn is binpack:
                top = 1.0
            elif fn is weights:
                top = 1.0 if holds_weights else 0.0
            elif fn is spare_gpus:
                top = 1.0 if gpuless and self.ctx.gpu_class is None else 0.0
            else:  # pragma: no cover - INDEXED holds only the three above
                top = 1.0
            total += weight * top
        return total

    def reject(self, node: NodeSnapshot, reason: Reason) -> Rejection:
        profile = self.ctx.profile
        return Rejection(
            profile.id,
            profile.name,
            node.id,
            node.name,
            reason.code,
            reason.message(),
            reason.params,
            reason.template,
        )

    def reject_profile(self, reason: Reason) -> Rejection:
        profile = self.ctx.profile
        return Rejection(
            profile.id,
            profile.name,
            None,
            None,
            reason.code,
            reason.message(),
            reason.params,
            reason.template,
        )

    def check(self) -> list[Reason]:
        ctx = self.ctx
        return [reason for entry in ctx.registry.checks() for reason in entry.fn(ctx)]


class _Stream:
    """Nodes in descending (K, then ascending rank) order, merged lazily from sorted segments.

    A lazy segment sits in the heap at its upper bound and is only computed when nothing
    left can score above that bound, so the CPU-profile walk never scores GPU nodes while a
    node without GPUs can take the replica.
    """

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, int, object]] = []
        self.seq = 0

    def _push(self, neg_key: float, rank: int, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (neg_key, rank, self.seq, kind, payload))

    def add_sorted(self, items: Iterator[Item]) -> None:
        first = next(items, None)
        if first is not None:
            self._push(-first[0], first[1], _ITER, (first, items))

    def add_lazy(self, bound: float, produce: Callable[[], Iterator[Item]]) -> None:
        self._push(-bound, -1, _LAZY, produce)

    def bound(self) -> float | None:
        return -self.heap[0][0] if self.heap else None

    def pop(self) -> Item | None:
        heap = self.heap
        while heap:
            _, _, _, kind, payload = heapq.heappop(heap)
            if kind == _LAZY:
                self.add_sorted(cast(Callable[[], Iterator[Item]], payload)())
                continue
            item, rest = cast(tuple[Item, Iterator[Item]], payload)
            following = next(rest, None)
            if following is not None:
                self._push(-following[0], following[1], _ITER, (following, rest))
            return item
        return None


def _walk_buckets(ev: _Evaluator, buckets: list[list[int]], ks: Iterable[int], skip: set[int]) -> Iterator[Item]:
    inventory = ev.ctx.inventory
    order = inventory.order
    nodes = ev.nodes
    pre = ev.pre
    narrowed = bool(pre.members)
    for k in ks:
        # Every node walked here has k free GPUs of the class and does not hold the weights (those
        # are in `skip`), so the built-in scorers give each the same K: computed once per bucket.
        key: float | None = None
        for rank in buckets[k]:
            node_id = order[rank]
            if node_id in skip or (narrowed and not pre.allows(node_id)):
                continue
            if key is None:
                key = ev.key(nodes[node_id])
            yield (key, rank, node_id)


def _stream(ev: _Evaluator) -> _Stream:
    ctx = ev.ctx
    inventory = ctx.inventory
    nodes = ev.nodes
    stream = _Stream()
    multi = ctx.multi_node
    pre = ev.pre
    holders = inventory.weights_nodes(ctx.request.source)
    skip = set(holders)
    cls = ctx.gpu_class
    if cls is not None:
        need = ctx.gpus
        held = [
            (ev.key(nodes[i]), inventory.rank(i), i)
            for i in holders
            if inventory.free_count(i, cls) >= need and cls in inventory.gpu_classes(i) and pre.allows(i)
        ]
        held.sort(key=_item_order)
        stream.add_sorted(iter(held))
        buckets = inventory.free_buckets(cls)
        ks = range(len(buckets) - 1, need - 1, -1) if multi else range(need, len(buckets))
        stream.add_sorted(_walk_buckets(ev, buckets, ks, skip))
        return stream

    memory, cores = ctx.memory, ctx.cores

    def room(node_id: int) -> bool:
        node = nodes[node_id]
        if not pre.allows(node_id):
            return False
        total = node.memory_total_bytes
        if memory and total is not None and inventory.memory_claimed(node_id) + memory > total:
            return False
        cpus = node.cpus
        return not (cores and cpus is not None and inventory.cores_claimed(node_id) + cores > cpus + CORE_EPSILON)

    sample = ev.sample

    def segment(ids: list[int]) -> Callable[[], Iterator[Item]]:
        def produce() -> Iterator[Item]:
            if not sample or len(ids) <= sample:
                items = [(ev.key(nodes[i]), inventory.rank(i), i) for i in ids if i not in skip and room(i)]
                items.sort(key=_item_order)
                return iter(items)
            return chunks()

        def chunks() -> Iterator[Item]:
            # Sampled: the nodes with room in name order, a sample's worth at a time, each sorted.
            chunk: list[Item] = []
            for i in ids:
                if i in skip or not room(i):
                    continue
                chunk.append((ev.key(nodes[i]), inventory.rank(i), i))
                if len(chunk) >= sample:
                    chunk.sort(key=_item_order)
                    yield from chunk
                    chunk = []
            chunk.sort(key=_item_order)
            yield from chunk

        return produce

    held = [(ev.key(nodes[i]), inventory.rank(i), i) for i in holders if room(i)]
    held.sort(key=_item_order)
    stream.add_sorted(iter(held))
    stream.add_lazy(ev.bound(holds_weights=False, gpuless=True), segment(inventory.gpuless_nodes()))
    stream.add_lazy(ev.bound(holds_weights=False, gpuless=False), segment(inventory.gpu_nodes()))
    return stream


def _pick_single(
    ev: _Evaluator, stream: _Stream, rejections: list[Rejection] | None, seen: set[int] | None
) -> list[int] | None:
    nodes = ev.nodes
    pmax = ev.pmax
    has_plugins = bool(ev.plugins)
    sample = ev.sample
    fitted = 0
    best_score = 0.0
    best: int | None = None
    while True:
        bound = stream.bound()
        if bound is None or (best is not None and (bound + pmax <= best_score or (sample and fitted >= sample))):
            break
        item = stream.pop()
        if item is None:
            break
        key, _, node_id = item
        node = nodes[node_id]
        if seen is not None:
            seen.add(node_id)
        reason = ev.walk_reason(node)
        if reason is not None:
            if rejections is not None:
                rejections.append(ev.reject(node, reason))
            continue
        fitted += 1
        score = key + ev.extra(node) if has_plugins else key
        # Walked in (-K, rank) order, so an equal score found later loses the tie.
        if best is None or score > best_score:
            best, best_score = node_id, score
    return None if best is None else [best]


Entry = tuple[float, float, int, int]  # (-score, -K, rank, node id): ascending is best first


def _sum(top: list[Entry]) -> float:
    total = 0.0
    for entry in top:
        total -= entry[0]
    return total


def _best_group[K: (Group, tuple[Group, str])](
    tops: Mapping[K, list[Entry]], need: int, tier: Callable[[K], int] | None = None
) -> K | None:
    best: K | None = None
    best_key: tuple[int, float] = (0, 0.0)
    for group in sorted(tops):
        top = tops[group]
        if len(top) < need:
            continue
        key = (tier(group) if tier is not None else 0, -_sum(top))
        if best is None or key < best_key:
            best, best_key = group, key
    return best


def _settled(tops: dict[Group, list[Entry]], groups: Iterable[Group], need: int, cap: float) -> bool:
    """Whether no node still to come (each scoring at most `cap`) can change the chosen group or nodes."""
    best = _best_group(tops, need)
    if best is None:
        return False
    top = tops[best]
    if cap > -top[-1][0]:
        return False
    best_sum = _sum(top)
    for group in groups:
        if group == best:
            continue
        values = sorted([-e[0] for e in tops.get(group, ())] + [cap] * need, reverse=True)[:need]
        bound = 0.0
        for value in values:
            bound += value
        if bound > best_sum or (bound == best_sum and group < best):
            return False
    return True


def _keep(tops: dict, key: object, entry: Entry, need: int) -> None:  # type: ignore[type-arg]
    top = tops.setdefault(key, [])
    insort(top, entry)
    if len(top) > need:
        top.pop()


def _pick_multi(
    ev: _Evaluator, stream: _Stream, rejections: list[Rejection] | None, seen: set[int] | None
) -> tuple[list[int] | None, dict[Group, int], Group | None, str | None]:
    ctx = ev.ctx
    nodes = ev.nodes
    pre = ev.pre
    need = ctx.nodes
    pmax = ev.pmax
    finer = bool(pre.prefer_maps) or pre.tiered  # a finer or a lower-tier group may come last
    groups = pre.all_groups(ctx) if not finer else []
    tops: dict[Group, list[Entry]] = {}
    subtops: dict[tuple[Group, str], list[Entry]] = {}
    counts: dict[Group, int] = {}
    sample = ev.sample
    fitted = 0
    leaves = bool(pre.prefer_maps)
    tiered = pre.tiered
    group_whole = sub_whole = False
    while True:
        bound = stream.bound()
        if bound is None or (not finer and tops and _settled(tops, groups, need, bound + pmax)):
            break
        # Sampled: stop once a group of the lowest tier holds the replica (a leaf of one, when the
        # pre-filters name leaves).
        if sample and fitted >= sample and (sub_whole if leaves else group_whole):
            break
        item = stream.pop()
        if item is None:
            break
        key, rank, node_id = item
        node = nodes[node_id]
        if seen is not None:
            seen.add(node_id)
        reason = ev.walk_reason(node)
        if reason is not None:
            if rejections is not None:
                rejections.append(ev.reject(node, reason))
            continue
        fitted += 1
        entry = (-(key + ev.extra(node)), -key, rank, node_id)
        in_groups = pre.groups(node_id)
        for group in in_groups:
            counts[group] = counts.get(group, 0) + 1
            _keep(tops, group, entry, need)
            if counts[group] == need and not group_whole:
                group_whole = not tiered or pre.tier(group) == 0
        if finer:
            for sub in pre.preferred(node_id, in_groups):
                _keep(subtops, sub, entry, need)
                if not sub_whole and len(subtops[sub]) == need:
                    sub_whole = not tiered or pre.tier(sub[0]) == 0
    best_sub = _best_group(subtops, need, (lambda sub: pre.tier(sub[0])) if tiered else None)
    best = _best_group(tops, need, pre.tier if tiered else None)
    # A finer group first (one leaf), unless a group of a lower tier holds the replica whole.
    if best_sub is not None and (best is None or not tiered or pre.tier(best_sub[0]) <= pre.tier(best)):
        return [entry[3] for entry in subtops[best_sub]], counts, best_sub[0], best_sub[1]
    if best is None:
        return None, counts, None, None
    return [entry[3] for entry in tops[best]], counts, best, None


def _place_profile(
    inventory: Inventory, request: ReplicaRequest, profile: ProfileSpec, registry: Registry, collect: bool
) -> tuple[Placement | None, list[Rejection]]:
    ctx = PlacementContext(inventory, request, profile, registry)
    ev = _Evaluator(ctx)
    refused = ev.check()
    if refused:
        return None, [ev.reject_profile(reason) for reason in refused]
    rejections: list[Rejection] | None = [] if collect else None
    seen: set[int] | None = set() if collect else None
    stream = _stream(ev)
    counts: dict[Group, int] = {}
    group: Group | None = None
    subgroup: str | None = None
    if ctx.multi_node:
        chosen, counts, group, subgroup = _pick_multi(ev, stream, rejections, seen)
    else:
        chosen = _pick_single(ev, stream, rejections, seen)
    if chosen is None:
        if rejections is None or seen is None:
            return None, []
        _refuse_unseen(ev, seen, rejections)
        _summarise(ev, rejections, counts, len(rejections))
        return None, rejections
    shards = []
    for rank, node_id in enumerate(chosen):
        node = inventory.nodes[node_id]
        gpus: tuple[int, ...] = ()
        if ctx.gpu_class is not None:
            chosen_gpus = choose_gpus(inventory, node_id, ctx.gpu_class, ctx.gpus)
            if chosen_gpus is None:
                raise PlacementConflict(f"{node.name} passed every filter without {ctx.gpus} free GPUs")
            gpus = chosen_gpus
        shards.append(ShardPlan(rank, node_id, node.name, gpus, ctx.memory, ctx.cores))
    found = rejections or []
    return Placement(profile, shards, list(found), group, subgroup), found


# Filters whose answer follows from the node and the profile alone, never from claims.
_NODE_ONLY = frozenset({ready_filter, not_cordoned_filter, node_selector_filter})
# The refusals kept for one profile (_short_refusals), per node, before they are dropped.
_KEPT_PER_NODE = 4


def _short_refusals(ev: _Evaluator) -> dict[tuple[int, int], Rejection] | None:
    """For a GPU profile: (node id, its free GPUs of the class, -1 without the class) -> the refusal
    of a node the capacity index skips (no class, or fewer free GPUs than a shard needs), filled as
    nodes are refused. Such a node's first reason is one of _NODE_ONLY's, gpu_class's or free_gpus',
    which read nothing of the claims but that count, when those are the only filters before
    free_gpus; so the refusal is kept per snapshot and the next placement that finds the node with
    the same count takes it as it is (a profile that fits nowhere, a fallback's first choice,
    refuses most of the fleet again on each placement). None where another filter comes first."""
    ctx = ev.ctx
    if ctx.gpu_class is None or not ctx.gpus:
        return None
    filters = ev.filters
    if gpu_class_filter not in filters or free_gpus_filter not in filters:
        return None
    before = filters[: filters.index(free_gpus_filter)]
    if not _NODE_ONLY.union((gpu_class_filter,)).issuperset(before):
        return None
    profile = ctx.profile
    # Everything those refusals read but the node and its count: the profile's id and name (in each
    # refusal), its class and GPUs per shard, its node selector, the filters asked.
    key = (
        "short_refusals",
        profile.id,
        profile.name,
        ctx.gpu_class,
        ctx.gpus,
        tuple(sorted(profile.node_selector.items())),
        before,
    )
    return ctx.inventory.memo(key, dict)  # type: ignore[no-any-return]


def _refuse_unseen(ev: _Evaluator, seen: set[int], rejections: list[Rejection]) -> None:
    """The first refusal of every node the walk did not reach, in name order."""
    ctx = ev.ctx
    inventory = ctx.inventory
    nodes = ev.nodes
    kept = _short_refusals(ev)
    if kept is not None and len(kept) > _KEPT_PER_NODE * len(inventory.order):
        kept.clear()  # a long-lived inventory (the simulator's) meets ever more counts: start again
    cls = ctx.gpu_class
    need = ctx.gpus
    for node_id in inventory.order:
        if node_id in seen:
            continue
        if kept is not None:
            free = inventory.free_count(node_id, cls) if cls in inventory.gpu_classes(node_id) else -1
            if free < need:
                known = kept.get((node_id, free))
                if known is None:
                    node = nodes[node_id]
                    reason = ev.first_reason(node)
                    if reason is None:  # pragma: no cover - gpu_class or free_gpus refuses it
                        raise PlacementConflict(f"{node.name}: the capacity index and the filters disagree")
                    known = kept[node_id, free] = ev.reject(node, reason)
                rejections.append(known)
                continue
        node = nodes[node_id]
        reason = ev.first_reason(node)
        if reason is not None:
            rejections.append(ev.reject(node, reason))


def _summarise(ev: _Evaluator, rejections: list[Rejection], counts: dict[Group, int], refused: int) -> None:
    ctx = ev.ctx
    if ctx.multi_node:
        pre = ev.pre
        for group in sorted(counts):
            if counts[group] < ctx.nodes:
                rejections.append(ev.reject_profile(reasons.fabric_count(pre.label(group), counts[group], ctx.nodes)))
        groups = [g for g in pre.all_groups(ctx) if g] if pre.group_maps else []
        rejections.append(ev.reject_profile(reasons.no_fabric_fits(ctx.profile.name, ctx.nodes, len(groups))))
    else:
        rejections.append(ev.reject_profile(reasons.no_fit(ctx.profile.name, refused, len(ctx.inventory.nodes))))


def place(
    inventory: Inventory, request: ReplicaRequest, *, registry: Registry | None = None, collect: bool = True
) -> PlacementResult:
    """Where one replica of the request goes, or None, with the refusals met.

    Nothing is claimed: pass the placement to `inventory.apply_request` (or `apply`) to claim it.
    `collect=False` skips building the refusals of nodes (dry runs that only need the answer).
    """
    registry = registry or REGISTRY
    found: list[Rejection] = []
    for profile in ordered_profiles(request.profiles):
        placement, rejections = _place_profile(inventory, request, profile, registry, collect)
        found.extend(rejections)
        if placement is not None:
            placement.rejections = list(found)
            return PlacementResult(placement, found)
    return PlacementResult(None, found)


def usable_nodes(
    inventory: Inventory,
    request: ReplicaRequest,
    *,
    nodes: Iterable[int] | None = None,
    registry: Registry | None = None,
) -> set[int]:
    """The nodes (of `nodes`, default all) on which some profile of the request could place a
    shard now: every filter and pre-filter passes, as placement asks them."""
    registry = registry or REGISTRY
    ids = list(inventory.order if nodes is None else nodes)
    found: set[int] = set()
    for profile in ordered_profiles(request.profiles):
        ev = _Evaluator(PlacementContext(inventory, request, profile, registry))
        if ev.check():
            continue
        for node_id in ids:
            if node_id not in found and ev.first_reason(inventory.nodes[node_id]) is None:
                found.add(node_id)
    return found


def explain(
    inventory: Inventory, request: ReplicaRequest, *, registry: Registry | None = None, limit: int | None = None
) -> list[ProfileExplain]:
    """For each profile (in the order place() tries them), every node with every reason it is refused
    (all filters run, not just the first), the score of each node that passes, and whether the profile
    fits (with the placement it would get). Nodes that fit come first, best first; then the rest by name.

    With `limit`, only that many nodes per profile are spelled out (those that fit first, best first):
    the others are counted (ProfileExplain.more_fit, more_refused by the first reason's code). Only the
    nodes of the profile's GPU class are run through the filters then; a node without it is refused
    by gpu_class whatever else is true of it.
    """
    registry = registry or REGISTRY
    return [
        _explain_profile(inventory, request, profile, registry, limit) for profile in ordered_profiles(request.profiles)
    ]


Fit = tuple[float, float, int, int, dict[str, float] | None]  # (-score, -K, rank, node id, each scorer's part)


@dataclass(slots=True)
class _Sorted:
    """One profile's nodes as explain() sorts them, before any is spelled out."""

    fitting: list[Fit]  # the nodes that fit, unordered
    refused: list[int]  # the nodes refused, in the inventory's (name) order
    first: dict[int, Reason]  # with a limit: the first reason of each refused node (_FREE_GPUS: the index's)
    every: dict[int, list[Rejection]]  # without a limit: every refusal of each refused node
    counts: dict[Group, int]  # across nodes: how many nodes that fit each group holds


def _explain_profile(
    inventory: Inventory, request: ReplicaRequest, profile: ProfileSpec, registry: Registry, limit: int | None
) -> ProfileExplain:
    """explain() for one profile: its own refusals, its nodes sorted and the first `limit` of them
    spelled out (all without a limit), and the placement it would get."""
    ctx = PlacementContext(inventory, request, profile, registry)
    ev = _Evaluator(ctx)
    profile_reasons = [ev.reject_profile(reason) for reason in ev.check()]
    classed, short = _index_split(ctx, limit)
    found = _sort_nodes(ev, limit, classed, short)
    fitting, refused_ids = found.fitting, found.refused
    fitting.sort(key=lambda entry: entry[:3])
    shown = len(fitting) + len(refused_ids) if limit is None else limit
    verdicts = _fit_verdicts(ev, fitting[:shown])
    room = max(shown - len(verdicts), 0)
    more_refused = _count_refused(ev, refused_ids[room:], found.first)
    verdicts.extend(_refused_verdicts(ev, refused_ids[:room], found.every))
    placement = None
    if not profile_reasons:
        placement, _ = _place_profile(inventory, request, profile, registry, collect=False)
        if placement is None:
            _summarise(ev, profile_reasons, found.counts, len(refused_ids))
    return ProfileExplain(
        profile,
        placement is not None,
        verdicts,
        profile_reasons,
        placement,
        more_fit=max(len(fitting) - shown, 0),
        more_refused=more_refused,
    )


def _index_split(ctx: PlacementContext, limit: int | None) -> tuple[set[int] | None, set[int]]:
    """With a limit, the capacity index says which nodes no filter could pass: those without the
    class, and those with too few of its GPUs free (the second set); only the rest (the first) are
    run through the filters. (None, empty) without a limit or for a CPU profile: every node is."""
    cls = ctx.gpu_class
    classed: set[int] | None = None
    short: set[int] = set()
    if limit is not None and cls is not None:
        classed = set()
        inventory = ctx.inventory
        order = inventory.order
        for k, bucket in enumerate(inventory.free_buckets(cls)):
            for position in bucket:
                (classed if k >= ctx.gpus else short).add(order[position])
    return classed, short


def _sort_nodes(ev: _Evaluator, limit: int | None, classed: set[int] | None, short: set[int]) -> _Sorted:
    """Which nodes fit, and the score of each that does (every scorer run once, its parts kept); why
    the others are refused. The one loop over every node: kept whole, with locals, as it is most of
    explain's cost."""
    ctx = ev.ctx
    inventory = ctx.inventory
    nodes = inventory.nodes
    rank = inventory.rank
    pre = ev.pre
    multi = ctx.multi_node
    cls = ctx.gpu_class
    counts: dict[Group, int] = {}
    fitting: list[Fit] = []
    refused_ids: list[int] = []
    first: dict[int, Reason] = {}
    every: dict[int, list[Rejection]] = {}
    filters = ev.filters
    named = [(name, fn, weight, fn in INDEXED) for name, fn, weight in ev.named]
    holders = set(inventory.weights_nodes(ctx.request.source))
    keys: dict[tuple[int, bool], float] = {}
    for node_id in inventory.order:
        if classed is not None and node_id not in classed:
            refused_ids.append(node_id)
            if node_id in short:
                first[node_id] = _FREE_GPUS
            continue
        node = nodes[node_id]
        if limit is None:  # every node spelled out: all its reasons at once
            found = _all_reasons(ctx, filters, node)
            if found:
                refused_ids.append(node_id)
                every[node_id] = found
                continue
        else:
            reason = ev.first_reason(node)
            if reason is not None:
                refused_ids.append(node_id)
                first[node_id] = reason
                continue
        if classed is not None:
            # With a limit, a GPU profile's built-in score K follows from the node's free GPUs of
            # the class and whether it holds the weights: computed once per pair. Each scorer's
            # part is spelled out below only for the nodes shown.
            pair = (inventory.free_count(node_id, cls), node_id in holders)  # type: ignore[arg-type]
            key = keys.get(pair)
            if key is None:
                key = keys[pair] = ev.key(node)
            score = key + ev.extra(node) if ev.plugins else key
            fitting.append((-score, -key, rank(node_id), node_id, None))
        else:
            parts = {}
            score = key = 0.0
            for name, fn, weight, built_in in named:
                part = weight * _clamp(fn(ctx, node))
                parts[name] = part
                score += part
                if built_in:
                    key += part
            fitting.append((-score, -key, rank(node_id), node_id, parts))
        if multi:
            for group in pre.groups(node_id):
                counts[group] = counts.get(group, 0) + 1
    return _Sorted(fitting, refused_ids, first, every, counts)


def _fit_verdicts(ev: _Evaluator, shown: list[Fit]) -> list[NodeVerdict]:
    """The verdicts of the nodes that fit and are spelled out, best first: each scorer's part (worked
    out now where the loop kept only the score), their groups across nodes and the pre-filters' notes."""
    nodes = ev.nodes
    pre = ev.pre
    multi = ev.ctx.multi_node
    noted = bool(pre.notes)
    verdicts: list[NodeVerdict] = []
    for neg_score, _, _, node_id, known in shown:
        parts = known if known is not None else ev.breakdown(nodes[node_id])
        verdict = NodeVerdict(node_id, nodes[node_id].name, [], True, -neg_score, parts)
        if multi:
            verdict.groups = pre.groups(node_id)
            verdict.prefer = pre.preferred(node_id, verdict.groups)
        if noted:
            verdict.notes = pre.node_notes(node_id)
        verdicts.append(verdict)
    return verdicts


def _count_refused(ev: _Evaluator, node_ids: list[int], first: dict[int, Reason]) -> dict[str, tuple[int, Rejection]]:
    """The refused nodes not spelled out, counted by the first reason's code, each code with the first
    such node's refusal as the example. The index's refusals (no class, too few free) are asked of the
    filter for that first node only."""
    ctx = ev.ctx
    nodes = ev.nodes
    more_refused: dict[str, tuple[int, Rejection]] = {}
    for node_id in node_ids:
        reason = first.get(node_id)
        code = (
            reasons.CODE_FREE_GPUS
            if reason is _FREE_GPUS
            else reasons.CODE_GPU_CLASS
            if reason is None
            else reason.code
        )
        tally = more_refused.get(code)
        if tally is not None:
            more_refused[code] = (tally[0] + 1, tally[1])
            continue
        node = nodes[node_id]
        if reason is None or reason is _FREE_GPUS:
            reason = first_filter(ctx, node, gpu_class_filter if reason is None else free_gpus_filter)
        more_refused[code] = (1, ev.reject(node, reason))
    return more_refused


def _refused_verdicts(ev: _Evaluator, node_ids: list[int], every: dict[int, list[Rejection]]) -> list[NodeVerdict]:
    """The verdicts of the refused nodes spelled out, with every reason each is refused."""
    ctx = ev.ctx
    nodes = ev.nodes
    filters = ev.filters
    pre = ev.pre
    noted = bool(pre.notes)
    verdicts = []
    for node_id in node_ids:
        node = nodes[node_id]
        found = every.get(node_id) or _all_reasons(ctx, filters, node)
        verdict = NodeVerdict(node_id, node.name, found, False, None)
        if noted:
            verdict.notes = pre.node_notes(node_id)
        verdicts.append(verdict)
    return verdicts


def judge(
    inventory: Inventory,
    request: ReplicaRequest,
    profile: ProfileSpec,
    node_ids: Iterable[int],
    *,
    registry: Registry | None = None,
) -> tuple[list[Rejection], list[NodeVerdict]]:
    """What placement says, for one profile, of the given nodes only (those a placed replica runs
    on, asked with its own claims released): the profile's own refusals (quotas), and for each node
    every refusal, or, where none, its score with each scorer's part. As explain() says of them,
    without walking the rest of the fleet."""
    ctx = PlacementContext(inventory, request, profile, registry or REGISTRY)
    ev = _Evaluator(ctx)
    verdicts = []
    for node_id in node_ids:
        node = inventory.nodes[node_id]
        found = _all_reasons(ctx, ev.filters, node)
        if found:
            verdicts.append(NodeVerdict(node_id, node.name, found, False, None))
            continue
        parts = ev.breakdown(node)
        verdict = NodeVerdict(node_id, node.name, [], True, sum(parts.values()), parts)
        verdict.notes = ev.pre.node_notes(node_id) if ev.pre.notes else {}
        verdicts.append(verdict)
    return [ev.reject_profile(reason) for reason in ev.check()], verdicts


def _all_reasons(ctx: PlacementContext, filters: tuple[FilterFn, ...], node: NodeSnapshot) -> list[Rejection]:
    """Every filter's refusal of the node (what explain shows): spelled out with locals, as this is
    most of explain's cost."""
    found: list[Rejection] = []
    profile = ctx.profile
    for fn in filters:
        reason = fn(ctx, node)
        if reason is not None:
            found.append(
                Rejection(
                    profile.id,
                    profile.name,
                    node.id,
                    node.name,
                    reason.code,
                    reason.message(),
                    reason.params,
                    reason.template,
                )
            )
    return found


_FREE_GPUS = reasons.Reason(reasons.CODE_FREE_GPUS, "", {})  # marks a node the index finds too few free GPUs on


def first_filter(ctx: PlacementContext, node: NodeSnapshot, fn: FilterFn) -> Reason:
    """What a built-in filter says of a node the index already knows it refuses."""
    reason = fn(ctx, node)
    if reason is None:  # pragma: no cover - the index and the filter agree by construction
        raise PlacementConflict(f"{node.name}: the capacity index and the filters disagree")
    return reason
