"""Console pages for nodes: the list, one node, adding one, and cordoning.

What other apps show on a node's page (its fabrics' ports, its NVLink domain) and on the cluster
page (the fabrics) comes from the parts they registered in apps.cluster.extensions, as do the
levels of a node's location (the facility app's): a part no app registered is left out.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any
from urllib.parse import urlencode

from django import forms
from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import Http404, HttpResponse, HttpResponseRedirect
from django.http.response import HttpResponseBase
from django.shortcuts import get_object_or_404, render
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.cache import never_cache

from apps.accounts.access import can_change_cluster, public, requires
from apps.accounts.models import User
from apps.cluster import actions, enrolment, overview, selectors
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.models import Node
from apps.cluster.onboarding import AGENT_CONFIG_PATH, agent_yaml, install_command
from llmgw.errors import show_refusal
from llmgw.http import HtmxHttpRequest, client_address, is_fragment
from llmgw.ids import whole_number

__all__ = [
    "cluster",
    "engine_remove",
    "engine_set",
    "install_bundle",
    "install_script",
    "node_add",
    "node_cordon",
    "node_detail",
    "node_doctor",
    "node_doctor_run",
    "node_drain",
    "node_uncordon",
    "nodes",
]


@requires("read_everything", methods=["GET"])
def nodes(request: HtmxHttpRequest) -> HttpResponse:
    """The nodes by name, a page of them at a time (?page=, ?find= a part of the name); htmx
    refreshes the page shown in place."""
    template = "cluster/nodes.html"
    if is_fragment(request):
        template += "#node-table"
    find = request.GET.get("find", "").strip()[:200]
    page, rows = selectors.node_rows_page(request.GET.get("page"), find)
    query = {"find": find} if find else {}
    return render(
        request,
        template,
        {
            "rows": rows,
            "page": page,
            "find": find,
            "query": urlencode(query),
            "here": urlencode({**query, "page": page.number}),
            "can_change": can_change_cluster(request.user),
        },
    )


def location_form(node: Node) -> list[dict[str, Any]]:
    """Each level of the node's location: what placement sees, what is kept, what the agent says
    ([] when no app names the levels)."""
    agent = (node.hardware or {}).get("labels") or {}
    kept = node.labels or {}
    names = {
        "site": _("Site"),
        "room": _("Room"),
        "row": _("Row"),
        "rack": _("Rack"),
        "pdu": _("PDU"),
    }
    return [
        {
            "level": level,
            "label": names.get(level, level),
            "value": kept.get(label) or agent.get(label) or "",
            "agent": agent.get(label),
            "kept": label in kept,
        }
        for level, label in EXTENSIONS.location_labels()
    ]


@requires("read_everything", methods=["GET"])
def node_detail(request: HtmxHttpRequest, name: str) -> HttpResponse:
    node = selectors.get_node_for_user(request.user, name)
    context: dict[str, Any] = {
        "detail": selectors.node_detail(node),
        "doctor": selectors.node_doctor(node),
        "node": node,
        "can_change": can_change_cluster(request.user),
        "drain": actions.drain_status(node),
        "location": location_form(node),
        **EXTENSIONS.node_page(node),  # the fabrics' "ports" and "nvlink"
    }
    if is_fragment(request):
        return render(request, "cluster/node_detail.html#node-live", context)
    context["charts"] = selectors.node_charts(node)
    context["engine_rows"] = selectors.node_engine_rows(node)
    return render(request, "cluster/node_detail.html", context)


@requires("read_everything", methods=["GET"])
def node_doctor(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """The checks `llmgw doctor` last ran on the node; polled every 2 s while an answer is awaited."""
    node = selectors.get_node_for_user(request.user, name)
    return _doctor(request, node, None)


@requires("change_cluster", methods=["POST"])
def node_doctor_run(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Ask the node's agent to run `llmgw doctor` now."""
    node = selectors.get_node_for_user(request.user, name, perm="change")
    user: User = request.user  # type: ignore[assignment]
    sent = actions.request_doctor(node, actor=user, address=client_address(request))
    node.refresh_from_db()
    return _doctor(request, node, sent)


def _doctor(request: HtmxHttpRequest, node: Node, sent: bool | None) -> HttpResponse:
    if not is_fragment(request):
        if request.method == "GET":
            return node_detail(request, node.name)
        return HttpResponseRedirect(reverse("cluster:node", args=[node.name]) + "#doctor")
    context = {
        "node": node,
        "can_change": can_change_cluster(request.user),
        "doctor": selectors.node_doctor(node),
        "sent": sent,
    }
    return render(request, "cluster/node_detail.html#node-doctor", context)


def _after_cordon(request: HtmxHttpRequest, node: Node, error: str | None = None) -> HttpResponse:
    if is_fragment(request):
        return render(
            request,
            "cluster/node_detail.html#node-cordon",
            {"node": node, "can_change": True, "cordon_error": error, "drain": actions.drain_status(node)},
        )
    if error:
        messages.error(request, error)
    return HttpResponseRedirect(reverse("cluster:node", args=[node.name]))


@requires("change_cluster", methods=["POST"])
def node_cordon(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Keep new work off a node; what runs there stays. The reason is required and audited."""
    node = selectors.get_node_for_user(request.user, name, perm="change")
    reason = request.POST.get("reason", "").strip()
    if not reason:
        return _after_cordon(request, node, _("Say why the node is cordoned, so others know when to lift it."))
    user: User = request.user  # type: ignore[assignment]
    node = actions.cordon_node(node, reason=reason, actor=user, address=client_address(request))
    if not is_fragment(request):
        messages.success(request, _("Node “%(name)s” cordoned.") % {"name": node.name})
    return _after_cordon(request, node)


@requires("change_cluster", methods=["POST"])
def node_location(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Keep where the node is (site, room, row, rack, PDU) over what its agent says; an emptied field
    drops the kept value, and the agent's own, if it says one, shows again. Audited. Not found when
    no app names the levels."""
    node = selectors.get_node_for_user(request.user, name, perm="change")
    levels = EXTENSIONS.location_labels()
    if not levels:
        raise Http404("no app names the levels of a location")
    set_labels: dict[str, str] = {}
    remove: list[str] = []
    for level, label in levels:
        value = request.POST.get(level, "").strip()[:100]
        if value:
            set_labels[label] = value
        elif label in (node.labels or {}):
            remove.append(label)
    user: User = request.user  # type: ignore[assignment]
    actions.set_labels(node, set_labels=set_labels, remove=remove, actor=user, address=client_address(request))
    messages.success(request, _("Location of “%(name)s” saved.") % {"name": node.name})
    return HttpResponseRedirect(reverse("cluster:node", args=[node.name]) + "#location")


@requires("change_cluster", methods=["POST"])
def node_uncordon(request: HtmxHttpRequest, name: str) -> HttpResponse:
    node = selectors.get_node_for_user(request.user, name, perm="change")
    user: User = request.user  # type: ignore[assignment]
    node = actions.uncordon_node(node, actor=user, address=client_address(request))
    if not is_fragment(request):
        messages.success(request, _("Node “%(name)s” uncordoned.") % {"name": node.name})
    return _after_cordon(request, node)


@requires("change_cluster", methods=["POST"])
def node_drain(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Cordon the node and move its replicas elsewhere, each replaced before it is stopped."""
    node = selectors.get_node_for_user(request.user, name, perm="change")
    raw = request.POST.get("grace", "").strip()
    grace: int | None = None
    if raw:
        grace = whole_number(raw, 0, 3600)
        if grace is None:
            return _after_cordon(request, node, _("The drain grace is a whole number of seconds from 0 to 3600."))
    user: User = request.user  # type: ignore[assignment]
    node = actions.drain_node(
        node, grace=grace, force=request.POST.get("force") == "on", actor=user, address=client_address(request)
    )
    if not is_fragment(request):
        messages.success(request, _("Node “%(name)s” is being drained.") % {"name": node.name})
    return _after_cordon(request, node)


def _default_hours() -> int:
    return max(1, round(settings.AGENT_ENROLLMENT_TTL / 3600))


class NodeAddForm(forms.Form):
    name = forms.CharField(label=gettext_lazy("Name"), max_length=63)
    labels = forms.CharField(
        label=gettext_lazy("Labels"),
        required=False,
        widget=forms.Textarea(attrs={"rows": 3}),
        help_text=gettext_lazy("One key=value per line, for example rack=r12."),
    )
    expires_hours = forms.IntegerField(
        label=gettext_lazy("Token expires after (hours)"), min_value=1, max_value=7 * 24, initial=_default_hours
    )

    def clean_labels(self) -> dict[str, str]:
        labels: dict[str, str] = {}
        for number, line in enumerate(self.cleaned_data.get("labels", "").splitlines(), start=1):
            line = line.strip()
            if not line:
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise ValidationError(
                    gettext_lazy("Line %(line)s: write each label as key=value; got “%(text)s”."),
                    code="label",
                    params={"line": number, "text": line},
                )
            labels[key.strip()] = value.strip()
        return labels


@never_cache  # the page that shows a token must not linger in a cache
@requires("change_cluster", methods=["GET", "POST"])
def node_add(request: HtmxHttpRequest) -> HttpResponse:
    """Make a one-time enrollment token and show, once, the agent.yaml and command that use it."""
    enrollment = None
    if request.method == "POST":
        form = NodeAddForm(request.POST)
        if form.is_valid():
            user: User = request.user  # type: ignore[assignment]
            labels = form.cleaned_data["labels"]
            try:
                new = enrolment.create_enrollment(
                    form.cleaned_data["name"],
                    labels=labels,
                    expires_in=timedelta(hours=form.cleaned_data["expires_hours"]),
                    actor=user,
                )
            except ValueError as exc:
                form.add_error("name", str(exc))
            else:
                server = _server(request)
                enrollment = {
                    "install_command": install_command(server, new.secret),
                    "name": new.token.node_name,
                    "expires_at": new.token.expires_at,
                    "secret": new.secret,
                    "agent_yaml": agent_yaml(server, new.secret, labels),
                    "config_path": AGENT_CONFIG_PATH,
                    "command": f"llmgw agent --config {AGENT_CONFIG_PATH}",
                }
                form = NodeAddForm()
    else:
        form = NodeAddForm()
    return render(request, "cluster/node_add.html", {"form": form, "enrollment": enrollment})


@requires("read_everything", methods=["GET"])
def cluster(request: HtmxHttpRequest) -> HttpResponse:
    """The fleet at a glance: nodes and a map of their GPUs (?colour=util|mem|temp), a page of
    nodes at a time (?page=), held idle cards and utilisation by GPU class. htmx refreshes the live
    part in place."""
    colour = request.GET.get("colour", "util")
    template = "cluster/cluster.html"
    if is_fragment(request):
        template += "#cluster-live"
    page = request.GET.get("page")
    context: dict[str, Any] = {"overview": overview.cluster_overview(colour, page=page), "colours": _colours()}
    if not is_fragment(request):
        context.update(EXTENSIONS.cluster_page())  # the fabrics' "fabrics"
        shown = context["overview"].page
        paged = shown is not None and shown.has_other_pages()
        context["engines"] = selectors.engine_overview([n.pk for n in shown.object_list] if paged else None)
        context["builds_paged"] = paged
        context["can_change"] = can_change_cluster(request.user)
        context["what_if_kinds"] = [
            ("node", _("Node lost")),
            ("rack", _("Rack lost")),
            ("pdu", _("PDU lost")),
            ("model", _("Model")),
        ]
    return render(request, template, context)


@requires("change_cluster", methods=["POST"])
def engine_set(request: HtmxHttpRequest) -> HttpResponse:
    """Set which version of an engine the nodes a rule picks should have; they hear at once."""
    from apps.cluster import engines

    user: User = request.user  # type: ignore[assignment]
    try:
        engines.set_choice(
            request.POST.get("engine", ""),
            request.POST.get("version", "").strip(),
            request.POST.get("scope", "all"),
            request.POST.get("match", "").strip(),
            actor=user,
            address=client_address(request),
        )
    except engines.EngineConfigError as exc:
        show_refusal(request, exc)
    else:
        messages.success(request, _("Engine choice saved; the nodes it picks install it now."))
    return HttpResponseRedirect(reverse("cluster") + "#engines")


@requires("change_cluster", methods=["POST"])
def engine_build(request: HtmxHttpRequest, name: str) -> HttpResponse:
    """Choose a node's vLLM/SGLang build (auto, cu13, cu129, none); the node hears at once."""
    from apps.cluster import engines

    user: User = request.user  # type: ignore[assignment]
    node = get_object_or_404(Node, name=name, revoked_at__isnull=True)
    try:
        actions.set_engine_build(node, request.POST.get("build", ""), actor=user, address=client_address(request))
    except engines.EngineConfigError as exc:
        show_refusal(request, exc)
    else:
        messages.success(request, _("Build saved; %(node)s installs it now.") % {"node": node.name})
    return HttpResponseRedirect(reverse("cluster") + "#engine-builds")


@requires("change_cluster", methods=["POST"])
def engine_remove(request: HtmxHttpRequest) -> HttpResponse:
    from apps.cluster import engines

    user: User = request.user  # type: ignore[assignment]
    removed = engines.remove_choice(
        request.POST.get("engine", ""),
        request.POST.get("scope", "all"),
        request.POST.get("match", ""),
        actor=user,
        address=client_address(request),
    )
    if removed:
        messages.success(request, _("Engine choice removed; the nodes it picked take the next one that matches."))
    else:
        messages.error(request, _("No such engine choice."))
    return HttpResponseRedirect(reverse("cluster") + "#engines")


def _colours() -> list[tuple[str, str]]:
    return [("util", _("Utilisation")), ("mem", _("Memory")), ("temp", _("Temperature"))]


# Onboarding: what a new node fetches, before it has a credential ------------------------------


def _server(request: HtmxHttpRequest) -> str:
    return (settings.PUBLIC_URL or request.build_absolute_uri("/")).rstrip("/")


@public
def install_script(request: HtmxHttpRequest) -> HttpResponse:
    """The shell script `curl … | sudo LLMGW_TOKEN=… sh` runs on a new node (it holds no secret)."""
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405)
    from apps.cluster.onboarding import install_script as script

    return HttpResponse(script(_server(request)), content_type="text/x-shellscript; charset=utf-8")


@public
def install_bundle(request: HtmxHttpRequest, name: str) -> HttpResponseBase:
    """The agent's one-file bundle and its sha256, built from this installation's code."""
    from django.http import FileResponse, Http404

    from apps.cluster.onboarding import agent_bundle

    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405)
    bundle, digest = agent_bundle()
    if name == "llmgw-agent.pyz":
        return FileResponse(open(bundle, "rb"), as_attachment=True, filename=name)  # noqa: SIM115 - closed by the response
    if name == "llmgw-agent.pyz.sha256":
        return HttpResponse(f"{digest}  llmgw-agent.pyz\n", content_type="text/plain; charset=utf-8")
    raise Http404(name)
