"""A simulated fleet, its models and a script of events, read from YAML (or the parsed mapping).

Every key is checked: an unknown one is an error naming the path and the keys that are allowed
(a typo must never quietly leave a setting at its default), and every error is reported at once.
What the scenario asks is added up from its declared counts as it is read and held to its
Limits (apps.sim.limits) before anything is built. See docs/sim.md for the format.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.utils.translation import gettext as _
from django.utils.translation import pgettext

from apps.catalog.choices import Engine
from apps.catalog.profile_fields import refusal_text
from apps.cluster.placement import REGISTRY, FieldError
from apps.sim.limits import (
    GPUS_PER_NODE,
    LOAD_POINTS,
    MAX_PROBLEMS,
    MAX_STEPS,
    NAME_WIDTH,
    PROFILES,
    RAILS,
    Limits,
    figure,
    load_text,
    written_size,
)
from llmgw.errors import ServiceError

__all__ = [
    "EVENT_KINDS",
    "MAX_STEPS",
    "Event",
    "FleetGroup",
    "ModelSpec",
    "NodeType",
    "ProfileSpec",
    "SHIPPED_CAPTURES",
    "Scenario",
    "ScenarioError",
    "parse",
    "parse_duration",
]

EVENT_KINDS = ("lose", "restore", "hold", "release", "cap", "sm_failover", "set", "load")
CLASSES = ("opportunistic", "standard", "critical")
ENGINES = tuple(Engine.values)
# Captures shipped with llmgw, looked up last: the manual's example names one.
SHIPPED_CAPTURES = Path(__file__).resolve().parent / "captures"
MAX_DURATION = timedelta(days=3650)  # the longest duration a scenario may give (ten years)


class ScenarioError(ServiceError, ValueError):
    """What is wrong with a scenario: every problem found, each with where it is."""

    code = "scenario_invalid"

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass
class NodeType:
    name: str
    gpus: list[tuple[int, str, str | None]] = field(default_factory=list)  # index, class, NVLink group
    cpus: int | None = None
    memory_bytes: int | None = None
    idle_watts: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    source: str = ""  # where its cards came from: a capture's file, a live node, or the description


@dataclass
class FleetGroup:
    type: str
    count: int
    name: str
    labels: dict[str, str]
    per_rack: int | None
    rack_prefix: str
    pdus_per_rack: int
    fabric: str | None
    fabric_kind: str
    per_leaf: int | None
    rails: int
    nvlink_domain: int | None


@dataclass
class ProfileSpec:
    name: str
    engine: str
    accelerator: str
    gpus: int
    nodes: int
    priority: int
    memory_bytes: int
    cpu_cores: float
    node_selector: dict[str, str]
    # The fields placement's plugins declared (facility's keep_within, power_watts), by name: read
    # as a model file's are (apps.catalog.profile_fields).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelSpec:
    name: str
    min: int
    max: int
    capacity_class: str
    owner: str
    profiles: list[ProfileSpec]
    replica_rps: float | None
    load: list[tuple[timedelta, float]]


@dataclass
class Event:
    at: timedelta
    kind: str
    args: dict[str, Any]
    text: str  # the event as written, for the report
    path: str = ""  # where it is in the scenario, for problems found once the fleet is built


@dataclass
class Scenario:
    start: datetime
    step: timedelta
    duration: timedelta
    ready_after: timedelta
    node_types: dict[str, NodeType]
    groups: list[FleetGroup]
    models: list[ModelSpec]
    quotas: dict[str, dict[str, Any]]
    caps: dict[str, float]
    events: list[Event]
    report_model: str | None
    from_cluster: bool = False

    @property
    def steps(self) -> int:
        return int(self.duration / self.step)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}
_SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50})
_WATTS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(W|kW|MW)?\s*$", re.IGNORECASE)


def parse_duration(value: Any) -> timedelta | None:
    """ "90s", "5m", "1h30m", "1d" or seconds as a number; None when it is none of those."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        try:
            return timedelta(seconds=float(value)) if value >= 0 else None
        except (OverflowError, ValueError):
            return None
    if not isinstance(value, str):
        return None
    text = value.strip().lower().replace(" ", "")
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    try:
        return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in parts))
    except (OverflowError, ValueError):  # past what a timedelta holds
        return None


def _size(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    found = _SIZE.match(str(value)) if isinstance(value, str) else None
    if found is None:
        return None
    return int(float(found.group(1)) * _SIZE_UNITS[(found.group(2) or "").lower()])


def _watts(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if value >= 0 else None
    found = _WATTS.match(value) if isinstance(value, str) else None
    if found is None:
        return None
    scale = {"": 1, "w": 1, "kw": 1000, "mw": 1_000_000}[(found.group(2) or "").lower()]
    return float(found.group(1)) * scale


class _Reader:
    """Walks the document, collecting problems with their paths instead of stopping at the first."""

    def __init__(self, base: Path | None, captures: Path | None, live: Any, limits: Limits) -> None:
        self.problems: list[str] = []
        self.unlisted = 0  # problems past MAX_PROBLEMS, counted
        self.base = base
        self.captures = captures
        self.live = live  # name -> a live node's hardware, for `like:` (None: no cluster to ask)
        self.limits = limits

    def problem(self, path: str, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(f"{path}: {message}")
        else:
            self.unlisted += 1

    def all_problems(self) -> list[str]:
        more = [_("and %(count)s more problems") % {"count": figure(self.unlisted)}] if self.unlisted else []
        return self.problems + more

    def at_most(self, found: int, most: int, path: str, what: str) -> bool:
        """Whether `found` of `what` is within `most`; a problem with both numbers if not. `what` is
        a noun as it follows a number (pgettext's "counted" context: Turkish takes the singular)."""
        if found <= most:
            return True
        self.problem(
            path,
            _("%(count)s %(what)s is more than the %(max)s a run here may have")
            % {"count": figure(found), "what": what, "max": figure(most)},
        )
        return False

    def listed(self, value: Any, path: str, most: int, what: str) -> bool:
        """A list or mapping of at most `most` entries (anything else passes: its type is checked where it is read)."""
        return not isinstance(value, list | dict) or self.at_most(len(value), most, path, what)

    def mapping(self, value: Any, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:  # type: ignore[type-arg]
        if not isinstance(value, dict):
            self.problem(path, _("must be a mapping, not %(kind)s") % {"kind": type(value).__name__})
            return {}
        for key in value:
            if key not in allowed:
                near = difflib.get_close_matches(str(key), allowed, n=1)
                hint = (_(" (did you mean %(key)s?)") % {"key": near[0]}) if near else ""
                self.problem(
                    f"{path}.{key}",
                    _("unknown key%(hint)s; allowed: %(keys)s") % {"hint": hint, "keys": ", ".join(allowed)},
                )
        for key in required:
            if key not in value:
                self.problem(f"{path}.{key}", _("is required"))
        return value

    def whole(self, value: Any, path: str, low: int = 0, default: int | None = None) -> int | None:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.problem(
                path, _("must be a whole number of at least %(low)s, not %(value)r") % {"low": low, "value": value}
            )
            return default
        return value

    def duration(self, value: Any, path: str, default: timedelta | None = None) -> timedelta | None:
        if value is None:
            return default
        found = parse_duration(value)
        if found is None:
            self.problem(path, _("must be a duration such as 90s, 5m, 1h30m or 1d, not %(value)r") % {"value": value})
            return default
        if found > MAX_DURATION:
            self.problem(path, _("must be at most %(days)s days") % {"days": figure(MAX_DURATION.days)})
            return default
        return found

    def choice(self, value: Any, path: str, choices: tuple[str, ...], default: str) -> str:
        if value is None:
            return default
        if value not in choices:
            self.problem(
                path, _("must be one of %(choices)s, not %(value)r") % {"choices": ", ".join(choices), "value": value}
            )
            return default
        return str(value)

    def text(self, value: Any, path: str, default: str = "") -> str:
        if value is None:
            return default
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            self.problem(path, _("must be text, not %(value)r") % {"value": value})
            return default
        return str(value)

    def labels(self, value: Any, path: str) -> dict[str, str]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problem(path, _("must be a mapping of label to value"))
            return {}
        return {str(k): str(v) for k, v in value.items()}

    def capture(self, value: Any, path: str) -> str | None:
        """The text of a captured file, looked up next to the scenario, then in the captures folder,
        then among those shipped with llmgw."""
        if not isinstance(value, str) or not value.strip():
            self.problem(path, _("must name a captured file"))
            return None
        relative = Path(value)
        folders = [f for f in (self.base, self.captures, SHIPPED_CAPTURES) if f is not None]
        for folder in folders:
            candidate = (folder / relative).resolve()
            if self.base is None and not candidate.is_relative_to(folder.resolve()):
                continue  # a scenario sent over the API reads inside the captures folder only
            if candidate.is_file():
                try:
                    return candidate.read_text(encoding="utf-8", errors="replace")
                except OSError as exc:
                    self.problem(path, _("cannot read %(file)s: %(why)s") % {"file": candidate, "why": exc.strerror})
                    return None
        where = ", ".join(str(f) for f in folders) or _("no folder (set LLMGW_SIM_CAPTURES)")
        self.problem(path, _("no file %(file)s in %(where)s") % {"file": value, "where": where})
        return None


def _node_type(reader: _Reader, name: str, raw: Any, path: str) -> NodeType:
    from agent.probes.nvidia import parse_nvidia_smi_text, parse_nvidia_smi_xml
    from agent.probes.nvlink import nvlink_groups, parse_topo_matrix

    allowed = ("nvidia_smi", "topology", "gpus", "like", "cpus", "memory", "idle_watts", "labels")
    data = reader.mapping(raw, path, allowed)
    node = NodeType(name=name)
    sources = [k for k in ("nvidia_smi", "gpus", "like") if k in data]
    if len(sources) > 1:
        reader.problem(path, _("give one of nvidia_smi, gpus and like, not %(keys)s") % {"keys": ", ".join(sources)})
    if "nvidia_smi" in data:
        text = reader.capture(data["nvidia_smi"], f"{path}.nvidia_smi")
        if text is not None:
            report = parse_nvidia_smi_xml(text) if text.lstrip().startswith("<") else parse_nvidia_smi_text(text)
            if not report.gpus:
                reader.problem(f"{path}.nvidia_smi", _("the capture lists no GPU"))
            node.gpus = [(g.index, g.gpu_class or g.name or "unknown", None) for g in report.gpus]
            node.source = str(data["nvidia_smi"])
    elif "gpus" in data:
        gpus = reader.mapping(data["gpus"], f"{path}.gpus", ("class", "count"), ("class", "count"))
        count = reader.whole(gpus.get("count"), f"{path}.gpus.count", 0, 0) or 0
        if count > GPUS_PER_NODE:
            reader.problem(
                f"{path}.gpus.count",
                _("%(count)s GPUs in one node is more than the %(max)s a node type may have")
                % {"count": figure(count), "max": GPUS_PER_NODE},
            )
            count = 0
        cls = reader.text(gpus.get("class"), f"{path}.gpus.class", "unknown")
        node.gpus = [(i, cls, None) for i in range(count)]
        node.source = _("described")
    elif "like" in data:
        live = reader.live.get(str(data["like"])) if reader.live is not None else None
        if reader.live is None:
            reader.problem(f"{path}.like", _("needs the cluster's nodes, which this run cannot read"))
        elif live is None:
            reader.problem(f"{path}.like", _("no node %(name)s in the cluster") % {"name": data["like"]})
        else:
            node.gpus = list(live["gpus"])
            node.cpus, node.memory_bytes = live["cpus"], live["memory_bytes"]
            node.source = _("like node %(name)s") % {"name": data["like"]}
    if "topology" in data:
        text = reader.capture(data["topology"], f"{path}.topology")
        if text is not None:
            groups = nvlink_groups(parse_topo_matrix(text))
            node.gpus = [(i, cls, groups.get(i, group)) for i, cls, group in node.gpus]
    if "cpus" in data:
        node.cpus = reader.whole(data["cpus"], f"{path}.cpus", 1)
    if "memory" in data:
        node.memory_bytes = _size(data["memory"])
        if node.memory_bytes is None:
            reader.problem(
                f"{path}.memory", _("must be a size such as 512GiB or 2TiB, not %(value)r") % {"value": data["memory"]}
            )
    if "idle_watts" in data:
        node.idle_watts = _watts(data["idle_watts"])
        if node.idle_watts is None:
            reader.problem(f"{path}.idle_watts", _("must be a power such as 1500 or 1.5kW"))
    node.labels = reader.labels(data.get("labels"), f"{path}.labels")
    return node


def _group(reader: _Reader, raw: Any, path: str, types: dict[str, NodeType]) -> FleetGroup | None:
    allowed = ("type", "count", "name", "labels", "rack", "fabric", "nvlink_domain")
    data = reader.mapping(raw, path, allowed, ("type", "count"))
    kind = data.get("type")
    if kind is not None and kind not in types:
        reader.problem(
            f"{path}.type",
            _("no node type %(name)s (types: %(types)s)") % {"name": kind, "types": ", ".join(types) or "-"},
        )
    count = reader.whole(data.get("count"), f"{path}.count", 1, 1) or 1
    rack = reader.mapping(data.get("rack") or {}, f"{path}.rack", ("size", "prefix", "pdus"))
    fabric = data.get("fabric")
    if isinstance(fabric, str):
        fabric = {"name": fabric}
    fab = reader.mapping(fabric or {}, f"{path}.fabric", ("name", "kind", "per_leaf", "rails"))
    if fabric is not None and "name" not in fab:
        reader.problem(f"{path}.fabric.name", _("is required"))
    group = FleetGroup(
        type=str(kind),
        count=count,
        name=reader.text(data.get("name"), f"{path}.name", "{type}-{n:04d}"),
        labels=reader.labels(data.get("labels"), f"{path}.labels"),
        per_rack=reader.whole(rack.get("size"), f"{path}.rack.size", 1) if rack else None,
        rack_prefix=reader.text(rack.get("prefix"), f"{path}.rack.prefix", "r"),
        pdus_per_rack=reader.whole(rack.get("pdus"), f"{path}.rack.pdus", 0, 0) or 0,
        fabric=str(fab["name"]) if fab.get("name") else None,
        fabric_kind=reader.choice(fab.get("kind"), f"{path}.fabric.kind", ("ib", "roce"), "ib"),
        per_leaf=reader.whole(fab.get("per_leaf"), f"{path}.fabric.per_leaf", 1),
        rails=min(reader.whole(fab.get("rails"), f"{path}.fabric.rails", 0, 0) or 0, RAILS),
        nvlink_domain=reader.whole(data.get("nvlink_domain"), f"{path}.nvlink_domain", 1),
    )
    if isinstance(fab.get("rails"), int) and fab["rails"] > RAILS:
        reader.problem(f"{path}.fabric.rails", _("must be at most %(max)s") % {"max": RAILS})
    _name_pattern(reader, group, f"{path}.name")
    return group


def _name_pattern(reader: _Reader, group: FleetGroup, path: str) -> None:
    """A group's name pattern may use {type} and {n} with a format of at most NAME_WIDTH
    characters (the width is read before anything is formatted: {n:999999999} is refused)."""
    wrong = _("must be a pattern using {type} and {n}, such as {type}-{n:04d}")
    try:
        fields = list(string.Formatter().parse(group.name))
    except ValueError:
        reader.problem(path, wrong)
        return
    for _literal, name, spec, _conversion in fields:
        if name is None:
            continue
        if name not in ("type", "n") or "{" in (spec or ""):
            reader.problem(path, wrong)
            return
        if any(int(width) > NAME_WIDTH for width in re.findall(r"\d+", spec or "")):
            reader.problem(path, _("a field's width is at most %(max)s characters") % {"max": NAME_WIDTH})
            return
    try:
        group.name.format(type=group.type, n=0)
    except (KeyError, IndexError, ValueError):
        reader.problem(path, wrong)


# A scenario's profile as a model file's, in the simulator's words for placement's own fields;
# every field a placement plugin declares is read as the catalogue reads it.
PROFILE_KEYS = ("name", "engine", "accelerator", "gpus", "nodes", "priority", "memory", "cpu_cores", "node_selector")


def _profile(reader: _Reader, raw: Any, path: str) -> ProfileSpec:
    declared = REGISTRY.profile_fields()
    data = reader.mapping(raw, path, (*PROFILE_KEYS, *(f.name for f in declared)))
    gpus = reader.whole(data.get("gpus"), f"{path}.gpus", 0, 0) or 0
    accelerator = reader.text(data.get("accelerator"), f"{path}.accelerator", "" if not gpus else "")
    if gpus and not accelerator:
        reader.problem(f"{path}.accelerator", _("a profile with GPUs names their class"))
    cores = data.get("cpu_cores", 0)
    if isinstance(cores, bool) or not isinstance(cores, int | float) or not 0 <= cores < 1e9:
        reader.problem(f"{path}.cpu_cores", _("must be a number of cores"))
        cores = 0
    memory = _size(data.get("memory", 0))
    if memory is None:
        reader.problem(f"{path}.memory", _("must be a size such as 16GiB"))
    extra: dict[str, Any] = {}
    for declared_field in declared:
        try:
            extra[declared_field.name] = declared_field.parse(declared_field.given(data))
        except FieldError as exc:
            reader.problem(f"{path}.{declared_field.key}", refusal_text(exc.reason))
    return ProfileSpec(
        name=reader.text(data.get("name"), f"{path}.name", "gpu" if gpus else "cpu"),
        engine=reader.choice(data.get("engine"), f"{path}.engine", ENGINES, "vllm" if gpus else "llama.cpp"),
        accelerator=accelerator if gpus else "cpu",
        gpus=gpus,
        nodes=reader.whole(data.get("nodes"), f"{path}.nodes", 1, 1) or 1,
        priority=int(data.get("priority") or 0) if isinstance(data.get("priority", 0), int) else 0,
        memory_bytes=memory or 0,
        cpu_cores=float(cores),
        node_selector=reader.labels(data.get("node_selector"), f"{path}.node_selector"),
        extra=extra,
    )


def _model(reader: _Reader, raw: Any, path: str) -> list[ModelSpec]:
    allowed = ("name", "count", "min", "max", "class", "owner", "profiles", "load")
    data = reader.mapping(raw, path, allowed, ("name", "profiles"))
    low = reader.whole(data.get("min"), f"{path}.min", 0, 1) or 0
    high = reader.whole(data.get("max"), f"{path}.max", 0, max(low, 1))
    high = max(high or 0, 0)
    if high < low:
        reader.problem(f"{path}.max", _("(%(max)s) cannot be below min (%(min)s)") % {"max": high, "min": low})
    profiles_raw = data.get("profiles")
    profiles: list[ProfileSpec] = []
    if profiles_raw is not None and (not isinstance(profiles_raw, list) or not profiles_raw):
        reader.problem(f"{path}.profiles", _("must be a list of at least one profile"))
    elif isinstance(profiles_raw, list) and reader.at_most(
        len(profiles_raw), PROFILES, f"{path}.profiles", pgettext("counted", "profiles")
    ):
        profiles = [_profile(reader, p, f"{path}.profiles[{i}]") for i, p in enumerate(profiles_raw)]
    load = reader.mapping(data.get("load") or {}, f"{path}.load", ("replica_rps", "points"))
    rps = load.get("replica_rps")
    if load and (isinstance(rps, bool) or not isinstance(rps, int | float) or not 0 < rps < 1e12):
        reader.problem(f"{path}.load.replica_rps", _("must be the requests per second one replica serves, above 0"))
        rps = None
    points: list[tuple[timedelta, float]] = []
    points_raw = load.get("points") or []
    if not isinstance(points_raw, list):
        reader.problem(f"{path}.load.points", _("must be a list of points"))
        points_raw = []
    if not reader.at_most(len(points_raw), LOAD_POINTS, f"{path}.load.points", pgettext("counted", "load points")):
        points_raw = []
    for i, point in enumerate(points_raw):
        p = reader.mapping(point, f"{path}.load.points[{i}]", ("at", "rps"), ("at", "rps"))
        at = reader.duration(p.get("at"), f"{path}.load.points[{i}].at")
        value = p.get("rps")
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e12:
            reader.problem(f"{path}.load.points[{i}].rps", _("must be a number of requests per second"))
            continue
        if at is not None:
            points.append((at, float(value)))
    count = reader.whole(data.get("count"), f"{path}.count", 1, 1) or 1
    name = reader.text(data.get("name"), f"{path}.name", "model")
    reader.at_most(high, reader.limits.replicas, f"{path}.max", pgettext("counted", "replicas"))
    spec = dict(
        min=low,
        max=high,
        capacity_class=reader.choice(data.get("class"), f"{path}.class", CLASSES, ""),
        owner=reader.text(data.get("owner"), f"{path}.owner", ""),
        profiles=profiles,
        replica_rps=float(rps) if rps else None,
        load=sorted(points),
    )
    if count == 1:
        return [ModelSpec(name=name, **spec)]  # type: ignore[arg-type]
    return [ModelSpec(name=f"{name}-{i:04d}", **spec) for i in range(count)]  # type: ignore[arg-type]


_EVENT_ARGS: dict[str, tuple[str, ...]] = {
    "lose": ("nodes", "rack", "pdu", "count", "type"),
    "restore": ("nodes", "rack", "pdu", "all"),
    "hold": ("rack", "pdu", "row", "room", "site", "reason", "drain"),
    "release": ("rack", "pdu", "row", "room", "site"),
    "cap": ("domain", "watts"),
    "sm_failover": ("fabric", "outage"),
    "set": ("model", "min", "max", "class"),
    "load": ("model", "rps", "factor"),
}


def _event(reader: _Reader, raw: Any, path: str) -> Event | None:
    data = reader.mapping(raw, path, ("at", *EVENT_KINDS), ("at",))
    at = reader.duration(data.get("at"), f"{path}.at")
    kinds = [k for k in EVENT_KINDS if k in data]
    if len(kinds) != 1:
        reader.problem(path, _("give exactly one of %(kinds)s") % {"kinds": ", ".join(EVENT_KINDS)})
        return None
    kind = kinds[0]
    args = reader.mapping(data[kind], f"{path}.{kind}", _EVENT_ARGS[kind])
    where = f"{path}.{kind}"
    if kind in ("lose", "restore") and not any(k in args for k in ("nodes", "rack", "pdu", "count", "all")):
        reader.problem(
            where,
            _("name the nodes, a rack, a pdu%(more)s")
            % {"more": _(" or a count") if kind == "lose" else _(" or all: true")},
        )
    if kind in ("hold", "release") and sum(k in args for k in ("rack", "pdu", "row", "room", "site")) != 1:
        reader.problem(where, _("name one domain: rack, pdu, row, room or site"))
    _event_values(reader, kind, args, where)
    if kind == "cap":
        if not isinstance(args.get("domain"), str) or "=" not in args.get("domain", ""):
            reader.problem(f"{where}.domain", _("must be a domain such as rack=r12"))
        if _watts(args.get("watts")) is None:
            reader.problem(f"{where}.watts", _("must be a power such as 30000 or 30kW"))
    if kind == "sm_failover":
        if not args.get("fabric"):
            reader.problem(f"{where}.fabric", _("is required"))
        reader.duration(args.get("outage"), f"{where}.outage")
    if kind in ("set", "load") and not args.get("model"):
        reader.problem(f"{where}.model", _("is required"))
    if kind == "set":
        for key in ("min", "max"):
            if key in args:
                reader.whole(args[key], f"{where}.{key}", 0)
        if "class" in args:
            reader.choice(args["class"], f"{where}.class", CLASSES, "")
    if kind == "load" and not any(k in args for k in ("rps", "factor")):
        reader.problem(where, _("give rps or factor"))
    if at is None:
        return None
    text = f"{kind} " + ", ".join(f"{k}={v}" for k, v in args.items())
    return Event(at=at, kind=kind, args=dict(args), text=text, path=path)


def _event_values(reader: _Reader, kind: str, args: dict[str, Any], where: str) -> None:
    """The values a run reads as numbers or names are numbers and names."""
    names = args.get("nodes")
    if (
        names is not None
        and not isinstance(names, str)
        and (not isinstance(names, list) or not all(isinstance(n, str | int) for n in names))
    ):
        reader.problem(f"{where}.nodes", _("must be a node's name or a list of names"))
    if kind == "lose" and "count" in args:
        reader.whole(args["count"], f"{where}.count", 1)
    for key in ("rps", "factor") if kind == "load" else ():
        value = args.get(key)
        if key in args and (isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e12):
            reader.problem(f"{where}.{key}", _("must be a number of at least 0"))


_TOP = (
    "start",
    "step",
    "duration",
    "ready_after",
    "from_cluster",
    "node_types",
    "nodes",
    "models",
    "quotas",
    "power",
    "events",
    "report",
)


def _declared(raw: Any) -> int:
    """The `count` an entry declares (1 when it gives none or a wrong one, which is said elsewhere)."""
    count = raw.get("count") if isinstance(raw, dict) else None
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1


def _fleet(reader: _Reader, data: dict[str, Any], live: dict[str, Any] | None, from_cluster: bool) -> tuple[Any, Any]:
    """The node types and groups; the nodes and GPUs they add up to (with the live fleet's when
    the run starts from it) are held to the limits before anything is built."""
    limits = reader.limits
    types_raw = data.get("node_types") or {}
    if not isinstance(types_raw, dict):
        reader.problem("scenario.node_types", _("must be a mapping of type name to its hardware"))
        types_raw = {}
    if not reader.listed(types_raw, "scenario.node_types", limits.node_types, pgettext("counted", "node types")):
        types_raw = {}
    types = {str(name): _node_type(reader, str(name), raw, f"node_types.{name}") for name, raw in types_raw.items()}
    groups_raw = data.get("nodes") or []
    if not isinstance(groups_raw, list):
        reader.problem("scenario.nodes", _("must be a list of node groups"))
        groups_raw = []
    if not reader.listed(groups_raw, "scenario.nodes", limits.groups, pgettext("counted", "node groups")):
        groups_raw = []
    groups = [g for i, raw in enumerate(groups_raw) if (g := _group(reader, raw, f"nodes[{i}]", types)) is not None]
    if not groups and not from_cluster:
        reader.problem("scenario.nodes", _("describe at least one group of nodes, or start from_cluster"))
    nodes = sum(g.count for g in groups)
    gpus = sum(g.count * len(types[g.type].gpus) for g in groups if g.type in types)
    if from_cluster and live:
        nodes += len(live)
        gpus += sum(len(hardware.get("gpus") or ()) for hardware in live.values())
    reader.at_most(nodes, limits.nodes, "scenario.nodes", pgettext("counted", "nodes"))
    reader.at_most(gpus, limits.gpus, "scenario.nodes", pgettext("counted", "GPUs"))
    return types, groups


def _models_part(reader: _Reader, data: dict[str, Any]) -> list[ModelSpec]:
    """The models, counted from their declared `count`s first: past the limit none is built.
    Each name may be described once (counted in one pass)."""
    models_raw = data.get("models") or []
    if not isinstance(models_raw, list):
        reader.problem("scenario.models", _("must be a list of models"))
        return []
    declared = sum(_declared(raw) for raw in models_raw)
    if not reader.at_most(declared, reader.limits.models, "scenario.models", pgettext("counted", "models")):
        return []
    models = [m for i, raw in enumerate(models_raw) for m in _model(reader, raw, f"models[{i}]")]
    seen = Counter(m.name for m in models)
    for name in sorted(n for n, times in seen.items() if times > 1):
        reader.problem("scenario.models", _("model %(name)s is described twice") % {"name": name})
    return models


def _quotas(reader: _Reader, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    quotas_raw = data.get("quotas") or {}
    quotas: dict[str, dict[str, Any]] = {}
    if not reader.listed(quotas_raw, "scenario.quotas", reader.limits.quotas, pgettext("counted", "quotas")):
        return quotas
    for key, raw in quotas_raw.items() if isinstance(quotas_raw, dict) else []:
        q = reader.mapping(raw, f"quotas.{key}", ("gpus", "cpu_cores", "memory", "replicas"))
        quotas[str(key)] = {
            "gpus": reader.whole(q.get("gpus"), f"quotas.{key}.gpus", 0),
            "cpu_cores": q.get("cpu_cores"),
            "memory_bytes": _size(q["memory"]) if q.get("memory") is not None else None,
            "replicas": reader.whole(q.get("replicas"), f"quotas.{key}.replicas", 0),
        }
    return quotas


def _caps(reader: _Reader, data: dict[str, Any]) -> dict[str, float]:
    power = reader.mapping(data.get("power") or {}, "scenario.power", ("caps",))
    caps: dict[str, float] = {}
    caps_raw = power.get("caps") or {}
    if not reader.listed(caps_raw, "power.caps", reader.limits.caps, pgettext("counted", "power caps")):
        return caps
    for domain, value in caps_raw.items() if isinstance(caps_raw, dict) else []:
        watts = _watts(value)
        if watts is None or "=" not in str(domain):
            reader.problem(f"power.caps.{domain}", _("must be a domain such as rack=r12 with a power such as 30kW"))
        else:
            caps[str(domain)] = watts
    return caps


def _events(reader: _Reader, data: dict[str, Any], known: set[str], from_cluster: bool) -> list[Event]:
    events_raw = data.get("events") or []
    if not isinstance(events_raw, list):
        reader.problem("scenario.events", _("must be a list of events"))
        return []
    if not reader.at_most(len(events_raw), reader.limits.events, "scenario.events", pgettext("counted", "events")):
        return []
    events = [e for i, raw in enumerate(events_raw) if (e := _event(reader, raw, f"events[{i}]")) is not None]
    events.sort(key=lambda e: e.at)
    for event in events:
        model = event.args.get("model")
        if model is not None and str(model) not in known and not from_cluster:
            reader.problem(f"{event.path}.{event.kind}.model", _("no model %(name)s in the scenario") % {"name": model})
    return events


def _replicas(reader: _Reader, models: list[ModelSpec], events: list[Event]) -> None:
    """The replicas the models may reach: each model's max, or what a `set` event raises it to."""
    top = {m.name: m.max for m in models}
    for event in events:
        if event.kind != "set":
            continue
        asked = [v for k in ("min", "max") if isinstance(v := event.args.get(k), int) and not isinstance(v, bool)]
        name = str(event.args.get("model"))
        top[name] = max([top.get(name, 0), *asked])
    reader.at_most(sum(top.values()), reader.limits.replicas, "scenario.models", pgettext("counted", "replicas"))


def _start(reader: _Reader, data: dict[str, Any], now: datetime | None) -> datetime:
    start = now or datetime.now(UTC).replace(second=0, microsecond=0)
    value = data.get("start")
    if value is None:
        return start
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    try:
        found = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        reader.problem("scenario.start", _("must be a date and time such as 2026-12-01T00:00:00Z"))
        return start
    return found if found.tzinfo else found.replace(tzinfo=UTC)


def _timing(reader: _Reader, data: dict[str, Any], start: datetime, events: list[Event]) -> tuple[Any, Any]:
    """The step and the duration; the steps they make held to the limit, and the run's end a
    date a calendar holds."""
    step = reader.duration(data.get("step"), "scenario.step", timedelta(minutes=1)) or timedelta(minutes=1)
    if step <= timedelta(0):
        reader.problem("scenario.step", _("must be longer than 0"))
        step = timedelta(minutes=1)
    last = max((e.at for e in events), default=timedelta(0))
    found = reader.duration(data.get("duration"), "scenario.duration", last + timedelta(hours=1))
    duration = found if found is not None else timedelta(hours=1)
    passes = int(duration / step) + 1
    if passes > reader.limits.steps:
        reader.problem(
            "scenario.duration",
            _("%(steps)s steps of %(step)s is more than the %(max)s a run here may take")
            % {"steps": figure(passes), "step": step, "max": figure(reader.limits.steps)},
        )
    try:
        start + duration + MAX_DURATION  # the run's end, and an outage past it
    except OverflowError:
        reader.problem("scenario.start", _("is too late: the run would end past the year 9999"))
    return step, duration


def parse(
    source: str | dict[str, Any],
    *,
    base: Path | None = None,
    captures: Path | None = None,
    live: dict[str, Any] | None = None,
    now: datetime | None = None,
    limits: Limits | None = None,
) -> Scenario:
    """Read a scenario; raises ScenarioError listing every problem. `base`: the folder captured
    files are looked up in first (the scenario file's); `live`: the cluster's nodes by name, for
    node types written `like: NAME` and for `from_cluster: true` (None: no cluster to start
    from); `limits`: what the run may ask (by default `llmgw sim`'s, Limits.cli())."""
    limits = limits or Limits.cli()
    document: Any = source
    if isinstance(source, str):
        try:
            document = load_text(source, limits)
        except ValueError as exc:
            raise ScenarioError([str(exc)]) from None
    too_big = written_size(document, limits.written_size)
    if too_big is not None:
        raise ScenarioError([too_big])
    reader = _Reader(base, captures, live, limits)
    data = reader.mapping(document if document is not None else {}, "scenario", _TOP)
    start = _start(reader, data, now)
    from_cluster = bool(data.get("from_cluster"))
    if from_cluster and live is None:
        reader.problem("scenario.from_cluster", _("needs the cluster's nodes, which this run cannot read"))
    types, groups = _fleet(reader, data, live, from_cluster)
    models = _models_part(reader, data)
    quotas = _quotas(reader, data)
    caps = _caps(reader, data)
    known = {m.name for m in models}
    events = _events(reader, data, known, from_cluster)
    _replicas(reader, models, events)
    step, duration = _timing(reader, data, start, events)
    report = reader.mapping(data.get("report") or {}, "scenario.report", ("model",))
    report_model = str(report["model"]) if report.get("model") else None
    if report_model and report_model not in known and not from_cluster:
        reader.problem("report.model", _("no model %(name)s in the scenario") % {"name": report_model})
    ready_after = reader.duration(data.get("ready_after"), "scenario.ready_after", timedelta(minutes=2))
    if reader.problems:
        raise ScenarioError(reader.all_problems())
    return Scenario(
        start=start,
        step=step,
        duration=duration,
        ready_after=ready_after or timedelta(0),
        node_types=types,
        groups=groups,
        models=models,
        quotas=quotas,
        caps=caps,
        events=events,
        report_model=report_model,
        from_cluster=from_cluster,
    )
