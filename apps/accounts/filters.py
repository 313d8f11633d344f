"""Filters for the audit log, shared by the console's Audit page and GET /api/v1/audit."""

from __future__ import annotations

from typing import Any

from django import forms
from django.db.models import Q, QuerySet
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import AuditEvent

__all__ = ["AuditFilterForm", "audit_events"]


def audit_events() -> QuerySet[AuditEvent]:
    """Every event, newest first. Staff only: views ask can_read_everything first."""
    return AuditEvent.objects.order_by("-created_at", "-id")


class AuditFilterForm(forms.Form):
    """?actor=&action=&target_type=&target=&since=&until=; every field may be left empty."""

    actor = forms.CharField(
        label=_("Actor"), required=False, max_length=254, help_text=_("Part of an email address, or “system”.")
    )
    action = forms.CharField(label=_("Action"), required=False, max_length=64)
    target_type = forms.CharField(label=_("Target type"), required=False, max_length=64)
    target = forms.CharField(
        label=_("Target"), required=False, max_length=300, help_text=_("Part of the target's name, or its id.")
    )
    since = forms.DateTimeField(
        label=_("From"), required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )
    until = forms.DateTimeField(
        label=_("Until"), required=False, widget=forms.DateTimeInput(attrs={"type": "datetime-local"})
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The choices are what the log holds, read when the page is drawn.
        events = AuditEvent.objects.order_by()
        actions = list(events.values_list("action", flat=True).distinct().order_by("action"))
        types = list(
            events.exclude(target_type="").values_list("target_type", flat=True).distinct().order_by("target_type")
        )
        self.fields["action"].widget = forms.Select(choices=[("", _("Any action"))] + [(a, a) for a in actions])
        self.fields["target_type"].widget = forms.Select(choices=[("", _("Any target"))] + [(t, t) for t in types])
        for field in self.fields.values():
            field.widget.attrs["class"] = "field"

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        since, until = data.get("since"), data.get("until")
        if since and until and since >= until:
            self.add_error("since", _("The start must be before the end."))
        return data

    def filter(self, events: QuerySet[AuditEvent]) -> QuerySet[AuditEvent]:
        """`events` narrowed by whatever was filled in. Call after is_valid()."""
        data = self.cleaned_data
        if data.get("actor"):
            events = events.filter(actor_label__icontains=data["actor"].strip())
        if data.get("action"):
            events = events.filter(action=data["action"])
        if data.get("target_type"):
            events = events.filter(target_type=data["target_type"])
        if data.get("target"):
            text = data["target"].strip()
            events = events.filter(Q(target_label__icontains=text) | Q(target_id=text))
        if data.get("since"):
            events = events.filter(created_at__gte=data["since"])
        if data.get("until"):
            events = events.filter(created_at__lt=data["until"])
        return events
