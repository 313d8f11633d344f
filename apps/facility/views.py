"""The facility page: where the nodes are (sites, rooms, rows, racks drawn as elevations, PDUs), what
runs in each rack, and the holds that keep new replicas out of a domain, made and released here."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.translation import gettext as _

from apps.accounts.access import can_change_cluster, requires
from apps.accounts.models import User
from apps.facility import services
from apps.facility.locations import LEVELS
from apps.facility.selectors import facility_page
from llmgw.http import HtmxHttpRequest, client_address, is_fragment

__all__ = ["facility", "hold", "release"]


def level_names() -> list[tuple[str, str]]:
    """Each level with its name, for the hold form."""
    names = {"site": _("Site"), "room": _("Room"), "row": _("Row"), "rack": _("Rack"), "pdu": _("PDU")}
    return [(level, names[level]) for level in LEVELS]


@requires("read_everything", methods=["GET"])
def facility(request: HtmxHttpRequest) -> HttpResponse:
    """Every rack as a card with its elevation, the PDUs, and the holds (refreshed every 10 s)."""
    template = "facility/facility.html"
    if is_fragment(request):
        template += "#facility-live"
    return render(
        request,
        template,
        {"page": facility_page(), "can_change": can_change_cluster(request.user), "level_names": level_names()},
    )


def _back() -> HttpResponseRedirect:
    return HttpResponseRedirect(reverse("facility:facility"))


@requires("change_cluster", methods=["POST"])
def hold(request: HtmxHttpRequest) -> HttpResponse:
    """Hold a domain: nothing new is placed on its nodes until it is released. Audited."""
    level = request.POST.get("level", "").strip()
    name = request.POST.get("name", "").strip()
    reason = request.POST.get("reason", "").strip()
    if not name:
        messages.error(request, _("Name the domain to hold, e.g. rack r12."))
        return _back()
    if len(name) > 100:
        messages.error(request, _("A domain's name is at most 100 characters."))
        return _back()
    user: User = request.user  # type: ignore[assignment]
    try:
        row = services.hold(
            level,
            name,
            reason=reason,
            drain=bool(request.POST.get("drain")),
            actor=user,
            address=client_address(request),
        )
    except services.HoldError as exc:
        messages.error(request, str(exc))
        return _back()
    messages.success(
        request, _("%(domain)s is held: nothing new is placed there until it is released.") % {"domain": row.domain}
    )
    return _back()


@requires("change_cluster", methods=["POST"])
def release(request: HtmxHttpRequest) -> HttpResponse:
    """End the active hold on a domain. Audited."""
    level = request.POST.get("level", "").strip()
    name = request.POST.get("name", "").strip()
    user: User = request.user  # type: ignore[assignment]
    try:
        row = services.release(level, name, actor=user, address=client_address(request))
    except services.HoldError as exc:
        messages.error(request, str(exc))
        return _back()
    messages.success(request, _("%(domain)s is released.") % {"domain": row.domain})
    return _back()
