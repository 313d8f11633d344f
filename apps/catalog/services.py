"""Declaring models: from YAML, the API or the console, all through apply_models()."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.accounts import audit
from apps.accounts.models import Organization, Project, Team, User
from apps.catalog import profile_fields
from apps.catalog.extensions import EXTENSIONS
from apps.catalog.models import Model, Profile
from apps.catalog.profile_fields import MAX_CPU_CORES, parse_memory
from llmgw.errors import ServiceError

__all__ = [
    "MAX_CPU_CORES",
    "MAX_REPLICAS",
    "ApplyResult",
    "SpecError",
    "apply_models",
    "apply_server_config",
    "delete_model",
    "parse_memory",
    "record_demand",
    "set_class",
    "set_owner",
    "set_resources",
    "set_target",
    "update_model",
    "update_profile",
]

MODEL_FIELDS = (
    "capacity_class",
    "min_replicas",
    "max_replicas",
    "source",
    "fallbacks",
    "external_url",
    "external_model",
    "external_api_key_file",
    "organization_id",
    "team_id",
    "project_id",
)
# The console's forms allow as much; a spec or the API may not ask for more.
MAX_REPLICAS = 1000


# Every key a spec may hold, per level: any other is an error naming the nearest known one (a
# typo must never be read as "not given" and reset the setting it meant).
MODEL_KEYS = frozenset({"name", "class", "replicas", "source", "fallbacks", "profiles", "external", "owner"})
REPLICA_KEYS = frozenset({"min", "max"})
EXTERNAL_KEYS = frozenset({"url", "model", "api_key_file"})
OWNER_KEYS = frozenset({"organization", "team", "project"})


def _unknown_keys(value: Any, known: frozenset[str], path: str, errors: dict[str, list[str]]) -> None:
    import difflib

    if not isinstance(value, dict):
        return
    for key in value:
        if key in known:
            continue
        near = difflib.get_close_matches(str(key), sorted(known), n=1, cutoff=0.6)
        if near:
            message = _("unknown field; did you mean %(name)s?") % {"name": near[0]}
        else:
            message = _("unknown field; the fields here are %(names)s.") % {"names": ", ".join(sorted(known))}
        errors.setdefault(f"{path}.{key}", []).append(message)


class SpecError(ServiceError):
    """Field errors keyed by their path in the spec, e.g. models[0].profiles[1].memory."""

    code = "spec_invalid"

    def __init__(self, errors: dict[str, list[str]]) -> None:
        super().__init__(_("Invalid model spec."), details=errors)
        self.errors = errors


@dataclass(frozen=True)
class ApplyResult:
    name: str
    outcome: str  # created, changed, unchanged
    changes: dict[str, Any]


def _text_problem(value: str) -> str | None:
    """Why a string cannot be stored as text (PostgreSQL refuses both), or None when it can."""
    if "\x00" in value:
        return _("Holds a NUL character (\\u0000), which text may not contain.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return _("Holds a lone UTF-16 surrogate (\\ud800 to \\udfff), which is not text.")
    return None


def _text_errors(value: Any, path: str, errors: dict[str, list[str]]) -> bool:
    """Note every string of a spec (keys too) that cannot be stored; True when there was one."""
    found = False
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            problem = _text_problem(item)
            if problem:
                errors.setdefault(where, []).append(problem)
                found = True
        elif isinstance(item, dict):
            for key, child in item.items():
                key_text = str(key)
                problem = _text_problem(key_text)
                if problem:  # named as an escape, which an answer or a log line can carry
                    escaped = key_text.encode("unicode_escape").decode("ascii")
                    errors.setdefault(f"{where}.{escaped}", []).append(problem)
                    found = True
                    continue
                stack.append((child, f"{where}.{key_text}"))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in enumerate(item))
    return found


def _owner(spec: dict[str, Any], path: str, errors: dict[str, list[str]]) -> dict[str, Any]:
    owner = spec.get("owner") or {}
    if not isinstance(owner, dict):
        errors.setdefault(f"{path}.owner", []).append(_("Expected organization, team and project slugs."))
        return {}
    found: dict[str, Any] = {"organization_id": None, "team_id": None, "project_id": None}
    org = team = None
    if owner.get("organization"):
        org = Organization.objects.filter(slug=owner["organization"]).first()
        if org is None:
            errors.setdefault(f"{path}.owner.organization", []).append(
                _("No organisation “%(slug)s”.") % {"slug": owner["organization"]}
            )
            return found
        found["organization_id"] = org.pk
    if owner.get("team"):
        team = Team.objects.filter(slug=owner["team"], **({"organization": org} if org else {})).first()
        if team is None:
            errors.setdefault(f"{path}.owner.team", []).append(_("No team “%(slug)s”.") % {"slug": owner["team"]})
            return found
        found["team_id"] = team.pk
    if owner.get("project"):
        project = Project.objects.filter(slug=owner["project"], **({"team": team} if team else {})).first()
        if project is None:
            errors.setdefault(f"{path}.owner.project", []).append(
                _("No project “%(slug)s”.") % {"slug": owner["project"]}
            )
            return found
        found["project_id"] = project.pk
    return found


def _model_values(spec: dict[str, Any], path: str, errors: dict[str, list[str]]) -> dict[str, Any]:
    replicas = spec.get("replicas", {})
    values: dict[str, Any] = {
        "capacity_class": spec.get("class", "") or "",
        "source": spec.get("source", "") or "",
        "fallbacks": spec.get("fallbacks", []) or [],
    }
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        values["min_replicas"] = values["max_replicas"] = replicas
    elif isinstance(replicas, dict):
        low = replicas.get("min", 1)
        values["min_replicas"] = low
        values["max_replicas"] = replicas.get("max", max(1, low) if isinstance(low, int) else 1)
    else:
        errors.setdefault(f"{path}.replicas", []).append(_("Expected a number or {min: N, max: M}."))
    external = spec.get("external") or {}
    if not isinstance(external, dict):
        errors.setdefault(f"{path}.external", []).append(_("Expected url, model and api_key_file."))
        external = {}
    values.update(
        {
            "external_url": external.get("url", "") or "",
            "external_model": external.get("model", "") or "",
            "external_api_key_file": external.get("api_key_file", "") or "",
        }
    )
    values.update(_owner(spec, path, errors))
    for key in ("min_replicas", "max_replicas"):
        value = values.get(key)
        if key in values and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            errors.setdefault(f"{path}.replicas", []).append(_("Expected a whole number of replicas, 0 or more."))
            values.pop(key)
        elif key in values and isinstance(value, int) and value > MAX_REPLICAS:
            errors.setdefault(f"{path}.replicas", []).append(
                _("At most %(max)s replicas; got %(value)s.") % {"max": MAX_REPLICAS, "value": value}
            )
            values.pop(key)
    if not isinstance(values["fallbacks"], list) or not all(isinstance(f, str) for f in values["fallbacks"]):
        errors.setdefault(f"{path}.fallbacks", []).append(_("Expected a list of model names."))
        values["fallbacks"] = []
    return values


def _profile_values(spec: dict[str, Any], path: str, errors: dict[str, list[str]]) -> dict[str, Any]:
    values, problems = profile_fields.read_profile(spec)
    for key, messages in problems.items():
        errors.setdefault(f"{path}.{key}", []).extend(messages)
    if values.get("accelerator", "cpu") != "cpu" and "gpus_per_shard" not in spec:
        values["gpus_per_shard"] = 1
    return values


@dataclass
class _Plan:
    """What an apply would do to one model: its fields' changes and each profile's."""

    model: Model
    changes: dict[str, Any]
    profiles: list[tuple[Profile, dict[str, Any]]]
    created: bool


@transaction.atomic
def apply_models(specs: Any, *, actor: User | None, dry_run: bool = False) -> list[ApplyResult]:
    """Create or update models and their profiles from specs; only what changed is written.

    A spec states a model's whole declaration: a field it leaves out takes its default, as on
    creation (a profile not listed is removed). An unknown key is an error naming the nearest known
    one. Everything is validated before anything is written: one bad field leaves the whole
    catalogue as it was. With `dry_run` nothing is written, and the results say field by field what
    an apply would change ([before, after]).
    """
    if isinstance(specs, dict) and "models" in specs:
        specs = specs["models"]
    if not isinstance(specs, list):
        raise SpecError({"models": [_("Expected a list of models.")]})
    errors: dict[str, list[str]] = {}
    plans: list[_Plan] = []
    names: set[str] = set()
    for i, spec in enumerate(specs):
        plan = _plan_model(spec, f"models[{i}]", names, errors)
        if plan is not None:
            plans.append(plan)
    if errors:
        raise SpecError(errors)
    return [_carry_out(plan, actor=actor, dry_run=dry_run) for plan in plans]


def _plan_model(spec: Any, path: str, names: set[str], errors: dict[str, list[str]]) -> _Plan | None:
    """One model's spec checked and set on its row (not saved); None when it cannot be planned at all."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        errors.setdefault(f"{path}.name", []).append(_("Each model needs a name."))
        return None
    # Before any lookup: the database refuses such a string even in a query.
    if _text_errors(spec, path, errors):
        return None
    _unknown_keys(spec, MODEL_KEYS, path, errors)
    if isinstance(spec.get("replicas"), dict):
        _unknown_keys(spec["replicas"], REPLICA_KEYS, f"{path}.replicas", errors)
    _unknown_keys(spec.get("external"), EXTERNAL_KEYS, f"{path}.external", errors)
    _unknown_keys(spec.get("owner"), OWNER_KEYS, f"{path}.owner", errors)
    if spec["name"] in names:
        errors.setdefault(f"{path}.name", []).append(_("“%(name)s” appears twice.") % {"name": spec["name"]})
    names.add(spec["name"])
    model = Model.objects.filter(name=spec["name"]).first()
    if model is not None and model.deleted_at is not None:
        errors.setdefault(f"{path}.name", []).append(
            _("“%(name)s” is being deleted: its replicas are stopping. Apply it again once it is gone.")
            % {"name": spec["name"]}
        )
        return None
    created = model is None
    model = model or Model(name=spec["name"])
    values = _model_values(spec, path, errors)
    before = {f: getattr(model, f) for f in MODEL_FIELDS}
    for key, value in values.items():
        setattr(model, key, value)
    try:
        model.full_clean(exclude=["organization", "team", "project"], validate_unique=False)
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            errors.setdefault(f"{path}.{field}", []).extend(messages)
    profiles = [
        planned
        for j, pspec in enumerate(_profile_specs(model, spec, path, errors))
        if (planned := _plan_profile(model, pspec, f"{path}.profiles[{j}]", errors)) is not None
    ]
    changes = {k: [before[k], getattr(model, k)] for k in MODEL_FIELDS if before[k] != getattr(model, k)}
    return _Plan(model, changes, profiles, created)


def _profile_specs(model: Model, spec: dict[str, Any], path: str, errors: dict[str, list[str]]) -> list[Any]:
    """A model spec's profiles: at least one for a model on the cluster, none for an external one."""
    profiles = spec.get("profiles", []) or []
    if not isinstance(profiles, list):
        errors.setdefault(f"{path}.profiles", []).append(_("Expected a list of profiles."))
        profiles = []
    if model.is_external and profiles:
        errors.setdefault(f"{path}.profiles", []).append(_("A model served by an external provider has no profiles."))
    if not model.is_external and not profiles:
        errors.setdefault(f"{path}.profiles", []).append(_("Give at least one profile, or an external provider."))
    return profiles


def _plan_profile(
    model: Model, spec: Any, path: str, errors: dict[str, list[str]]
) -> tuple[Profile, dict[str, Any]] | None:
    """One profile's spec checked and set on its row (not saved), with its changes ([before, after];
    every field of a new one)."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        errors.setdefault(f"{path}.name", []).append(_("Each profile needs a name."))
        return None
    _unknown_keys(spec, profile_fields.spec_keys(), path, errors)
    existing = Profile.objects.filter(model=model, name=spec["name"]).first() if model.pk else None
    profile = existing or Profile(name=spec["name"])
    fields = profile_fields.field_names()
    before = {f: getattr(profile, f) for f in fields}
    for key, value in _profile_values(spec, path, errors).items():
        setattr(profile, key, value)
    try:
        profile.full_clean(exclude=["model"], validate_unique=False)
    except ValidationError as exc:
        for field, messages in exc.message_dict.items():
            key = profile_fields.declared(field).key if field in fields else field
            errors.setdefault(f"{path}.{key}", []).extend(messages)
    after = {f: getattr(profile, f) for f in fields}
    return profile, {k: [before[k], after[k]] for k in fields if before[k] != after[k] or existing is None}


def _carry_out(plan: _Plan, *, actor: User | None, dry_run: bool) -> ApplyResult:
    """Write a planned model (unless `dry_run`), audited with its changes."""
    model, changes, created = plan.model, plan.changes, plan.created
    profile_changes = {p.name: diff for p, diff in plan.profiles if diff}
    keep = {p.name for p, _diff in plan.profiles}
    removed = [] if created else list(model.profiles.exclude(name__in=keep).values_list("name", flat=True))
    all_changes = {
        **changes,
        **({"profiles": profile_changes} if profile_changes else {}),
        **({"profiles_removed": removed} if removed else {}),
    }
    if dry_run:
        outcome = "created" if created else ("changed" if all_changes else "unchanged")
        return ApplyResult(model.name, outcome, _jsonable(all_changes))
    if not (created or all_changes):
        return ApplyResult(model.name, "unchanged", {})
    model.updated_at = timezone.now()
    model.save()
    for profile, diff in plan.profiles:
        if diff or profile.pk is None:
            profile.model = model
            profile.save()
    if removed:
        model.profiles.filter(name__in=removed).delete()
    audit.record(actor, f"model.{'create' if created else 'update'}", model, changes=_jsonable(all_changes))
    EXTENSIONS.changed()
    return ApplyResult(model.name, "created" if created else "changed", _jsonable(all_changes))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


@transaction.atomic
def set_target(
    model: Model, *, min_replicas: int | None = None, max_replicas: int | None = None, actor: User | None
) -> Model:
    """Change the always-running and under-load replica counts (only what is given)."""
    before = {"min_replicas": model.min_replicas, "max_replicas": model.max_replicas}
    if min_replicas is not None:
        model.min_replicas = min_replicas
    if max_replicas is not None:
        model.max_replicas = max_replicas
    if min_replicas is not None and max_replicas is None and model.max_replicas < model.min_replicas:
        model.max_replicas = model.min_replicas
    model.full_clean(exclude=["organization", "team", "project"], validate_unique=False)
    after = {"min_replicas": model.min_replicas, "max_replicas": model.max_replicas}
    if after != before:
        model.updated_at = timezone.now()
        model.save(update_fields=["min_replicas", "max_replicas", "updated_at"])
        audit.record(actor, "model.target", model, changes=audit.diff(before, after))
        EXTENSIONS.changed()
    return model


@transaction.atomic
def set_class(model: Model, capacity_class: str, *, actor: User | None) -> Model:
    before = {"capacity_class": model.capacity_class}
    model.capacity_class = capacity_class
    model.full_clean(exclude=["organization", "team", "project"], validate_unique=False)
    if before["capacity_class"] != capacity_class:
        model.save(update_fields=["capacity_class"])
        audit.record(actor, "model.class", model, changes=audit.diff(before, {"capacity_class": capacity_class}))
    return model


@transaction.atomic
def set_owner(
    model: Model,
    *,
    organization: Organization | None = None,
    team: Team | None = None,
    project: Project | None = None,
    actor: User | None,
) -> Model:
    """Give the model to an organisation, a team or a project (the most specific one given; its
    parents follow), or to nobody. Its replicas count against that owner's capacity quotas from
    the next placement on; what runs now keeps running."""
    if project is not None:
        team, organization = project.team, project.team.organization
    elif team is not None:
        organization = team.organization
    before = {"organization": model.organization_id, "team": model.team_id, "project": model.project_id}
    after = {
        "organization": organization.pk if organization else None,
        "team": team.pk if team else None,
        "project": project.pk if project else None,
    }
    if before != after:
        model.organization, model.team, model.project = organization, team, project
        model.save(update_fields=["organization", "team", "project"])
        audit.record(actor, "model.owner", model, changes=audit.diff(before, after))
    return model


@transaction.atomic
def set_resources(
    model: Model,
    *,
    memory_bytes: int | None = None,
    cpu_cores: float | None = None,
    profile_name: str | None = None,
    actor: User | None,
) -> list[Profile]:
    """Change the memory and cores claimed by a model's profiles (all, or the one named)."""
    profiles = list(model.profiles.all())
    if profile_name:
        profiles = [p for p in profiles if p.name == profile_name]
        if not profiles:
            raise ValidationError({"profile": [_("No profile “%(name)s”.") % {"name": profile_name}]})
    for profile in profiles:
        before = {"memory_bytes": profile.memory_bytes, "cpu_cores": profile.cpu_cores}
        if memory_bytes is not None:
            profile.memory_bytes = memory_bytes
        if cpu_cores is not None:
            profile.cpu_cores = cpu_cores
        profile.full_clean(exclude=["model"], validate_unique=False)
        after = {"memory_bytes": profile.memory_bytes, "cpu_cores": profile.cpu_cores}
        if after != before:
            profile.save(update_fields=["memory_bytes", "cpu_cores"])
            audit.record(actor, "profile.resources", profile, changes=audit.diff(before, after))
    return profiles


@transaction.atomic
def update_model(model: Model, *, actor: User | None, address: str | None = None, **changes: Any) -> Model:
    """Change some of a model's declared fields (MODEL_FIELDS) and nothing else, audited as
    "model.update" with [before, after] as an apply of the same values is. Its name and profiles
    stay; its replicas roll onto the new spec as after an apply."""
    unknown = set(changes) - set(MODEL_FIELDS)
    if unknown:
        raise TypeError(f"only declared model fields can change, not {sorted(unknown)}")
    before = {name: getattr(model, name) for name in changes}
    for name, value in changes.items():
        setattr(model, name, value)
    model.full_clean(exclude=["organization", "team", "project"], validate_unique=False)
    difference = {
        name: [before[name], getattr(model, name)] for name in changes if before[name] != getattr(model, name)
    }
    if difference:
        model.updated_at = timezone.now()
        model.save(update_fields=[*difference, "updated_at"])
        audit.record(actor, "model.update", model, changes=_jsonable(difference), address=address)
        EXTENSIONS.changed()
    return model


@transaction.atomic
def update_profile(profile: Profile, *, actor: User | None, address: str | None = None, **changes: Any) -> Profile:
    """Change some of a profile's fields (profile_fields.field_names()), audited as "profile.update"
    with [before, after]. Its model and name stay; its replicas roll onto the new spec as after an apply."""
    unknown = set(changes) - set(profile_fields.field_names())
    if unknown:
        raise TypeError(f"only profile fields can change, not {sorted(unknown)}")
    before = {name: getattr(profile, name) for name in changes}
    for name, value in changes.items():
        setattr(profile, name, value)
    profile.full_clean(exclude=["model"], validate_unique=False)
    difference = {
        name: [before[name], getattr(profile, name)] for name in changes if before[name] != getattr(profile, name)
    }
    if difference:
        profile.save(update_fields=list(difference))
        Model.objects.filter(pk=profile.model_id).update(updated_at=timezone.now())
        audit.record(
            actor, "profile.update", profile, changes=_jsonable(difference), model=profile.model.name, address=address
        )
        EXTENSIONS.changed()
    return profile


@transaction.atomic
def delete_model(model: Model, *, actor: User | None, address: str | None = None) -> Model:
    """Take a model out of service: no route serves it from now on (the gateway reloads on the
    change), its pending replicas go, the others stop once the requests they hold are answered (at
    most LLMGW_DRAIN_GRACE_SECONDS), and the reconciler removes the row once they have. Its usage
    history stays (usage names models, it does not link them)."""
    model.deleted_at = timezone.now()
    model.save(update_fields=["deleted_at"])
    stopping = EXTENSIONS.stop(model)  # the cluster app's (apps.cluster.actions.stop_model_replicas)
    audit.record(actor, "model.delete", model, replicas=stopping, address=address)
    EXTENSIONS.changed()
    return model


ON_DEMAND_KEEP = timedelta(minutes=15)


def record_demand(name: str) -> None:
    """A request is waiting for a model kept at zero replicas: keep one running for a while."""
    until = timezone.now() + ON_DEMAND_KEEP
    if Model.objects.filter(name=name, min_replicas=0).update(demand_until=until):
        with transaction.atomic():
            EXTENSIONS.changed()


def record_busy(name: str) -> bool:
    """Every replica of a model was busy and a request had to wait: let the reconciler scale it.

    Only a model allowed to grow (max above min, or already grown) is touched; returns whether one was.
    """
    now = timezone.now()
    touched = (
        Model.objects.filter(name=name)
        .filter(Q(max_replicas__gt=F("min_replicas")) | Q(load_replicas__gt=0))
        .update(busy_at=now)
    )
    if touched:
        with transaction.atomic():
            EXTENSIONS.changed()
    return bool(touched)


def apply_server_config(path: str) -> list[ApplyResult]:
    """Apply the `models:` of an operator's server.yaml (idempotent), as the worker starts."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as exc:
        raise SpecError(
            {"server.yaml": [_("Cannot read %(path)s: %(error)s") % {"path": path, "error": exc.strerror}]}
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError({"server.yaml": [_("This is not valid YAML: %(error)s") % {"error": exc}]}) from None
    if not isinstance(data, dict):
        raise SpecError({"server.yaml": [_("Expected a mapping with a “models” list.")]})
    if "models" not in data:
        return []
    return apply_models(data["models"], actor=None)
