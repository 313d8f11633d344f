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
from llmgw.errors import show_refusal
from llmgw.http import HtmxHttpRequest, client_address, is_fragment
from llmgw.ids import MAX_ID, whole_number

__all__ = ["budget", "facility", "hold", "release", "remove_budget"]


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
        show_refusal(request, exc)
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
        show_refusal(request, exc)
        return _back()
    messages.success(request, _("%(domain)s is released.") % {"domain": row.domain})
    return _back()


def _watts(value: str) -> int | str | None:
    """A form's watts: a whole number, None when left empty; what was typed when it is not a number
    (the budget's check then refuses it with its message)."""
    value = value.strip().replace(" ", "").replace(",", "")
    if not value:
        return None
    number = whole_number(value, 0, MAX_ID)  # ASCII digits ("²" passes isdigit() and fails int())
    return value if number is None else number


@requires("change_cluster", methods=["POST"])
def budget(request: HtmxHttpRequest) -> HttpResponse:
    """Set a domain's power cap: watts, or the feeds that carry it (one feed counts when A/B fed)."""
    from apps.facility.power import BudgetError, set_budget

    level = request.POST.get("level", "").strip()
    name = request.POST.get("name", "").strip()
    entry: dict[str, object] = {"domain": f"{level}={name}", "redundant": bool(request.POST.get("redundant"))}
    watts = _watts(request.POST.get("watts", ""))
    feeds = [
        {"name": feed, "watts": value}
        for feed in ("A", "B")
        if (value := _watts(request.POST.get(f"feed_{feed.lower()}", ""))) is not None
    ]
    if watts is not None:
        entry["watts"] = watts
    if feeds:
        entry["feeds"] = feeds
    user: User = request.user  # type: ignore[assignment]
    try:
        row = set_budget(entry, source="console", actor=user, address=client_address(request))
    except BudgetError as exc:
        show_refusal(request, exc)
        return _back()
    messages.success(
        request,
        _("%(domain)s may draw %(kw)s kW.") % {"domain": row.domain, "kw": f"{(row.cap_watts or 0) / 1000:.1f}"},
    )
    return _back()


@requires("change_cluster", methods=["POST"])
def remove_budget(request: HtmxHttpRequest) -> HttpResponse:
    """Remove a domain's power cap. Audited."""
    from apps.facility.power import BudgetError
    from apps.facility.power import remove_budget as remove

    domain = request.POST.get("domain", "").strip()
    user: User = request.user  # type: ignore[assignment]
    try:
        row = remove(domain, actor=user, address=client_address(request))
    except BudgetError as exc:
        show_refusal(request, exc)
        return _back()
    messages.success(request, _("%(domain)s has no power cap any more.") % {"domain": row.domain})
    return _back()
