"""The console's Audit page: who changed what, when and from where. Read only."""

from __future__ import annotations

from dataclasses import dataclass

from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from apps.accounts.access import requires
from apps.accounts.audit import change_lines
from apps.accounts.filters import AuditFilterForm, audit_events
from apps.accounts.models import AuditEvent

__all__ = ["PER_PAGE", "audit"]

PER_PAGE = 50


@dataclass(frozen=True)
class EventRow:
    """One line of the Audit page."""

    event: AuditEvent
    changes: list[str]

    @property
    def changes_text(self) -> str:
        return "; ".join(self.changes)


@requires("read_everything", methods=["GET"])
def audit(request: HttpRequest) -> HttpResponse:
    """The audit log, newest first, 50 to a page, narrowed by actor, action, target and time."""
    form = AuditFilterForm(request.GET)
    events = form.filter(audit_events()) if form.is_valid() else audit_events().none()
    page = Paginator(events, PER_PAGE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(
        request,
        "accounts/audit.html",
        {
            "form": form,
            "page": page,
            "rows": [EventRow(event=event, changes=change_lines(event.changes)) for event in page.object_list],
            "query": query.urlencode(),
        },
    )
