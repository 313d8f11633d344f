"""The plugins placement runs: filters, scorers, profile checks and snapshot fields.

Built-in plugins register themselves when `apps.cluster.placement` is imported; other apps
(fabrics, facility) register theirs from their AppConfig.ready(). Registering a name again
replaces the earlier entry, so a ready() that runs twice does no harm.

- A filter is `fn(ctx, node) -> Reason | None`: a hard constraint; None lets the node through.
  Filters run in ascending `order` (then name). `place` stops at a node's first reason;
  `explain` runs every filter and shows every reason. A filter may say with `applies(ctx)`
  which profiles it can refuse a node for at all (a label filter only a profile with a node
  selector); for the others it is not called, which spares a call per node.
- A scorer is `fn(ctx, node) -> float` in [0, 1] (clamped), higher is better; a node's score
  is the weighted sum. Scorers only order the nodes every filter let through.
- A check is `fn(ctx) -> Iterable[Reason]`: a constraint on the whole replica (quotas), run
  once per profile before any node is looked at.
- A pre-filter is `fn(ctx, index) -> PreFilterResult | None`, run once per profile before any node is
  walked (as the Kubernetes scheduler's PreFilter): it narrows the nodes the replica may use at
  all, saying why for each node it leaves out, and for a replica across nodes it groups them
  (one group per physical fabric, NVLink domain, rack): every shard of one replica comes from
  one group, and a finer group that can hold the whole replica (a leaf) is preferred. Its
  `index(inventory)`, when given, is built once per inventory snapshot from the nodes (which
  never change within a snapshot) and shared by its copies, and handed to `fn` (None without
  one). `static=True` says its answer does not depend on claims,
  so dry runs may treat a node it leaves out as refused whatever is stopped.
- Sampling (`sample_above`, `sample_size`): on a fleet of more than `sample_above` nodes, a
  walk stops once `sample_size` nodes have passed every filter, and the best of those wins (the
  Kubernetes scheduler's percentageOfNodesToScore, taken in the walk's order rather than from a
  rotating start). See pipeline.py for what it gives up.
- A snapshot field is a named entry of `NodeSnapshot.extra` with its default, read with
  `snapshot_field(node, name)`; the Django side fills the registered fields. The app that owns one
  declares it once as a `SnapshotField[T]` (T: a TypedDict or list of them, declared beside it), and
  both what fills it (a snapshot part, apps.cluster.extensions, and the simulator) and its rules
  go through that: `put` and `get` are checked by mypy against T, which `extra` itself cannot be
  (placement does not know what the other apps keep there).
- A profile field (llmgw.fields.ProfileField) is a setting a profile declares for a plugin's rule
  (facility's keep_within): the catalog reads, checks and shows it with the fields of every
  profile, and `ProfileSpec.extra` carries its value to placement, read with
  `profile_field(profile, name)`. It holds a scalar, so that its value can key a cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llmgw.fields import SCALARS, ProfileField

if TYPE_CHECKING:
    from .context import PlacementContext
    from .model import Inventory, NodeSnapshot, PreFilterResult, ProfileSpec
    from .reasons import Reason

FilterFn = Callable[["PlacementContext", "NodeSnapshot"], "Reason | None"]
ScorerFn = Callable[["PlacementContext", "NodeSnapshot"], float]
CheckFn = Callable[["PlacementContext"], "Iterable[Reason]"]


AppliesFn = Callable[["PlacementContext"], Any]
PreFilterFn = Callable[["PlacementContext", Any], "PreFilterResult | None"]
IndexFn = Callable[["Inventory"], Any]


class SnapshotField[T]:
    """A named entry of NodeSnapshot.extra and the type of what it holds (see the module docstring)."""

    __slots__ = ("default", "name")

    def __init__(self, name: str, default: T | None = None) -> None:
        self.name = name
        self.default = default  # what snapshot_field() answers for a node nothing filled

    def get(self, node: NodeSnapshot) -> T | None:
        """The node's value, None when nothing filled it."""
        value: T | None = node.extra.get(self.name)
        return value

    def put(self, node: NodeSnapshot, value: T) -> None:
        node.extra[self.name] = value

    def drop(self, node: NodeSnapshot) -> None:
        node.extra.pop(self.name, None)

    def register(self, registry: Registry) -> None:
        registry.register_snapshot_field(self.name, self.default)


@dataclass(frozen=True, slots=True)
class FilterEntry:
    name: str
    fn: FilterFn
    order: int
    applies: AppliesFn | None = None  # None: every profile


@dataclass(frozen=True, slots=True)
class ScorerEntry:
    name: str
    fn: ScorerFn
    weight: float


@dataclass(frozen=True, slots=True)
class PreFilterEntry:
    name: str
    fn: PreFilterFn
    order: int  # where its refusals stand among the filters' (a node's first reason)
    index: IndexFn | None = None
    applies: AppliesFn | None = None
    static: bool = False


@dataclass(frozen=True, slots=True)
class CheckEntry:
    name: str
    fn: CheckFn
    order: int


SAMPLE_ABOVE = 1000  # fleets of at most this many nodes are always scored whole
SAMPLE_SIZE = 100  # beyond it, the walk scores this many nodes that pass every filter


class Registry:
    def __init__(self) -> None:
        self.sample_above = SAMPLE_ABOVE
        self.sample_size = SAMPLE_SIZE
        self._filters: dict[str, FilterEntry] = {}
        self._scorers: dict[str, ScorerEntry] = {}
        self._checks: dict[str, CheckEntry] = {}
        self._prefilters: dict[str, PreFilterEntry] = {}
        self._fields: dict[str, Any] = {}
        self._profile_fields: dict[str, ProfileField] = {}
        self._cache: dict[str, tuple[Any, ...]] = {}

    def copy(self) -> Registry:
        other = Registry()
        other._filters = dict(self._filters)
        other._scorers = dict(self._scorers)
        other._checks = dict(self._checks)
        other._prefilters = dict(self._prefilters)
        other._fields = dict(self._fields)
        other._profile_fields = dict(self._profile_fields)
        other.sample_above = self.sample_above
        other.sample_size = self.sample_size
        return other

    def register_filter(self, fn: FilterFn, *, name: str, order: int, applies: AppliesFn | None = None) -> FilterFn:
        self._filters[name] = FilterEntry(name, fn, order, applies)
        self._cache.clear()
        return fn

    def register_scorer(self, fn: ScorerFn, *, name: str, weight: float) -> ScorerFn:
        if weight < 0:
            raise ValueError(f"scorer {name}: a weight cannot be negative (score low instead)")
        self._scorers[name] = ScorerEntry(name, fn, float(weight))
        self._cache.clear()
        return fn

    def register_check(self, fn: CheckFn, *, name: str, order: int) -> CheckFn:
        self._checks[name] = CheckEntry(name, fn, order)
        self._cache.clear()
        return fn

    def register_prefilter(
        self,
        fn: PreFilterFn,
        *,
        name: str,
        order: int,
        index: IndexFn | None = None,
        applies: AppliesFn | None = None,
        static: bool = False,
    ) -> PreFilterFn:
        self._prefilters[name] = PreFilterEntry(name, fn, order, index, applies, static)
        self._cache.clear()
        return fn

    def register_snapshot_field(self, name: str, default: Any) -> None:
        self._fields[name] = default

    def register_profile_field(self, declared: ProfileField) -> ProfileField:
        if declared.kind not in SCALARS:
            raise ValueError(f"profile field {declared.name}: a plugin's field holds a scalar")
        self._profile_fields[declared.name] = declared
        return declared

    def unregister(self, name: str) -> None:
        """Remove a filter, scorer or check of that name (tests, or an app replacing a built-in)."""
        self._filters.pop(name, None)
        self._scorers.pop(name, None)
        self._checks.pop(name, None)
        self._prefilters.pop(name, None)
        self._cache.clear()

    def filters(self) -> tuple[FilterEntry, ...]:
        cached = self._cache.get("filters")
        if cached is None:
            cached = self._cache["filters"] = tuple(sorted(self._filters.values(), key=lambda e: (e.order, e.name)))
        return cached

    def scorers(self) -> tuple[ScorerEntry, ...]:
        cached = self._cache.get("scorers")
        if cached is None:
            cached = self._cache["scorers"] = tuple(self._scorers.values())
        return cached

    def checks(self) -> tuple[CheckEntry, ...]:
        cached = self._cache.get("checks")
        if cached is None:
            cached = self._cache["checks"] = tuple(sorted(self._checks.values(), key=lambda e: (e.order, e.name)))
        return cached

    def prefilters(self) -> tuple[PreFilterEntry, ...]:
        cached = self._cache.get("prefilters")
        if cached is None:
            cached = self._cache["prefilters"] = tuple(
                sorted(self._prefilters.values(), key=lambda e: (e.order, e.name))
            )
        return cached

    def snapshot_fields(self) -> dict[str, Any]:
        return dict(self._fields)

    def snapshot_field(self, node: NodeSnapshot, name: str) -> Any:
        if name in node.extra:
            return node.extra[name]
        return self._fields[name]

    def profile_fields(self) -> tuple[ProfileField, ...]:
        """The profile fields plugins declared, in the order they registered."""
        return tuple(self._profile_fields.values())

    def profile_field(self, profile: ProfileSpec, name: str) -> Any:
        if name in profile.extra:
            return profile.extra[name]
        return self._profile_fields[name].default


REGISTRY = Registry()


def register_filter(fn: FilterFn, *, name: str, order: int, applies: AppliesFn | None = None) -> FilterFn:
    return REGISTRY.register_filter(fn, name=name, order=order, applies=applies)


def register_scorer(fn: ScorerFn, *, name: str, weight: float) -> ScorerFn:
    return REGISTRY.register_scorer(fn, name=name, weight=weight)


def register_check(fn: CheckFn, *, name: str, order: int) -> CheckFn:
    return REGISTRY.register_check(fn, name=name, order=order)


def register_prefilter(
    fn: PreFilterFn,
    *,
    name: str,
    order: int,
    index: IndexFn | None = None,
    applies: AppliesFn | None = None,
    static: bool = False,
) -> PreFilterFn:
    return REGISTRY.register_prefilter(fn, name=name, order=order, index=index, applies=applies, static=static)


def register_snapshot_field(name: str, default: Any) -> None:
    REGISTRY.register_snapshot_field(name, default)


def snapshot_field(node: NodeSnapshot, name: str) -> Any:
    return REGISTRY.snapshot_field(node, name)


def register_profile_field(declared: ProfileField) -> ProfileField:
    return REGISTRY.register_profile_field(declared)


def profile_field(profile: ProfileSpec, name: str) -> Any:
    return REGISTRY.profile_field(profile, name)
