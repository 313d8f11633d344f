"""Console pages for models: the list, one model's card, why it runs where it does, and changing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.forms import Form
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext as _

from agent.messages import ShardFigures
from apps.accounts.access import can_change_cluster, can_read_everything, requires
from apps.accounts.models import User
from apps.catalog import cards, services
from apps.catalog.choices import CapacityClass, Engine
from apps.catalog.forms import ClassForm, OwnerForm, ResourcesForm, TargetForm, memory_text
from apps.catalog.models import Model, Profile
from apps.cluster import model_api as api
from apps.cluster import model_selectors as selectors
from apps.cluster.choices import ReplicaState, ShardState
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.models import Node, Replica, Shard
from apps.cluster.overview import fleet_prefix, short_name
from llmgw.http import HtmxHttpRequest, client_address, is_fragment

__all__ = [
    "model_class",
    "model_delete",
    "model_detail",
    "model_explain",
    "model_owner",
    "model_resources",
    "model_target",
    "models",
]


def _get_model_for_user(user: Any, name: str, *, perm: str = "view") -> Model:
    """The model called `name`, with its profiles, replicas and shards, if `user` may see (or change) it.

    The permission is checked first, so an outsider cannot tell which model names exist.
    """
    allowed = can_change_cluster(user) if perm == "change" else can_read_everything(user)
    if not allowed:
        raise PermissionDenied
    model = selectors.models_with_replicas().filter(name=name).first()
    if model is None:
        raise Http404
    return model


def _class_label(model: Model) -> str:
    return str(CapacityClass(model.effective_class).label)


def _engine_label(engine: str) -> str:
    return str(Engine(engine).label) if engine in Engine.values else engine


# The list ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRow:
    """One line of the models page."""

    model: Model
    class_label: str
    status: dict[str, Any]
    runs_on: str
    nodes: list[tuple[str, str]]  # (short, full)

    @property
    def nodes_title(self) -> str:
        return ", ".join(full for _short, full in self.nodes)


def _runs_on(model: Model) -> str:
    """Engine and accelerator of each profile, highest priority first: "vLLM H100-80GB, llama.cpp cpu"."""
    seen: dict[str, None] = {}
    for profile in sorted(model.profiles.all(), key=lambda p: (-p.priority, p.name)):
        seen.setdefault(f"{_engine_label(profile.engine)} {profile.accelerator}", None)
    return ", ".join(seen)


def _model_rows() -> list[ModelRow]:
    models = list(selectors.models_with_replicas().order_by("name"))
    prefix = fleet_prefix()
    rows = []
    for model in models:
        status = selectors.model_status(model)
        rows.append(
            ModelRow(
                model=model,
                class_label=_class_label(model),
                status=status,
                runs_on=_runs_on(model),
                nodes=[(short_name(name, prefix), name) for name in status["nodes"]],
            )
        )
    return rows


@requires("read_everything", methods=["GET"])
def models(request: HtmxHttpRequest) -> HttpResponse:
    template = "catalog/models.html"
    if is_fragment(request):
        template += "#model-table"
    return render(request, template, {"rows": _model_rows()})


# One model ---------------------------------------------------------------------------------------


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass(frozen=True)
class ShardNote:
    node: str
    rank: int
    exit_code: int | None
    message: str
    log_tail: list[str]


CARD_REFUSALS = 5  # refusals of a pending replica shown on the card; explain shows every one


@dataclass(frozen=True)
class ReplicaRow:
    """One replica on the card: where it runs, and what it uses against what it claims."""

    replica: Replica
    profile: str | None
    shards: list[Shard]
    cpu_used: float | None
    cpu_claimed: float | None
    memory_used: int | None
    memory_claimed: int | None
    notes: list[ShardNote] = field(default_factory=list)

    @property
    def gpus(self) -> str:
        if not any(s.gpu_indices for s in self.shards):
            return ""
        return " / ".join(",".join(str(i) for i in s.gpu_indices) or "-" for s in self.shards)

    @property
    def ports(self) -> str:
        return ", ".join(str(s.port) for s in self.shards)

    @property
    def draining(self) -> bool:
        """Stopping, with an engine still running for the requests in flight."""
        return self.replica.state == ReplicaState.STOPPING and any(s.state == ShardState.DRAINING for s in self.shards)

    @property
    def message(self) -> str:
        replica = self.replica
        if self.draining and replica.stop_reason:
            return _(
                "Draining (%(reason)s): its engine runs on for the requests in flight, %(grace)s s at most, "
                "and stops once idle."
            ) % {"reason": replica.get_stop_reason_display(), "grace": replica.drain_grace or 0}
        return replica.message or next((n.message for n in self.notes if n.message), "")

    @property
    def refusals(self) -> list[str]:
        """Why a pending replica is not placed: the first refusals placement met, in the reader's language."""
        if self.replica.state != ReplicaState.PENDING:
            return []
        found = [r for r in self.replica.rejections or [] if isinstance(r, dict)]
        return [selectors.translate_reason(r) for r in found[:CARD_REFUSALS]]

    @property
    def memory_over(self) -> bool:
        return bool(self.memory_used is not None and self.memory_claimed and self.memory_used > self.memory_claimed)

    @property
    def cpu_over(self) -> bool:
        return bool(self.cpu_used is not None and self.cpu_claimed and self.cpu_used > self.cpu_claimed)


def _sample_shards(node: Node, now: datetime) -> dict[str, ShardFigures]:
    """What the node's latest fresh sample says each shard uses, by shard id ("r12s0"); empty when stale."""
    sample = node.fresh_sample(now)
    return {e["shard"]: e for e in sample.get("shards") or []} if sample is not None else {}


def _measured(shards: list[Shard], now: datetime) -> tuple[float | None, int | None]:
    """Cores and bytes the shards' processes use now; None when any shard's figure is unknown."""
    if not shards:
        return None, None
    cores: list[float | None] = []
    memory: list[float | None] = []
    for shard in shards:
        entry = _sample_shards(shard.node, now).get(shard.shard_id)
        cores.append(_number(entry.get("cpu_cores")) if entry is not None else None)
        memory.append(_number(entry.get("memory_bytes")) if entry is not None else None)
    return (
        None if None in cores else sum(c or 0 for c in cores),
        None if None in memory else int(sum(m or 0 for m in memory)),
    )


def _replica_rows(model: Model, now: datetime | None = None) -> list[ReplicaRow]:
    now = now or timezone.now()
    profiles = {p.pk: p.name for p in model.profiles.all()}
    rows = []
    for replica in model.replicas.all():
        shards = list(replica.shards.all())
        cpu_used, memory_used = _measured(shards, now)
        rows.append(
            ReplicaRow(
                replica=replica,
                profile=profiles.get(replica.profile_id) if replica.profile_id else None,
                shards=shards,
                cpu_used=cpu_used,
                cpu_claimed=sum(s.cpu_cores for s in shards) if shards else None,
                memory_used=memory_used,
                memory_claimed=sum(s.memory_bytes for s in shards) if shards else None,
                notes=[
                    ShardNote(
                        node=s.node.name,
                        rank=s.rank,
                        exit_code=s.exit_code,
                        message=s.message,
                        log_tail=[str(line) for line in s.log_tail or []],
                    )
                    for s in shards
                    if s.exit_code is not None or s.log_tail or s.message
                ],
            )
        )
    return rows


def _running(model: Model) -> int:
    """Replicas placed and not on their way out: what an always-running count starts from."""
    return sum(1 for r in model.replicas.all() if r.state not in (ReplicaState.STOPPING, ReplicaState.PENDING))


def _headroom(model: Model) -> dict[str, int] | None:
    """How many more replicas fit, by dry-running placement. Nothing is placed for an external model."""
    if model.is_external or not model.profiles.all():
        return None
    return api.headroom(model)


def _owner(model: Model) -> str:
    parts = [o.name for o in (model.organization, model.team, model.project) if o is not None]
    return " / ".join(parts)


def _card_context(
    request: HtmxHttpRequest, model: Model, *, notice: str | None = None, forms: dict[str, Form] | None = None
) -> dict[str, Any]:
    """What the card partial needs. `forms` holds bound forms with errors to show instead of fresh ones."""
    forms = forms or {}
    can_change = can_change_cluster(request.user)
    profiles = sorted(model.profiles.all(), key=lambda p: (-p.priority, p.name))
    context: dict[str, Any] = {
        "model": model,
        "profiles": profiles,
        "class_label": _class_label(model),
        "owner": _owner(model),
        "headroom": _headroom(model),
        "can_change": can_change,
        "notice": notice,
        "wanted_now": model.wanted_replicas(timezone.now()),
        "rolling": selectors.rolling_status(model, list(model.replicas.all()), model.wanted_replicas(timezone.now())),
    }
    if can_change:
        context["target_form"] = forms.get("target") or TargetForm.for_model(model)
        context["class_form"] = forms.get("class") or ClassForm.for_model(model)
        context["owner_form"] = forms.get("owner") or OwnerForm.for_model(model)
        failed = forms.get("resources")
        context["resource_forms"] = [
            (p, failed if failed is not None and failed.data.get("profile") == p.name else ResourcesForm.for_profile(p))
            for p in profiles
        ]
        # A form for a profile that does not exist has no place of its own on the card.
        orphan = failed is not None and all(failed.data.get("profile") != p.name for p in profiles)
        context["resources_error"] = failed.non_field_errors() if orphan and failed is not None else None
    context.update(EXTENSIONS.model_page(model, can_change))  # the LoRA adapters (the mirror)
    return context


@requires("read_everything", methods=["GET"])
def model_detail(request: HtmxHttpRequest, name: str) -> HttpResponse:
    model = _get_model_for_user(request.user, name)
    # What other apps add under the replicas (who holds and waits for the slots): refreshed with them.
    live = {"model": model, "replicas": _replica_rows(model), "card_parts": cards.parts_for(model, request.user)}
    if is_fragment(request):  # the replicas refresh themselves; headroom is worked out only with the card
        return render(request, "catalog/model_detail.html#model-replicas", live)
    from apps.cluster.engine_history import model_charts

    charts = [] if model.is_external else model_charts(model.name)
    return render(
        request, "catalog/model_detail.html", {**_card_context(request, model), **live, "engine_charts": charts}
    )


# Changing a model --------------------------------------------------------------------------------


def _actor(request: HtmxHttpRequest) -> User:
    user: User = request.user  # type: ignore[assignment]
    return user


def _add_errors(form: Form, exc: ValidationError, rename: dict[str, str] | None = None) -> None:
    """Put a service's ValidationError on the form: on the field it names where the form has it."""
    if not hasattr(exc, "error_dict"):
        form.add_error(None, exc.messages)
        return
    for key, errors in exc.message_dict.items():
        key = (rename or {}).get(key, key)
        form.add_error(key if key in form.fields and key != "profile" else None, errors)


def _changed(request: HtmxHttpRequest, name: str, notice: str) -> HttpResponse:
    """After a change (or none): the card again for htmx, else back to the card with a message."""
    if is_fragment(request):
        model = _get_model_for_user(request.user, name)
        return render(request, "catalog/model_detail.html#model-card", _card_context(request, model, notice=notice))
    messages.success(request, notice)
    return HttpResponseRedirect(reverse("catalog:model", args=[name]))


def _refused(request: HtmxHttpRequest, name: str, **forms: Form) -> HttpResponse:
    """The card with the form's errors; the model is read again, so nothing half-applied shows."""
    model = _get_model_for_user(request.user, name)
    context = _card_context(request, model, forms=forms)
    if is_fragment(request):
        return render(request, "catalog/model_detail.html#model-card", context)
    return render(request, "catalog/model_detail.html", {**context, "replicas": _replica_rows(model)})


def target_refusal(model: Model, new_min: int) -> str | None:
    """Why `new_min` always-running replicas cannot be had, or None: the same rule as the API's target action."""
    running = _running(model)
    need = new_min - running
    if need <= 0:
        return None
    room = api.headroom(model)
    if need <= room["with_preemption"]:
        return None
    return _(
        "Only %(fit)s more replicas of %(name)s fit (%(now)s without preemption); %(min)s always-running "
        "would need %(need)s more."
    ) % {
        "fit": room["with_preemption"],
        "name": model.name,
        "now": room["without_preemption"],
        "min": new_min,
        "need": need,
    }


@requires("change_cluster", methods=["POST"])
def model_delete(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Take the model out of service (asked to confirm in the page): routes stop, replicas stop."""
    model = _get_model_for_user(request.user, name, perm="change")
    services.delete_model(model, actor=_actor(request), address=client_address(request))
    messages.success(
        request, _("Model “%(name)s” deleted: its replicas are stopping; its usage history stays.") % {"name": name}
    )
    return HttpResponseRedirect(reverse("catalog:models"))


@requires("change_cluster", methods=["POST"])
def model_target(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Set the always-running and under-load replica counts; only what changed is applied."""
    model = _get_model_for_user(request.user, name, perm="change")
    form = TargetForm.for_model(model, request.POST)
    if not form.is_valid():
        return _refused(request, name, target=form)
    wanted = {
        key: form.cleaned_data[key]
        for key in ("min_replicas", "max_replicas")
        if form.cleaned_data[key] != getattr(model, key)
    }
    if not wanted:
        return _changed(request, name, _("Nothing changed."))
    if "min_replicas" in wanted and not model.is_external:
        refusal = target_refusal(model, wanted["min_replicas"])
        if refusal:
            form.add_error("min_replicas", refusal)
            return _refused(request, name, target=form)
    try:
        model = services.set_target(model, **wanted, actor=_actor(request))
    except ValidationError as exc:
        _add_errors(form, exc)
        return _refused(request, name, target=form)
    return _changed(
        request,
        name,
        _("%(name)s: %(min)s always running, up to %(max)s under load.")
        % {"name": model.name, "min": model.min_replicas, "max": model.max_replicas},
    )


@requires("change_cluster", methods=["POST"])
def model_class(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Set the capacity class, which decides what may be stopped to make room for the model."""
    model = _get_model_for_user(request.user, name, perm="change")
    form = ClassForm.for_model(model, request.POST)
    if not form.is_valid():
        return _refused(request, name, **{"class": form})
    capacity_class = form.cleaned_data["capacity_class"]
    if capacity_class == model.capacity_class:
        return _changed(request, name, _("Nothing changed."))
    try:
        model = services.set_class(model, capacity_class, actor=_actor(request))
    except ValidationError as exc:
        _add_errors(form, exc)
        return _refused(request, name, **{"class": form})
    return _changed(
        request,
        name,
        _("%(name)s is now in the “%(class)s” class.") % {"name": model.name, "class": _class_label(model)},
    )


@requires("change_cluster", methods=["POST"])
def model_owner(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Set whose capacity quotas the model counts against."""
    model = _get_model_for_user(request.user, name, perm="change")
    form = OwnerForm.for_model(model, request.POST)
    if not form.is_valid():
        return _refused(request, name, owner=form)
    before = _owner(model)
    model = services.set_owner(model, **form.chosen(), actor=_actor(request))
    if _owner(model) == before:
        return _changed(request, name, _("Nothing changed."))
    return _changed(
        request, name, _("%(name)s now belongs to %(owner)s.") % {"name": model.name, "owner": _owner(model) or "-"}
    )


def _profile(model: Model, name: str) -> Profile | None:
    return next((p for p in model.profiles.all() if p.name == name), None)


@requires("change_cluster", methods=["POST"])
def model_resources(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Set the memory and cores one profile claims; only what changed is applied."""
    model = _get_model_for_user(request.user, name, perm="change")
    profile = _profile(model, request.POST.get("profile", ""))
    if profile is None:
        form = ResourcesForm(request.POST)
        form.is_valid()
        form.add_error(None, _("No profile “%(name)s”.") % {"name": request.POST.get("profile", "")})
        return _refused(request, name, resources=form)
    form = ResourcesForm.for_profile(profile, request.POST)
    if not form.is_valid():
        return _refused(request, name, resources=form)
    wanted: dict[str, Any] = {}
    if form.cleaned_data["memory"] != profile.memory_bytes:
        wanted["memory_bytes"] = form.cleaned_data["memory"]
    if form.cleaned_data["cpu_cores"] != profile.cpu_cores:
        wanted["cpu_cores"] = form.cleaned_data["cpu_cores"]
    if not wanted:
        return _changed(request, name, _("Nothing changed."))
    try:
        changed = services.set_resources(model, profile_name=profile.name, **wanted, actor=_actor(request))
    except ValidationError as exc:
        _add_errors(form, exc, {"memory_bytes": "memory"})
        return _refused(request, name, resources=form)
    profile = changed[0]
    return _changed(
        request,
        name,
        _("Profile %(profile)s of %(name)s now claims %(memory)s and %(cores)s cores.")
        % {
            "profile": profile.name,
            "name": model.name,
            "memory": memory_text(profile.memory_bytes),
            "cores": f"{profile.cpu_cores:g}",
        },
    )


# Why it runs where it does -----------------------------------------------------------------------


@requires("read_everything", methods=["GET"])
def model_explain(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Where each placed replica runs and why (its own claims not counted against it); each profile
    against every node for one more replica, with all the reasons each was refused; and what each
    replica met when it was placed."""
    model = _get_model_for_user(request.user, name)
    show_all = request.GET.get("nodes") == "all"
    limit = None if show_all else api.EXPLAIN_NODES
    verdicts = [] if model.is_external else sorted(api.explain_model(model, limit), key=lambda v: -v["priority"])
    placed, more_placed = ([], 0) if model.is_external else api.explain_placed(model)
    replicas: list[dict[str, Any]] = [
        {
            "replica": replica,
            "rejections": [
                {"profile": r.get("profile"), "node": r.get("node"), "reason": selectors.translate_reason(r)}
                for r in replica.rejections or []
                if isinstance(r, dict)
            ],
        }
        for replica in model.replicas.all()
    ]
    # The title says why it runs where it does only where it runs: on a node, or at its provider.
    runs_somewhere = model.is_external or any(
        r["replica"].state in (ReplicaState.STARTING, ReplicaState.READY) for r in replicas
    )
    return render(
        request,
        "catalog/model_explain.html",
        {
            "model": model,
            "verdicts": verdicts,
            "replicas": replicas,
            "runs_somewhere": runs_somewhere,
            "placed": placed,
            "more_placed": more_placed,
            "limit": limit,
        },
    )


EXAMPLE_SPEC = """models:
  - name: qwen2.5-1.5b
    replicas: {min: 1, max: 2}
    source: /models/qwen2.5-1.5b-instruct-q4_k_m.gguf
    profiles:
      - {name: cpu, engine: llama.cpp, accelerator: cpu, memory: 4GB, cpu_cores: 4}
"""


@requires("change_cluster", methods=["GET", "POST"])
def model_apply(request: HtmxHttpRequest) -> HttpResponse:
    """Declare models in the console: the same YAML as `llmgw ctl model apply -f`."""
    import yaml

    # The form starts empty, the example only its placeholder: one click on Apply declares nothing.
    text = ""
    errors: dict[str, list[str]] = {}
    results: list[services.ApplyResult] = []
    if request.method == "POST":
        text = request.POST.get("spec", "")
        if not text.strip():
            errors = {"yaml": [_("Nothing to declare: write the models as YAML, as in the example.")]}
            return render(
                request,
                "catalog/model_apply.html",
                {"spec": text, "errors": errors, "results": results, "example": EXAMPLE_SPEC},
            )
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            errors = {"yaml": [_("This is not valid YAML: %(error)s") % {"error": exc}]}
        else:
            try:
                results = services.apply_models(
                    data if isinstance(data, dict) else {"models": data}, actor=_actor(request)
                )
            except services.SpecError as exc:
                errors = exc.errors
    return render(
        request,
        "catalog/model_apply.html",
        {"spec": text, "errors": errors, "results": results, "example": EXAMPLE_SPEC},
    )
