"""Read-side queries and the figures the console's node pages show.

Every figure is None when it is unknown (no sample, a sample older than a minute, a probe that
did not answer); the templates print "-" for None, never 0.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db.models import Prefetch, QuerySet
from django.http import Http404
from django.utils import timezone
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from agent.messages import GpuFigures, HeartbeatSample
from agent.probes.mig import SLICE_BASE, SLICE_STRIDE
from apps.accounts.access import can_change_cluster, can_read_everything
from apps.cluster import history, reports
from apps.cluster.choices import ShardState
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.models import Gpu, Node, Shard, device_label
from llmgw.console.charts import line_chart

__all__ = [
    "Chart",
    "Disk",
    "Engine",
    "Fetch",
    "GpuCard",
    "NodeDetail",
    "NodeRow",
    "ShardRow",
    "engines_text",
    "get_node_for_user",
    "list_node_rows",
    "node_rows_page",
    "node_charts",
    "node_detail",
    "engine_overview",
    "node_doctor",
    "node_engine_rows",
    "node_engine_status",
    "node_engines",
    "node_fetches",
    "node_row",
]

HISTORY_GAP_SECONDS = 60  # heartbeats come every 10 s; a minute without one is a hole in the line


def _nodes() -> QuerySet[Node]:
    return Node.objects.prefetch_related(Prefetch("gpus", queryset=Gpu.objects.order_by("index")))


def get_node_for_user(user: Any, name: str, *, perm: str = "view") -> Node:
    """The node called `name` if `user` may see it (perm "view") or change it (perm "change").

    The permission is checked first, so an outsider cannot tell which node names exist.
    """
    allowed = can_change_cluster(user) if perm == "change" else can_read_everything(user)
    if not allowed:
        raise PermissionDenied
    node = _nodes().filter(name=name).first()
    if node is None:
        raise Http404
    return node


# Figures ------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _integer(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


@dataclass(frozen=True)
class Disk:
    """Free and total bytes of the local pools, and of the shared ones apart."""

    local_free: int | None = None
    local_total: int | None = None
    shared_free: int | None = None
    shared_total: int | None = None


def disk_summary(sample: HeartbeatSample | None) -> Disk:
    """Sum the storage pools of a sample. A pool whose `shared` is unknown counts as local."""
    sums: dict[bool, list[int]] = {}
    for pool in (sample or {}).get("storage") or []:
        free, total = _integer(pool.get("free_bytes")), _integer(pool.get("total_bytes"))
        if free is None or total is None:
            continue
        bucket = sums.setdefault(pool.get("shared") is True, [0, 0])
        bucket[0] += free
        bucket[1] += total
    local, shared = sums.get(False), sums.get(True)
    return Disk(
        local_free=local[0] if local else None,
        local_total=local[1] if local else None,
        shared_free=shared[0] if shared else None,
        shared_total=shared[1] if shared else None,
    )


def _percent(part: float | None, whole: float | None) -> float | None:
    if part is None or not whole:
        return None
    return part / whole * 100


def _warnings(node: Node, sample: HeartbeatSample | None) -> list[str]:
    seen: dict[str, None] = {}
    for text in [*(node.warnings or []), *((sample or {}).get("warnings") or [])]:
        seen.setdefault(str(text), None)
    return list(seen)


@dataclass(frozen=True)
class Engine:
    """An engine a node has, and the version it reported (None: not said)."""

    name: str
    version: str | None


def _text(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    return str(value).strip() or None


def node_engines(node: Node) -> list[Engine] | None:
    """The engines the node's agent reported, by name, each with its version where it gave one.

    An empty list is a node that has none; None is a node that never said (never registered, or
    an agent too old to report engines). Read defensively: `hardware["engines"]` is a list of
    names, `hardware["engine_versions"]` maps a name to a version or null, and either may be
    missing or malformed.
    """
    hardware = node.hardware or {}
    listed, versions = hardware.get("engines"), hardware.get("engine_versions")
    known = (
        {name: _text(version) for key, version in versions.items() if (name := _text(key))}
        if isinstance(versions, dict)
        else {}
    )
    if isinstance(listed, list):
        names = [name for item in listed if (name := _text(item.get("name") if isinstance(item, dict) else item))]
    elif isinstance(listed, dict):
        names = [name for key in listed if (name := _text(key))]
    elif isinstance(versions, dict):
        names = list(known)
    else:
        return None
    return [Engine(name, known.get(name)) for name in sorted(set(names))]


def node_engine_status(node: Node) -> dict[str, str]:
    """Per engine, what its install on the node is doing, in the node's words; {} when nothing."""
    status = (node.hardware or {}).get("engine_status")
    if not isinstance(status, dict):
        return {}
    return {str(k): str(v)[:2000] for k, v in sorted(status.items()) if isinstance(v, str) and v}


@dataclass(frozen=True)
class EngineRow:
    """One engine on the node page: what it should have, what it has, what is under way."""

    name: str
    wanted: str  # a version, or "none" (kept off)
    why: str
    installed: str | None  # the version the node reports; None when it has none
    status: str  # the node's own words for an install under way or failed; "" for none
    disabled: bool
    # The control plane's own word where it can give the node no archive (no listing, none held).
    offer: str = ""


def node_engine_rows(node: Node) -> list[EngineRow]:
    from apps.cluster.engines import NONE, EngineTables, choices_for, offer_problem

    have = {engine.name: engine.version or "-" for engine in node_engines(node) or []}
    status = node_engine_status(node)
    tables = EngineTables.read()
    rows = []
    for name, (version, why) in sorted(choices_for(node, tables.rules).items()):
        installed = have.pop(name, None)
        offer = offer_problem(node, name, version, tables) if version != NONE else None
        rows.append(
            EngineRow(
                name=name,
                wanted=version,
                why=why,
                installed=installed,
                status=status.get(name, ""),
                disabled=version == NONE and name in (node.disabled_engines or []),
                offer=offer or "",
            )
        )
    for name, version in sorted(have.items()):  # named in the node's agent.yaml, not chosen here
        rows.append(EngineRow(name, "-", "", version, status.get(name, ""), False))
    return rows


@dataclass(frozen=True)
class Doctor:
    checks: list[dict[str, str]] | None
    at: datetime | None
    asked: datetime | None

    @property
    def waiting(self) -> bool:
        """Asked and not answered since (given up on after two minutes)."""
        if self.asked is None or (self.at is not None and self.at >= self.asked):
            return False
        return timezone.now() - self.asked < timedelta(minutes=2)

    @property
    def failed(self) -> int:
        return sum(1 for check in self.checks or [] if check.get("status") == "fail")


@dataclass(frozen=True)
class EngineRule:
    choice: Any  # an EngineChoice
    release: Any | None  # its EngineRelease; None when the control plane never tried to read it


@dataclass(frozen=True)
class EngineOverview:
    defaults: dict[str, str]
    rules: list[EngineRule]
    engines: list[str]
    scopes: list[tuple[str, str]]
    builds: list[BuildRow] = field(default_factory=list)
    build_choices: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class BuildRow:
    """A GPU node's vLLM/SGLang build choice, with what its install of them is doing."""

    node: Node
    build: str
    status: dict[str, str]


def engine_overview(nodes: Iterable[int] | None = None) -> EngineOverview:
    """The cluster page's engines: the rules, the built-in versions and the releases read, and the
    build of each GPU node (of those `nodes`, by id, when given: the page's)."""
    from apps.cluster.engines import DEFAULT_VERSIONS, ENGINE_REPOS, PYTHON_ENGINES
    from apps.cluster.models import EngineChoice, EngineRelease

    releases = {(r.engine, r.version): r for r in EngineRelease.objects.all()}
    from django.db.models import Exists, OuterRef

    # The node's name, build and install status alone: not its sample, nor a DISTINCT over whole rows.
    gpu_nodes = (
        Node.objects.filter(Exists(Gpu.objects.filter(node=OuterRef("pk"))), revoked_at__isnull=True)
        .only("name", "engine_build", "hardware")
        .order_by("name")
    )
    if nodes is not None:
        gpu_nodes = gpu_nodes.filter(pk__in=list(nodes))
    builds = [
        BuildRow(
            node=node,
            build=node.engine_build,
            status={k: v for k, v in node_engine_status(node).items() if k in PYTHON_ENGINES},
        )
        for node in gpu_nodes
    ]
    return EngineOverview(
        defaults=dict(DEFAULT_VERSIONS),
        rules=[EngineRule(c, releases.get((c.engine, c.version))) for c in EngineChoice.objects.all()],
        engines=sorted(ENGINE_REPOS),
        scopes=[(str(value), str(label)) for value, label in EngineChoice.Scope.choices],
        builds=builds,
        build_choices=[(str(value), str(label)) for value, label in Node.EngineBuild.choices],
    )


def node_doctor(node: Node) -> Doctor:
    return Doctor(checks=node.doctor, at=node.doctor_at, asked=node.doctor_requested_at)


def engines_text(engines: list[Engine] | None, status: dict[str, str] | None = None) -> str:
    """The engines as one line of plain text (a tooltip): "llama.cpp b6500, vllm -", then what
    is under way in the node's words ("vllm installing: ...")."""
    parts = [f"{e.name} {e.version or '-'}" for e in engines or []]
    parts += [f"{name} {text}" for name, text in sorted((status or {}).items())]
    return ", ".join(parts)


@dataclass(frozen=True)
class NodeRow:
    """One line of the nodes page."""

    node: Node
    cpu_pct: float | None
    cpus: int | None
    memory_used: int | None
    memory_total: int | None
    gpu_groups: list[tuple[int, str]]
    gpu_count: int | None
    disk: Disk
    warnings: list[str] = field(default_factory=list)
    engines: list[Engine] | None = None
    engine_status: dict[str, str] = field(default_factory=dict)

    @property
    def memory_pct(self) -> float | None:
        return _percent(self.memory_used, self.memory_total)

    @property
    def warnings_text(self) -> str:
        return "\n".join(self.warnings)

    @property
    def engines_text(self) -> str:
        return engines_text(self.engines, self.engine_status)

    @property
    def location(self) -> str:
        """site/room/row/rack as far as the node says them, then its PDU; "" when it says none (or
        no app names locations)."""
        place = EXTENSIONS.node_location(self.node)
        path = "/".join(str(place[level]) for level in ("site", "room", "row", "rack") if place.get(level))
        return " · ".join(part for part in (path, f"PDU {place['pdu']}" if place.get("pdu") else "") if part)


def _gpu_groups(gpus: list[Gpu]) -> list[tuple[int, str]]:
    counts = Counter(g.gpu_class or g.name or "?" for g in gpus)
    return sorted(((n, name) for name, n in counts.items()), key=lambda item: (-item[0], item[1]))


def node_row(node: Node, now: datetime) -> NodeRow:
    sample = node.fresh_sample(now)
    live = sample or {}
    gpus = list(node.gpus.all())
    if gpus:
        gpu_count: int | None = sum(1 for g in gpus if g.parent_index is None)  # cards: a slice is not one more
    else:
        # A node that never registered has not said; one that did and lists none has none.
        gpu_count = _integer(node.hardware.get("gpu_count")) if node.hardware else None
    memory_used = _integer(live.get("memory_used_bytes"))
    return NodeRow(
        node=node,
        cpu_pct=_number(live.get("cpu_utilization_pct")),
        cpus=node.cpus,
        memory_used=memory_used,
        memory_total=node.memory_total_bytes if memory_used is not None else None,
        gpu_groups=_gpu_groups(gpus),
        gpu_count=gpu_count,
        disk=disk_summary(sample),
        warnings=_warnings(node, sample),
        engines=node_engines(node),
        engine_status=node_engine_status(node),
    )


def list_node_rows(now: datetime | None = None) -> list[NodeRow]:
    """Every node with its current figures, in two queries (nodes, then their GPUs)."""
    now = now or timezone.now()
    return [node_row(node, now) for node in _nodes().order_by("name")]


NODES_PER_PAGE = 100


def node_rows_page(number: Any, find: str = "", now: datetime | None = None) -> tuple[Page[Node], list[NodeRow]]:
    """One page of the nodes by name (`find`: those whose name contains it), with their figures:
    the same few queries however many nodes there are (a count, the page, its GPUs)."""
    now = now or timezone.now()
    nodes = _nodes().order_by("name")
    if find:
        nodes = nodes.filter(name__icontains=find)
    page = Paginator(nodes, NODES_PER_PAGE).get_page(number)
    return page, [node_row(node, now) for node in page.object_list]


# One node -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    mount_point: str
    fstype: str | None
    shared: bool | None
    free: int | None
    total: int | None
    weights: list[str]


@dataclass(frozen=True)
class GpuCard:
    """One GPU as its latest fresh sample and its database row describe it."""

    index: int
    label: str
    row: Gpu | None
    live: GpuFigures

    def _num(self, key: str) -> float | None:
        return _number(self.live.get(key))

    def _int(self, key: str) -> int | None:
        return _integer(self.live.get(key))

    @property
    def utilization(self) -> float | None:
        return self._num("utilization_gpu_pct")

    @property
    def memory_used_mib(self) -> int | None:
        return self._int("memory_used_mib")

    @property
    def memory_total_mib(self) -> int | None:
        return self._int("memory_total_mib") or (self.row.memory_total_mib if self.row else None)

    @property
    def memory_pct(self) -> float | None:
        return _percent(self.memory_used_mib, self.memory_total_mib)

    @property
    def temperature(self) -> float | None:
        return self._num("temperature_gpu_c")

    @property
    def temperature_memory(self) -> float | None:
        return self._num("temperature_memory_c")

    @property
    def power_draw(self) -> float | None:
        return self._num("power_draw_w")

    @property
    def power_limit(self) -> float | None:
        return self._num("power_limit_w")

    @property
    def sm_clock(self) -> float | None:
        return self._num("sm_clock_mhz")

    @property
    def throttle_reasons(self) -> list[str] | None:
        value = self.live.get("throttle_reasons")
        return [str(v) for v in value] if isinstance(value, list) else None

    @property
    def ecc_uncorrected(self) -> int | None:
        return self._int("ecc_uncorrected_volatile")

    @property
    def xids(self) -> list[tuple[str, int]] | None:
        value = self.live.get("xids")
        if not isinstance(value, dict):
            return None
        return sorted((str(k), int(v)) for k, v in value.items() if _integer(v) is not None)

    @property
    def remapped_uncorrectable(self) -> int | None:
        return self._int("remapped_rows_uncorrectable")

    @property
    def remapped_pending(self) -> bool | None:
        value = self.live.get("remapped_rows_pending")
        return value if isinstance(value, bool) else None

    @property
    def remapped_failure(self) -> bool | None:
        value = self.live.get("remapped_rows_failure")
        return value if isinstance(value, bool) else None

    @property
    def pcie_replays(self) -> int | None:
        return self._int("pcie_replay_count")

    @property
    def nvlink_errors(self) -> list[tuple[str, int]] | None:
        value = self.live.get("nvlink_errors")
        if not isinstance(value, dict):
            return None
        return sorted((str(k), int(v)) for k, v in value.items() if _integer(v) is not None)

    @property
    def foreign_processes(self) -> int | None:
        if "foreign_processes" in self.live or "processes" in self.live:
            return reports.gpu_health(self.live)[1]
        return self.row.foreign_processes if self.row else None

    @property
    def healthy(self) -> bool | None:
        return self.row.healthy if self.row else None

    # What the device is: a card or a slice of one, and whose -------------------------------

    def _text(self, key: str) -> str:
        value = self.live.get(key)
        if isinstance(value, str) and value:
            return value
        return str(getattr(self.row, key, "") or "") if self.row is not None else ""

    @property
    def vendor(self) -> str:
        return self._text("vendor") or "nvidia"

    @property
    def vendor_name(self) -> str:
        return {"nvidia": "NVIDIA", "amd": "AMD"}.get(self.vendor, self.vendor)

    @property
    def parent(self) -> int | None:
        parent = self.live.get("parent")
        if isinstance(parent, int) and not isinstance(parent, bool):
            return parent
        return self.row.parent_index if self.row is not None else None

    @property
    def kind(self) -> str:
        return self._text("kind") or "gpu"

    @property
    def name(self) -> str:
        """How it is named, the same in every language: "GPU 0", "GPU 0 MIG 2 (1g.10gb)"."""
        return device_label(self.index, self.kind, self.parent, self._text("profile"))

    @property
    def split(self) -> bool:
        return self.live.get("split") is True or bool(self.row is not None and self.row.split)

    @property
    def fault(self) -> str:
        """Why the device cannot be trusted now, in its agent's words ("" when it can)."""
        return reports.gpu_fault(self.live) or (self.row.fault if self.row is not None else "")

    @property
    def device_id(self) -> str:
        return self._text("device_id") if self.parent is not None else ""

    @property
    def share(self) -> str | None:
        """A slice's part of its card as a fraction ("1/7"), None for a card."""
        share = self._num("share")
        if share is None and self.row is not None:
            share = self.row.share
        if share is None or share <= 0 or self.parent is None:
            return None
        whole = round(1 / share)
        return f"1/{whole}" if abs(1 / share - whole) < 0.01 else f"{share:.2f}"

    @property
    def mig_mode(self) -> str:
        return self._text("mig_mode")

    @property
    def mig_pending(self) -> str:
        """The MIG mode after the next reset, where it is not the current one ("" otherwise)."""
        pending = self._text("mig_pending")
        return pending if pending and pending != self.mig_mode else ""

    @property
    def partitions(self) -> str:
        """An AMD card's compute and memory partition modes: "CPX / NPS4"; "" where not said."""
        compute, memory = self._text("compute_partition"), self._text("memory_partition")
        return f"{compute or '-'} / {memory or '-'}" if compute or memory else ""

    @property
    def temperature_edge(self) -> float | None:
        return self._num("temperature_edge_c")

    @property
    def temperature_junction(self) -> float | None:
        return self._num("temperature_junction_c")

    @property
    def ecc_corrected(self) -> int | None:
        return self._int("ecc_corrected")


@dataclass(frozen=True)
class ShardRow:
    """One engine running (or meant to run) on the node: its shard, and what it claims and uses.
    The use is from the node's latest fresh sample; None when the agent did not measure it."""

    shard: Shard
    cores_used: float | None
    memory_used: int | None
    # Its devices: a card by its index, a slice by its name ("GPU 0 MIG 2 (1g.10gb)").
    devices: tuple[str, ...] = ()

    @property
    def model(self) -> str:
        return self.shard.replica.model.name

    @property
    def model_deleted(self) -> bool:
        return self.shard.replica.model.deleted_at is not None

    @property
    def cores_over(self) -> bool:
        return bool(self.cores_used is not None and self.shard.cpu_cores and self.cores_used > self.shard.cpu_cores)

    @property
    def memory_over(self) -> bool:
        return bool(
            self.memory_used is not None and self.shard.memory_bytes and self.memory_used > self.shard.memory_bytes
        )

    @property
    def failed(self) -> bool:
        """Its engine exited or was stopped unready: the page shows why, with its log's last lines."""
        return self.shard.state == ShardState.FAILED


@dataclass(frozen=True)
class Fetch:
    """One mirror version the node was told to keep, as its agent said with its last heartbeat."""

    directory: str
    state: str  # held, fetching, refused, failed
    message: str

    @property
    def refused(self) -> bool:
        return self.state in ("refused", "failed")


def node_fetches(sample: HeartbeatSample | None) -> list[Fetch]:
    """What the node said of each mirror version it keeps, by directory (from a fresh sample: []
    when it is stale, as every live figure is)."""
    from apps.cluster.inventory import fetch_states

    return [Fetch(directory, state, message) for directory, (state, message) in sorted(fetch_states(sample).items())]


def _shard_rows(node: Node, sample: HeartbeatSample | None) -> list[ShardRow]:
    measured = {str(e.get("shard")): e for e in (sample or {}).get("shards") or [] if isinstance(e, dict)}
    shards = (
        Shard.objects.filter(node=node)
        .select_related("replica__model")
        .order_by("replica__model__name", "replica_id", "rank")
    )
    names = {g.index: g.label for g in node.gpus.all() if g.parent_index is not None}  # a card is its index
    rows = []
    for shard in shards:
        entry = measured.get(shard.shard_id)
        devices = tuple(names.get(i) or str(i) for i in shard.gpu_indices or () if isinstance(i, int))
        rows.append(
            ShardRow(
                shard=shard,
                cores_used=_number(entry.get("cpu_cores")) if entry is not None else None,
                memory_used=_integer(entry.get("memory_bytes")) if entry is not None else None,
                devices=devices,
            )
        )
    return rows


@dataclass(frozen=True)
class NodeDetail:
    """What the node page shows about one node now."""

    node: Node
    sample: HeartbeatSample | None
    sampled_at: datetime | None
    cpu_pct: float | None
    cpus: int | None
    memory_used: int | None
    memory_total: int | None
    load: list[float | None] | None
    cpu_temperature: float | None
    inlet_temperature: float | None
    cpu_power: float | None
    pools: list[Pool]
    disk: Disk
    gpus: list[GpuCard]
    warnings: list[str]
    engines: list[Engine] | None = None
    engine_status: dict[str, str] = field(default_factory=dict)
    shards: list[ShardRow] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)

    @property
    def memory_pct(self) -> float | None:
        return _percent(self.memory_used, self.memory_total)

    @property
    def hardware(self) -> dict[str, Any]:
        return self.node.hardware or {}

    @property
    def engines_text(self) -> str:
        return engines_text(self.engines, self.engine_status)


def _pools(sample: HeartbeatSample | None) -> list[Pool]:
    pools = []
    for pool in (sample or {}).get("storage") or []:
        shared = pool.get("shared")
        pools.append(
            Pool(
                mount_point=str(pool.get("mount_point") or ""),
                fstype=pool.get("fstype") or None,
                shared=shared if isinstance(shared, bool) else None,
                free=_integer(pool.get("free_bytes")),
                total=_integer(pool.get("total_bytes")),
                weights=[str(w) for w in pool.get("weights") or []],
            )
        )
    return pools


def card_of(index: int) -> int:
    """The card a device index names: its own for a card, its card's for a slice."""
    return index if index < SLICE_BASE else (index - SLICE_BASE) // SLICE_STRIDE


def _gpu_cards(node: Node, sample: HeartbeatSample | None) -> list[GpuCard]:
    rows = {g.index: g for g in node.gpus.all()}
    live = {int(g["index"]): g for g in (sample or {}).get("gpus") or [] if _integer(g.get("index")) is not None}
    cards = []
    # A slice right after its card (its index names the card: agent.probes.mig.slice_parent).
    for index in sorted(set(rows) | set(live), key=lambda i: (card_of(i), i)):
        row, data = rows.get(index), live.get(index) or GpuFigures(index=index)  # a row alone: no figures
        label = data.get("gpu_class") or data.get("name") or (row.gpu_class or row.name if row else "") or "?"
        cards.append(GpuCard(index=index, label=str(label), row=row, live=data))
    return cards


def node_detail(node: Node, now: datetime | None = None) -> NodeDetail:
    sample = node.fresh_sample(now or timezone.now())
    live = sample or {}
    load = live.get("load")
    memory_used = _integer(live.get("memory_used_bytes"))
    return NodeDetail(
        node=node,
        sample=sample,
        sampled_at=node.sampled_at if sample is not None else None,
        cpu_pct=_number(live.get("cpu_utilization_pct")),
        cpus=node.cpus,
        memory_used=memory_used,
        memory_total=node.memory_total_bytes,
        load=[_number(v) for v in load][:3] if isinstance(load, list) and load else None,
        cpu_temperature=_number(live.get("cpu_package_temp_c")),
        inlet_temperature=_number(live.get("inlet_temp_c")),
        cpu_power=_number(live.get("cpu_package_power_w")),
        pools=_pools(sample),
        disk=disk_summary(sample),
        gpus=_gpu_cards(node, sample),
        warnings=_warnings(node, sample),
        engines=node_engines(node),
        engine_status=node_engine_status(node),
        shards=_shard_rows(node, sample),
        fetches=node_fetches(sample),
    )


# Last hour -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chart:
    title: str
    svg: SafeString


def node_charts(node: Node) -> list[Chart]:
    """The last hour of CPU, memory, load and per-GPU figures, from the heartbeat history."""
    points = history.sample_history(node.pk)

    def series(pick: Any) -> list[tuple[float, float | None]]:
        out = []
        for point in points:
            t = _number(point.get("t"))
            if t is not None:
                out.append((t, _number(pick(point))))
        return out

    def chart(title: str, values: list[tuple[float, float | None]], **kwargs: Any) -> Chart:
        return Chart(title, line_chart(values, label=title, gap_seconds=HISTORY_GAP_SECONDS, **kwargs))

    charts = [
        chart(_("CPU utilisation"), series(lambda p: p.get("cpu")), y_max=100, unit="%"),
        chart(_("Memory used"), series(lambda p: p.get("mem")), y_max=100, unit="%"),
        chart(_("Load (1 minute)"), series(lambda p: p.get("load"))),
    ]
    indexes = sorted(
        {int(k) for p in points for k in (p.get("gpus") or {}) if str(k).isdigit()}
        | {g.index for g in node.gpus.all() if g.parent_index is None}  # a slice has no figures of its own
    )

    def gpu_value(point: dict[str, Any], index: int, position: int) -> Any:
        values = (point.get("gpus") or {}).get(str(index))
        return values[position] if isinstance(values, list) and len(values) > position else None

    for index in indexes:
        charts.append(
            chart(
                _("GPU %(index)s utilisation") % {"index": index},
                series(lambda p, i=index: gpu_value(p, i, 0)),
                y_max=100,
                unit="%",
            )
        )
        charts.append(
            chart(
                _("GPU %(index)s temperature") % {"index": index},
                series(lambda p, i=index: gpu_value(p, i, 1)),
                unit="°C",
            )
        )
    return charts + _model_charts(node, points, series, chart)


# Positions in a history point's per-model figures (apps.cluster.history._history_point).
CORES_CLAIMED, MEMORY_CLAIMED, CORES_USED, MEMORY_USED, QUEUED = range(5)


def _model_charts(node: Node, points: list[dict[str, Any]], series: Any, chart: Any) -> list[Chart]:
    """Per model with a claim on the node now or in the hour: cores and memory used (the line) against
    claimed (dashed), and the requests the gateway had waiting for it.

    A point that read the node's claims and found none of a model's counts as 0 for it (nothing
    claimed, nothing running); a point that did not read them is a gap."""
    from apps.cluster.inventory import CLAIMING_STATES

    current = set(
        Shard.objects.filter(node=node, replica__state__in=CLAIMING_STATES).values_list(
            "replica__model__name", flat=True
        )
    )
    names = sorted(current | {str(name) for p in points if isinstance(p.get("models"), dict) for name in p["models"]})

    def pick(model: str, position: int, scale: float = 1.0) -> Any:
        def value(point: dict[str, Any]) -> float | None:
            models = point.get("models")
            if not isinstance(models, dict):
                return None
            figures = models.get(model)
            if figures is None:
                return 0.0 if position != QUEUED else None
            figure = _number(figures[position]) if isinstance(figures, list) and len(figures) > position else None
            return figure / scale if figure is not None else None

        return value

    gib = 1024**3
    charts = []
    for name in names:
        charts.append(
            chart(
                _("Cores of %(model)s: used, and claimed (dashed)") % {"model": name},
                series(pick(name, CORES_USED)),
                reference=series(pick(name, CORES_CLAIMED)),
            )
        )
        charts.append(
            chart(
                _("Memory of %(model)s: used, and claimed (dashed)") % {"model": name},
                series(pick(name, MEMORY_USED, gib)),
                unit=" GiB",
                reference=series(pick(name, MEMORY_CLAIMED, gib)),
            )
        )
        charts.append(
            chart(_("Requests waiting for %(model)s in the gateway") % {"model": name}, series(pick(name, QUEUED)))
        )
    return charts
