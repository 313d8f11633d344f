"""The mirror's console pages: Held (what it holds and is fetching, live), Explore (search the Hub,
open a repository) and Fetch (URLs to fetch), each at its own address."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.translation import gettext as _

from apps.accounts.access import can_change_cluster, requires
from apps.mirror import hub, services
from apps.mirror.hub import MirrorError
from apps.mirror.models import MirrorVersion
from llmgw.http import HtmxHttpRequest, client_address, is_fragment
from llmgw.ids import parse_id


def _held_context() -> dict[str, Any]:
    versions = list(MirrorVersion.objects.prefetch_related("files"))
    on_nodes = services.node_states()
    rows = []
    active = False
    for version in versions:
        state = services.version_state(version)
        active = active or state in ("downloading", "queued")
        row: dict[str, Any] = {"version": version, "state": state, "files": list(version.files.all())}
        row["nodes"] = on_nodes.get(services.node_dir(version), [])
        try:
            row["summary"] = services.summary(version)
        except MirrorError as exc:
            row["summary_error"] = str(exc)
        rows.append(row)
    return {"rows": rows, "space": services.space(), "active": active}


@requires("read_everything", methods=["GET"])
def held(request: HtmxHttpRequest) -> HttpResponse:
    """What the mirror holds; while anything downloads, the list refreshes itself every 2 s."""
    template = "mirror/held.html"
    if is_fragment(request):
        template += "#mirror-held"
    context = _held_context() | {"tab": "held", "can_change": can_change_cluster(request.user)}
    return render(request, template, context)


@requires("read_everything", methods=["GET"])
def explore(request: HtmxHttpRequest) -> HttpResponse:
    """Search the Hub (?q=) and open a repository (?repo=owner/name): its files grouped into what
    can be fetched, each with a Fetch button."""
    query = request.GET.get("q", "").strip()[:200]
    repo = request.GET.get("repo", "").strip()[:200]
    base = request.GET.get("adapters_for", "").strip()[:200]
    context: dict[str, Any] = {
        "tab": "explore",
        "q": query,
        "repo": repo,
        "adapters_for": base,
        "can_change": can_change_cluster(request.user),
    }
    try:
        if repo:
            commit, files = hub.repo_files(repo, request.GET.get("revision", "main")[:200] or "main")
            context["commit"] = commit
            context["groups"] = hub.group_files(files)
            context["files"] = files
        elif base:
            context["results"] = hub.adapters_for(base)
        elif query or "q" in request.GET:
            context["results"] = hub.search(query)
    except MirrorError as exc:
        context["error"] = str(exc)
    return render(request, "mirror/explore.html", context)


@requires("change_cluster", methods=["GET", "POST"])
def fetch(request: HtmxHttpRequest) -> HttpResponse:
    """A form of URLs to fetch (one per line); a refusal comes back to this form with the reason
    and the URLs kept."""
    urls = ""
    error = None
    back = request.POST.get("back", "") if request.method == "POST" else ""
    if request.method == "POST":
        urls = request.POST.get("urls", "")
        lines = [line.strip() for line in urls.splitlines() if line.strip()]
        try:
            services.add_sources(lines, actor=request.user, address=client_address(request))
        except MirrorError as exc:
            error = str(exc)
        else:
            messages.success(request, _("Fetching; the Held tab shows its progress."))
            return HttpResponseRedirect(reverse("mirror:held"))
        if back.startswith("/mirror/explore"):
            messages.error(request, error)
            return HttpResponseRedirect(back)
    context = {"tab": "fetch", "urls": urls, "error": error, "can_change": can_change_cluster(request.user)}
    return render(request, "mirror/fetch.html", context, status=400 if error else 200)


@requires("change_cluster", methods=["POST"])
def remove(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    version = get_object_or_404(MirrorVersion, pk=pk)
    try:
        freed = services.remove_version(version, actor=request.user, address=client_address(request))
    except MirrorError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, _("Removed; %(freed)s freed.") % {"freed": services.human(freed)})
    return HttpResponseRedirect(reverse("mirror:held"))


def gpu_classes() -> list[dict[str, Any]]:
    """The fleet's GPU classes with their free and total cards (ready, uncordoned nodes), freest first."""
    from apps.cluster.inventory import build_inventory

    inventory = build_inventory()
    per: dict[str, dict[str, int]] = {}
    for node in inventory.nodes.values():
        usable = node.ready and not node.cordoned
        for cls in sorted({g.gpu_class for g in node.gpus if g.gpu_class}):
            row = per.setdefault(cls, {"free": 0, "total": 0})
            row["free"] += inventory.free_count(node.id, cls) if usable else 0
            row["total"] += sum(1 for g in node.gpus if g.gpu_class == cls)
    return sorted(({"name": cls, **counts} for cls, counts in per.items()), key=lambda r: (-r["free"], r["name"]))


def _profile_name(placement: str) -> str:
    import re

    return "cpu" if placement == "cpu" else re.sub(r"[^a-z0-9-]+", "-", placement.lower()).strip("-") or "gpu"


def _default_name(version: MirrorVersion) -> str:
    import re

    base = version.repo.split("/", 1)[1].lower().removesuffix("-gguf")
    quant = hub.quantisation(version.name) if version.kind == MirrorVersion.Kind.GGUF else None
    name = f"{base}-{quant.lower()}" if quant and quant.lower() not in base else base
    return re.sub(r"[^a-z0-9._-]+", "-", name).strip("-")[:60] or "model"


@requires("change_cluster", methods=["GET", "POST"])
def serve(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """Serve a held version: placement from the fleet's GPU classes (the freest chosen) or the CPU,
    GPUs, parallel requests and context; shows what it will run as and its estimated memory, and
    declares an ordinary model (the same rules as `ctl model apply`)."""
    import math

    from apps.catalog.services import SpecError, apply_models

    version = get_object_or_404(MirrorVersion.objects.prefetch_related("files"), pk=pk)
    if services.version_state(version) != "held":
        messages.error(request, _("%(version)s is not held yet: serve it once every file is.") % {"version": version})
        return HttpResponseRedirect(reverse("mirror:held"))
    classes = gpu_classes()
    data = request.POST if request.method == "POST" else request.GET
    free_gpus = sum(c["free"] for c in classes)
    default_placement = classes[0]["name"] if classes and classes[0]["free"] else "cpu"
    placement = data.get("placement", default_placement)
    errors: list[str] = []
    if placement != "cpu" and placement not in {c["name"] for c in classes}:
        errors.append(_("%(placement)s is not a GPU class of this fleet") % {"placement": placement})

    def number(key: str, default: int, low: int, high: int) -> int:
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

    gpus = number("gpus", 1, 1, 64)
    parallel = number("parallel", 1, 1, 256)
    cores = number("cpu_cores", 4, 1, 1024)
    summary = None
    try:
        summary = services.summary(version)
    except MirrorError as exc:
        errors.append(str(exc))
    trained = summary.context_length if summary is not None else None
    context = number("context", min(4096, trained or 4096), 16, 10**7)
    name = (data.get("name") or _default_name(version)).strip()[:100]
    allow_cpu = data.get("allow_cpu") == "on"
    engine = "llama.cpp" if version.kind == MirrorVersion.Kind.GGUF else "vllm"
    if engine == "vllm" and placement == "cpu":
        errors.append(_("vLLM serves a safetensors set on GPUs: pick a GPU class"))
    if placement == "cpu" and free_gpus and not allow_cpu and request.method == "POST":
        errors.append(
            _(
                "%(free)d GPUs are free: on the CPU this model would leave them idle and run far slower. "
                "Pick a GPU class, or tick “use the CPU anyway”."
            )
            % {"free": free_gpus}
        )
    estimate = None
    if summary is not None and summary.kind == "model":
        estimate = services.summary(version, ctx_size=context * parallel, parallel=parallel).estimate  # type: ignore[union-attr]
    first = next(f for f in version.files.all() if version.kind != MirrorVersion.Kind.GGUF or f.path.endswith(".gguf"))
    source = (
        services.node_path(version, first.path)
        if version.kind == MirrorVersion.Kind.GGUF
        else services.node_dir(version)
    )
    profile: dict[str, Any] = {
        "name": _profile_name(placement),
        "engine": engine,
        "accelerator": placement,
        "parallel": parallel,
        "context_size": context,
    }
    if placement == "cpu":
        profile["cpu_cores"] = cores
        if estimate is not None:
            profile["memory"] = f"{math.ceil(estimate.total / 2**20)}MiB"
    else:
        profile["gpus_per_shard"] = gpus
    spec = {"name": name, "source": source, "replicas": 1, "profiles": [profile]}
    if request.method == "POST" and "preview" not in request.POST and not errors:
        try:
            apply_models([spec], actor=request.user)  # type: ignore[arg-type]
        except SpecError as exc:
            errors += [f"{field}: {' '.join(problems)}" for field, problems in exc.errors.items()]
        else:
            messages.success(
                request, _("Model %(name)s declared; placement puts it on the fleet now.") % {"name": name}
            )
            return HttpResponseRedirect(reverse("catalog:model", kwargs={"name": name}))
    context_data = {
        "tab": "held",
        "can_change": True,
        "version": version,
        "classes": classes,
        "placement": placement,
        "gpus": gpus,
        "parallel": parallel,
        "context": context,
        "cpu_cores": cores,
        "name": name,
        "allow_cpu": allow_cpu,
        "engine": engine,
        "estimate": estimate,
        "summary": summary,
        "profile": profile,
        "source": source,
        "errors": errors,
    }
    status = 400 if errors and request.method == "POST" else 200
    return render(request, "mirror/serve.html", context_data, status=status)


@requires("change_cluster", methods=["POST"])
def adapter_attach(request: HtmxHttpRequest, model: str) -> HttpResponse:
    """Load a held LoRA adapter on a model's llama.cpp profiles (its replicas roll)."""
    from apps.catalog.models import Model
    from apps.mirror import lora

    target = get_object_or_404(Model, name=model)
    version_id = parse_id(request.POST.get("version"), MirrorVersion)
    try:
        version = MirrorVersion.objects.get(pk=version_id or 0)
        scale = float(request.POST.get("scale", "1") or 1)
    except (MirrorVersion.DoesNotExist, ValueError):
        messages.error(request, _("Pick a held adapter and a scale such as 1 or 0.5."))
        return HttpResponseRedirect(reverse("catalog:model", args=[target.name]) + "#adapters")
    try:
        lora.attach(target, version, scale, actor=request.user, address=client_address(request))
    except MirrorError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, _("Adapter attached; the replicas roll onto it."))
    return HttpResponseRedirect(reverse("catalog:model", args=[target.name]) + "#adapters")


@requires("change_cluster", methods=["POST"])
def adapter_detach(request: HtmxHttpRequest, model: str) -> HttpResponse:
    from apps.catalog.models import Model
    from apps.mirror import lora

    target = get_object_or_404(Model, name=model)
    try:
        lora.detach(target, request.POST.get("path", ""), actor=request.user, address=client_address(request))
    except MirrorError as exc:
        messages.error(request, str(exc))
    else:
        messages.success(request, _("Adapter detached; the replicas roll off it."))
    return HttpResponseRedirect(reverse("catalog:model", args=[target.name]) + "#adapters")
