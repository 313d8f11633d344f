"""A profile's fields, each declared once: the ones every profile has, and those apps add.

The fields of every profile are declared here; an app whose placement rule a profile sets
(facility's keep_within and power_watts) declares its own beside the rule and registers it with
placement (apps.cluster.placement.register_profile_field), which the cluster app hands the
catalogue (apps.catalog.extensions). `profile_fields()` is both, and what the rest of the
catalogue derives from it:

- `read_profile()` reads a model spec's profile (services.apply_models): its keys, each value's
  type and range, refusals that give the value and the bounds;
- the API's profile fields, the admin's, the changes services.update_profile accepts;
- `spec_values()`, `running_values()`: placement's ProfileSpec and the spec engines run with.

Each field is stored in the Profile column of its name (models.py): a new field is a column, a
migration and its declaration.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.utils.deconstruct import deconstructible
from django.utils.translation import gettext, gettext_noop

from apps.catalog.choices import Engine
from apps.catalog.extensions import EXTENSIONS
from llmgw.fields import FieldError, ProfileField
from llmgw.reasons import Reason
from llmgw.units import parse_memory

__all__ = [
    "CORE",
    "Declared",
    "GPU_MEMORY_UTILISATION",
    "MAX_CPU_CORES",
    "declared",
    "engine_problems",
    "field_names",
    "help_text",
    "label_text",
    "parse_memory",
    "profile_fields",
    "read_profile",
    "refusal_text",
    "running_values",
    "spec_keys",
    "spec_values",
    "stored_values",
]

# The console's forms allow as much; a spec or the API may not ask for more.
MAX_CPU_CORES = 4096
# What PostgreSQL's integer columns hold, so that SQLite refuses the same specs.
INT_LOW, INT_HIGH = -(2**31), 2**31 - 1


def _memory(value: Any) -> int:
    return parse_memory(value) if value is not None else 0


def _cores(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_CPU_CORES:
        raise ValueError
    return float(value)


GPU_MEMORY_UTILISATION = ProfileField(
    "gpu_memory_utilisation",
    float,
    low=0,
    high=1,
    above=True,
    running=True,
    engine_flags=(("vllm", "--gpu-memory-utilization"),),
    label=gettext_noop("GPU memory share"),
    help=gettext_noop(
        "The share of each GPU's memory vLLM may take for the model and its cache, above 0 and at most 1; "
        "unset: vLLM's own default (0.9)."
    ),
)

CORE: tuple[ProfileField, ...] = (
    ProfileField(
        "priority",
        int,
        0,
        INT_LOW,
        INT_HIGH,
        placement=True,
        label=gettext_noop("priority"),
        help=gettext_noop("The highest priority that fits wins."),
    ),
    ProfileField(
        "engine",
        str,
        Engine.LLAMA_CPP.value,
        choices=tuple(Engine.values),
        placement=True,
        running=True,
        label=gettext_noop("engine"),
    ),
    ProfileField(
        "accelerator",
        str,
        "cpu",
        placement=True,
        running=True,
        label=gettext_noop("accelerator"),
        help=gettext_noop("A GPU class such as H100-80GB, or cpu."),
    ),
    ProfileField(
        "gpus_per_shard", int, 0, 0, INT_HIGH, placement=True, running=True, label=gettext_noop("GPUs per shard")
    ),
    ProfileField(
        "nodes_per_replica", int, 1, 0, INT_HIGH, placement=True, running=True, label=gettext_noop("nodes per replica")
    ),
    ProfileField("parallel", int, 4, 0, INT_HIGH, running=True, label=gettext_noop("parallel requests")),
    ProfileField("context_size", int, None, 0, INT_HIGH, running=True, label=gettext_noop("context size")),
    ProfileField(
        "memory_bytes",
        int,
        spec_key="memory",
        aliases=("memory_gb",),
        read=_memory,
        expected=gettext_noop("Expected a size such as 24GB, 512MiB or a number of gigabytes; got “%(value)s”."),
        placement=True,
        running=True,
        label=gettext_noop("memory claim (bytes)"),
    ),
    ProfileField(
        "cpu_cores",
        float,
        0,
        0,
        MAX_CPU_CORES,
        read=_cores,
        expected=gettext_noop("Expected a number of cores from 0 to %(max)s."),
        placement=True,
        running=True,
        label=gettext_noop("CPU cores"),
    ),
    ProfileField("node_selector", dict, {}, placement=True, label=gettext_noop("node labels required")),
    ProfileField("extra_args", list, [], running=True, label=gettext_noop("extra engine arguments")),
    ProfileField("env", dict, {}, running=True, label=gettext_noop("extra environment")),
    GPU_MEMORY_UTILISATION,
)


def profile_fields() -> tuple[ProfileField, ...]:
    """Every field of a profile: those of every profile, then those apps registered."""
    return CORE + EXTENSIONS.fields()


def declared(name: str) -> ProfileField:
    for found in profile_fields():
        if found.name == name:
            return found
    raise KeyError(name)


def field_names() -> tuple[str, ...]:
    """The Profile columns a declaration holds: what an apply or an update may change."""
    return tuple(f.name for f in profile_fields())


def spec_keys() -> frozenset[str]:
    """Every key a model spec's profile may hold."""
    return frozenset({"name", *(key for f in profile_fields() for key in f.keys)})


def label_text(field: ProfileField) -> str:
    return gettext(field.label) if field.label else field.name


def help_text(field: ProfileField) -> str:
    return gettext(field.help) if field.help else ""


def refusal_text(reason: Reason) -> str:
    """A field's refusal in the reader's language, with its numbers."""
    return str(gettext(reason.template) % reason.params)


def read_profile(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """(column -> value, spec key -> problems) of a profile's spec: every field it leaves out at
    its default, as on creation; a field that cannot be read is left out of the values."""
    values: dict[str, Any] = {}
    problems: dict[str, list[str]] = {}
    for field in profile_fields():
        value = field.given(spec)
        if isinstance(value, dict | list) and value is field.default:
            value = type(value)(value)  # each profile its own copy of a default {} or []
        try:
            values[field.name] = field.parse(value)
        except FieldError as exc:
            problems.setdefault(field.key, []).append(refusal_text(exc.reason))
    return values, problems


@deconstructible
class Declared:
    """A column's validator: what its field's declaration refuses, refused where a row is checked
    (the admin, services.update_profile) as a spec is. A field whose app is not installed is not
    declared, and nothing is refused for it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, value: Any) -> None:
        try:
            problem = declared(self.name).problem(value)
        except KeyError:
            return
        if problem is not None:
            raise ValidationError(refusal_text(problem), code=problem.code)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Declared) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


def spec_values(profile: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ProfileSpec's own fields, its `extra`) of a stored profile (a row, or the simulator's copy)."""
    own = {f.name: _copy(f, getattr(profile, f.name)) for f in CORE if f.placement}
    extra = {f.name: _copy(f, getattr(profile, f.name)) for f in EXTENSIONS.fields()}
    return own, extra


def stored_values(profile: Any) -> dict[str, Any]:
    """Every declared field of a stored profile, by name (a mapping or list as its own copy)."""
    return {f.name: _copy(f, getattr(profile, f.name)) for f in profile_fields()}


def running_values(profile: Any) -> dict[str, Any]:
    """The fields its engines run with: a change to any replaces the replicas, never restarts them.
    A field passed as an engine's flag is in extra_args, and only when set: its spec, and so the
    replicas' kept specs, stay as they were while it is not."""
    values: dict[str, Any] = {}
    flags: list[str] = []
    for field in profile_fields():
        if field.engine_flags:  # on the command line, through the engine's arguments
            flags += field.arguments(profile.engine, getattr(profile, field.name))
        elif field.running:
            values[field.name] = getattr(profile, field.name)
    if flags:
        values["extra_args"] = [*flags, *(values.get("extra_args") or [])]
    return values


def engine_problems(profile: Any) -> dict[str, str]:
    """Column -> why its engine cannot take it, for each field set that the engine has no flag for."""
    problems = {}
    for field in profile_fields():
        if field.engine_flags and getattr(profile, field.name) is not None and field.flag(profile.engine) is None:
            problems[field.name] = gettext("%(engine)s takes no %(field)s; only %(engines)s does.") % {
                "engine": profile.engine,
                "field": label_text(field),
                "engines": ", ".join(engine for engine, _flag in field.engine_flags),
            }
    return problems


def _copy(field: ProfileField, value: Any) -> Any:
    """A stored value as placement takes it: unset text as "", a mapping as its own dict."""
    if value is None and field.default is not None and not isinstance(field.default, int | float):
        return type(field.default)(field.default)
    if isinstance(value, dict | list):
        return type(value)(value)
    return value
