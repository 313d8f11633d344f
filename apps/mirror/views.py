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


def _held_context() -> dict[str, Any]:
    versions = list(MirrorVersion.objects.prefetch_related("files"))
    rows = []
    active = False
    for version in versions:
        state = services.version_state(version)
        active = active or state in ("downloading", "queued")
        row: dict[str, Any] = {"version": version, "state": state, "files": list(version.files.all())}
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
    context: dict[str, Any] = {
        "tab": "explore",
        "q": query,
        "repo": repo,
        "can_change": can_change_cluster(request.user),
    }
    try:
        if repo:
            commit, files = hub.repo_files(repo, request.GET.get("revision", "main")[:200] or "main")
            context["commit"] = commit
            context["groups"] = hub.group_files(files)
            context["files"] = files
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
