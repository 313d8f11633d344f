"""The fabric pages: every physical fabric with its subnet managers and problems, and a page per
fabric that draws its map (templates/fabrics/, console/fabric.js)."""

from __future__ import annotations

from typing import Any

from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.utils.translation import gettext as _

from apps.accounts.access import requires
from apps.fabrics.services import fabrics_overview, topology_view
from llmgw.http import HtmxHttpRequest, is_fragment


@requires("read_everything", methods=["GET"])
def fabrics(request: HtmxHttpRequest) -> HttpResponse:
    return render(request, "fabrics/fabrics.html", {"overview": fabrics_overview()})


@requires("read_everything", methods=["GET"])
def nvlink(request: HtmxHttpRequest) -> HttpResponse:
    """Each multi-node NVLink domain drawn as a rack of trays, with what keeps a tray out."""
    from apps.fabrics.nvlink import domains_overview

    template = "fabrics/nvlink.html"
    if is_fragment(request):
        template += "#nvlink-live"
    return render(request, template, {"overview": domains_overview()})


@requires("read_everything", methods=["GET"])
def fabric(request: HtmxHttpRequest, fabric: str) -> HttpResponse:
    overview = fabrics_overview()
    found = next((f for f in overview["fabrics"] if f["id"] == fabric), None)
    view = topology_view(fabric)
    if found is None and (view is None or view.get("map") is None):
        raise Http404
    problems = [p for p in overview["problems"] if fabric in p["message"]]
    return render(
        request,
        "fabrics/fabric.html",
        {
            "fabric": found or {"id": fabric},
            "view": view,
            "problems": problems,
            "fabric_id": fabric,
            "labels": labels(),
            "rails": rail_summary((view or {}).get("map")),
        },
    )


def rail_summary(data: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the page says of the map's rails: the plan inferred (None for a map kept before plans
    were inferred), the rails that share a leaf under it (``"0+2, 1+3"``), the other plans, and
    the hosts that are not rail members."""
    rails = (data or {}).get("rails") or {}
    if "plan" not in rails:
        return None
    plan = rails.get("plan")
    planes = plan.get("planes", []) if isinstance(plan, dict) else []
    return {
        "plan": plan,
        "shared": ", ".join("+".join(str(r) for r in plane) for plane in planes if len(plane) > 1),
        "others": list(rails.get("plans") or [])[1:],
        "members": rails.get("members", 0),
        "not_members": rails.get("not_members") or {},
    }


def labels() -> dict[str, str]:
    """What the drawing says, translated here (console/fabric.js holds no text of its own)."""
    return {
        "core": _("core"),
        "unknown": _("tier unknown"),
        "spine": _("spine"),
        "leaf": _("leaf"),
        "switch": _("switch"),
        "adapter": _("adapter"),
        "degraded": _("below what its ends can run"),
        "expected": _("expected"),
        "down": _("down"),
        "ports": _("ports"),
        "rail": _("rail"),
        "host": _("host"),
        "node": _("node"),
        "rate": _("rate"),
        "traffic": _("traffic"),
        "cables": _("cables"),
        "lid": _("LID"),
        "gbps": _("Gb/s"),
        "not_found": _("no node of that name on this fabric"),
        "failed": _("The map could not be read."),
    }
