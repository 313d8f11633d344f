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
from apps.mirror import serve as serving
from apps.mirror.hub import MirrorError
from apps.mirror.models import MirrorVersion
from llmgw.errors import show_refusal
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
        show_refusal(request, exc)
    else:
        messages.success(request, _("Removed; %(freed)s freed.") % {"freed": services.human(freed)})
    return HttpResponseRedirect(reverse("mirror:held"))


@requires("change_cluster", methods=["GET", "POST"])
def serve(request: HtmxHttpRequest, pk: int) -> HttpResponse:
    """Serve a held version: placement from the fleet's GPU classes (the freest chosen) or the CPU,
    GPUs, CPU cores (as many as the freest node has free, up to 4), parallel requests and context;
    shows what it will run as, its estimated memory and where placement would put it, refuses what
    placement would refuse (with its reasons), and declares an ordinary model (the same rules as
    `ctl model apply`)."""
    from apps.catalog.services import SpecError, apply_models
    from apps.cluster.inventory import build_inventory

    version = get_object_or_404(MirrorVersion.objects.prefetch_related("files"), pk=pk)
    if services.version_state(version) != "held":
        messages.error(request, _("%(version)s is not held yet: serve it once every file is.") % {"version": version})
        return HttpResponseRedirect(reverse("mirror:held"))
    inventory = build_inventory()
    room = serving.fleet_room(inventory)
    posting = request.method == "POST" and "preview" not in request.POST
    form = serving.read_form(request.POST if request.method == "POST" else request.GET, version, room, posting=posting)
    verdict = serving.dry_run(inventory, form.name, form.source, form.profile) if not form.errors else None
    if posting and verdict is not None and not verdict.fits:
        form.errors.append(_("No node can run it as it stands:"))
        form.errors += verdict.refusals
    if posting and not form.errors:
        try:
            apply_models([form.spec], actor=request.user)  # type: ignore[arg-type]
        except SpecError as exc:
            form.errors += [f"{field}: {' '.join(problems)}" for field, problems in exc.errors.items()]
        else:
            messages.success(
                request, _("Model %(name)s declared; placement puts it on the fleet now.") % {"name": form.name}
            )
            return HttpResponseRedirect(reverse("catalog:model", kwargs={"name": form.name}))
    context = {"tab": "held", "can_change": True, "version": version, "form": form, "room": room, "verdict": verdict}
    return render(request, "mirror/serve.html", context, status=400 if form.errors and posting else 200)


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
        show_refusal(request, exc)
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
        show_refusal(request, exc)
    else:
        messages.success(request, _("Adapter detached; the replicas roll off it."))
    return HttpResponseRedirect(reverse("catalog:model", args=[target.name]) + "#adapters")
