"""The Serve form of a held version: its defaults from the fleet as it is now, and placement's dry
run on the model it would declare, so that the form refuses, with the numbers, what placement
would refuse rather than declare a model that stays pending."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from django.utils.translation import gettext as _

from apps.cluster.placement import Inventory
from apps.mirror import hub, services
from apps.mirror.hub import MirrorError
from apps.mirror.models import MirrorVersion

__all__ = ["DEFAULT_CORES", "Form", "Room", "Verdict", "dry_run", "fleet_room", "read_form"]

DEFAULT_CORES = 4  # a CPU replica's cores when the fleet has more free, or says nothing of its cores
SHOWN_REFUSALS = 8  # nodes whose refusal the form spells out; the others are counted


@dataclass(frozen=True)
class Room:
    """What the fleet has free now for one more replica, on its ready, uncordoned nodes: the node
    with the most CPU cores free (its free cores and memory, None where it reports none), and each
    GPU class with its free and total cards, freest first."""

    node: str | None
    cores_free: float | None
    cpus: int | None
    memory_free: int | None
    memory_total: int | None
    classes: list[dict[str, Any]] = field(default_factory=list)

    @property
    def free_gpus(self) -> int:
        return sum(int(c["free"]) for c in self.classes)

    @property
    def default_cores(self) -> int:
        """As many cores as the freest node has free, up to DEFAULT_CORES, and at least one."""
        if self.cores_free is None:
            return DEFAULT_CORES
        return max(1, min(DEFAULT_CORES, math.floor(self.cores_free)))

    @property
    def default_placement(self) -> str:
        return str(self.classes[0]["name"]) if self.classes and self.classes[0]["free"] else "cpu"


def fleet_room(inventory: Inventory) -> Room:
    usable = [n for n in inventory.nodes.values() if n.ready and not n.cordoned]
    ready = {n.id for n in usable}
    per: dict[str, dict[str, int]] = {}
    for node in inventory.nodes.values():
        for cls in sorted({g.gpu_class for g in node.gpus if g.gpu_class}):
            row = per.setdefault(cls, {"free": 0, "total": 0})
            row["free"] += inventory.free_count(node.id, cls) if node.id in ready else 0
            row["total"] += sum(1 for g in node.gpus if g.gpu_class == cls)
    order = sorted(per, key=lambda cls: (-per[cls]["free"], cls))
    classes: list[dict[str, Any]] = [{"name": cls, **per[cls]} for cls in order]
    known = [n for n in usable if n.cpus is not None]
    if not known:
        return Room(None, None, None, None, None, classes)
    best = max(known, key=lambda n: (inventory.cores_free(n.id) or 0.0, inventory.memory_free(n.id) or 0, n.name))
    return Room(
        best.name,
        inventory.cores_free(best.id),
        best.cpus,
        inventory.memory_free(best.id),
        best.memory_total_bytes,
        classes,
    )


@dataclass(frozen=True)
class Verdict:
    """Where placement would put one replica of the model the form declares (`node`), or why no node
    would take it: each refusal in the reader's language, and how many more nodes refused."""

    node: str | None
    refusals: list[str] = field(default_factory=list)
    more: int = 0

    @property
    def fits(self) -> bool:
        return self.node is not None


def dry_run(inventory: Inventory, name: str, source: str, profile: dict[str, Any]) -> Verdict:
    """Placement's explain, on a copy of its plugins whose weights filter is the one for a model not
    declared yet (its nodes have not been told to fetch it: a node is refused only where its model
    directories cannot hold the source, or it already refused or failed to fetch it)."""
    from apps.catalog.models import Model, Profile
    from apps.cluster import placement
    from apps.cluster.decisions import replica_request
    from apps.cluster.model_selectors import translate_reason
    from apps.cluster.placement.filters import weights_can_arrive

    registry = placement.REGISTRY.copy()
    registry.register_filter(
        weights_can_arrive, name="weights", order=75, applies=lambda ctx: ctx.request.source.startswith("/")
    )
    row = Profile(
        name=profile["name"],
        engine=profile["engine"],
        accelerator=profile["accelerator"],
        gpus_per_shard=int(profile.get("gpus_per_shard") or 0),
        cpu_cores=float(profile.get("cpu_cores") or 0),
        memory_bytes=int(profile.get("memory_bytes") or 0),
    )
    request = replica_request(Model(name=name, source=source), [row])
    (explained,) = placement.explain(inventory, request, registry=registry, limit=SHOWN_REFUSALS)
    if explained.fits and explained.placement is not None:
        return Verdict(explained.placement.shards[0].node_name)
    refusals = [translate_reason(r.to_dict()) for n in explained.nodes for r in n.reasons[:1]]
    refusals += [translate_reason(r.to_dict()) for r in explained.reasons if r.code != "no_fit"]
    more = sum(count for count, _example in explained.more_refused.values())
    if not refusals and not more:
        refusals = [_("The fleet has no node.")]
    return Verdict(None, refusals, more)


# The form ----------------------------------------------------------------------------------------


@dataclass
class Form:
    """What the form asks, as given or defaulted, with what it would declare (`spec`) and the
    problems found (each a sentence for the reader)."""

    name: str
    placement: str
    gpus: int
    parallel: int
    context: int
    cpu_cores: int
    allow_cpu: bool
    engine: str
    source: str
    summary: Any = None
    estimate: Any = None
    profile: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def spec(self) -> dict[str, Any]:
        profile = {k: v for k, v in self.profile.items() if k != "memory_bytes"}
        return {"name": self.name, "source": self.source, "replicas": 1, "profiles": [profile]}


def _number(data: Any, key: str, default: int, low: int, high: int, errors: list[str]) -> int:
    raw = data.get(key, str(default))
    try:
        value = int(raw)
    except (TypeError, ValueError):
        errors.append(_("%(field)s: expected a whole number, got %(value)r") % {"field": key, "value": raw})
        return default
    if not low <= value <= high:
        errors.append(
            _("%(field)s: expected %(low)s to %(high)s, got %(value)s")
            % {"field": key, "low": low, "high": high, "value": value}
        )
        return default
    return value


def _profile_name(placement: str) -> str:
    import re

    return "cpu" if placement == "cpu" else re.sub(r"[^a-z0-9-]+", "-", placement.lower()).strip("-") or "gpu"


def default_name(version: MirrorVersion) -> str:
    import re

    base = version.repo.split("/", 1)[1].lower().removesuffix("-gguf")
    quant = hub.quantisation(version.name) if version.kind == MirrorVersion.Kind.GGUF else None
    name = f"{base}-{quant.lower()}" if quant and quant.lower() not in base else base
    return re.sub(r"[^a-z0-9._-]+", "-", name).strip("-")[:60] or "model"


def _source(version: MirrorVersion) -> str:
    if version.kind != MirrorVersion.Kind.GGUF:
        return services.node_dir(version)
    first = next(f for f in version.files.all() if f.path.endswith(".gguf"))
    return services.node_path(version, first.path)


def read_form(data: Any, version: MirrorVersion, room: Room, *, posting: bool) -> Form:
    """The form's values (defaults from the fleet where a value is not given), the profile they
    make and the problems with them, placement's dry run aside."""
    errors: list[str] = []
    placement = str(data.get("placement", room.default_placement))
    if placement != "cpu" and placement not in {c["name"] for c in room.classes}:
        errors.append(_("%(placement)s is not a GPU class of this fleet") % {"placement": placement})
    gpus = _number(data, "gpus", 1, 1, 64, errors)
    parallel = _number(data, "parallel", 1, 1, 256, errors)
    cores = _number(data, "cpu_cores", room.default_cores, 1, 1024, errors)
    summary = None
    try:
        summary = services.summary(version)
    except MirrorError as exc:
        errors.append(str(exc))
    trained = summary.context_length if summary is not None else None
    form = Form(
        name=(data.get("name") or default_name(version)).strip()[:100],
        placement=placement,
        gpus=gpus,
        parallel=parallel,
        context=_number(data, "context", min(4096, trained or 4096), 16, 10**7, errors),
        cpu_cores=cores,
        allow_cpu=data.get("allow_cpu") == "on",
        engine="llama.cpp" if version.kind == MirrorVersion.Kind.GGUF else "vllm",
        source=_source(version),
        summary=summary,
        errors=errors,
    )
    _check_placement(form, room, posting=posting)
    if summary is not None and summary.kind == "model":
        form.estimate = services.summary(version, ctx_size=form.context * parallel, parallel=parallel).estimate  # type: ignore[union-attr]
    form.profile = _profile(form)
    return form


def _check_placement(form: Form, room: Room, *, posting: bool) -> None:
    if form.engine == "vllm" and form.placement == "cpu":
        form.errors.append(_("vLLM serves a safetensors set on GPUs: pick a GPU class"))
    if form.placement == "cpu" and room.free_gpus and not form.allow_cpu and posting:
        form.errors.append(
            _(
                "%(free)d GPUs are free: on the CPU this model would leave them idle and run far slower. "
                "Pick a GPU class, or tick “use the CPU anyway”."
            )
            % {"free": room.free_gpus}
        )


def _profile(form: Form) -> dict[str, Any]:
    profile: dict[str, Any] = {
        "name": _profile_name(form.placement),
        "engine": form.engine,
        "accelerator": form.placement,
        "parallel": form.parallel,
        "context_size": form.context,
    }
    if form.placement == "cpu":
        profile["cpu_cores"] = form.cpu_cores
        if form.estimate is not None:
            mib = math.ceil(form.estimate.total / 2**20)
            profile["memory"] = f"{mib}MiB"
            profile["memory_bytes"] = mib * 2**20
    else:
        profile["gpus_per_shard"] = form.gpus
    return profile
