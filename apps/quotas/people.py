"""The People page's limits and usage tabs, kept by the quotas app.

The page itself (the tree, a branch's panel and its members) is the accounts app's
(apps.accounts.people_views); what its limits and usage tabs show comes from here, registered in
QuotasConfig.ready() through apps.accounts.extensions: a branch's rate limit and capacity quota with
a form for each (and the two routes those post to), and its usage over a period, in total, by child
branch and by model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.http import HttpResponse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from apps.accounts.access import requires
from apps.accounts.models import Project, Team, User
from apps.accounts.people_selectors import EVERYTHING, Branch, get_branch_for_user
from apps.accounts.people_views import answer, panel_url
from apps.quotas import histograms, services
from apps.quotas.choices import UsageGroup
from apps.quotas.models import CapacityQuota, RateLimit
from apps.quotas.selectors import UsageRow, usage_summary
from llmgw.http import HtmxHttpRequest, client_address
from llmgw.units import parse_memory

__all__ = [
    "PERIODS",
    "CapacityQuotaForm",
    "RateLimitForm",
    "UsageTable",
    "branch_limits",
    "limits_tab",
    "people_capacity_quota",
    "people_rate_limit",
    "usage_tab",
    "usage_tables",
]

DEFAULT_PERIOD = "day"
GIB = 1024**3


# Limits ------------------------------------------------------------------------------------


def branch_limits(branch: Branch) -> tuple[RateLimit | None, CapacityQuota | None]:
    return (RateLimit.objects.filter(**branch.owner).first(), CapacityQuota.objects.filter(**branch.owner).first())


def _limit_field(label: Any) -> forms.IntegerField:
    return forms.IntegerField(
        label=label, required=False, min_value=1, widget=forms.NumberInput(attrs={"class": "field", "placeholder": "-"})
    )


class RateLimitForm(forms.Form):
    """A branch's rate limit; an empty box is no limit."""

    requests_per_minute = _limit_field(gettext_lazy("Requests per minute"))
    tokens_per_minute = _limit_field(gettext_lazy("Tokens per minute"))
    tokens_per_day = _limit_field(gettext_lazy("Tokens per day"))
    monthly_token_budget = _limit_field(gettext_lazy("Monthly token budget"))

    @classmethod
    def for_limit(cls, limit: RateLimit | None) -> RateLimitForm:
        fields = ("requests_per_minute", "tokens_per_minute", "tokens_per_day", "monthly_token_budget")
        return cls(initial={name: getattr(limit, name) for name in fields} if limit else {})


def _memory_text(value: int | None) -> str:
    if value is None:
        return ""
    gib = value / GIB
    return f"{gib:g}GB" if round(gib, 2) == gib else f"{round(gib, 2)}GB"


class CapacityQuotaForm(forms.Form):
    """A branch's capacity quota; an empty box is no limit. Memory as "64GB" (a bare number is GB)."""

    gpus = forms.IntegerField(
        label=gettext_lazy("GPUs"),
        required=False,
        min_value=0,
        widget=forms.NumberInput(attrs={"class": "field", "placeholder": "-"}),
    )
    cpu_cores = forms.FloatField(
        label=gettext_lazy("CPU cores"),
        required=False,
        min_value=0,
        widget=forms.NumberInput(attrs={"class": "field", "placeholder": "-", "step": "any"}),
    )
    memory = forms.CharField(
        label=gettext_lazy("Memory"),
        required=False,
        max_length=32,
        widget=forms.TextInput(attrs={"class": "field", "placeholder": "-"}),
    )
    replicas = forms.IntegerField(
        label=gettext_lazy("Replicas"),
        required=False,
        min_value=0,
        widget=forms.NumberInput(attrs={"class": "field", "placeholder": "-"}),
    )

    @classmethod
    def for_quota(cls, quota: CapacityQuota | None) -> CapacityQuotaForm:
        if quota is None:
            return cls()
        return cls(
            initial={
                "gpus": quota.gpus,
                "cpu_cores": quota.cpu_cores,
                "memory": _memory_text(quota.memory_bytes),
                "replicas": quota.replicas,
            }
        )

    def clean_memory(self) -> int | None:
        text = self.cleaned_data.get("memory", "").strip()
        if not text:
            return None
        try:
            return parse_memory(text)
        except ValueError:
            raise ValidationError(
                _("Write memory as 64GB, 512MB or a number of GB; got “%(text)s”.") % {"text": text}, code="memory"
            ) from None

    def values(self) -> dict[str, Any]:
        data = self.cleaned_data
        return {
            "gpus": data["gpus"],
            "cpu_cores": data["cpu_cores"],
            "memory_bytes": data["memory"],
            "replicas": data["replicas"],
        }


def limits_tab(request: HtmxHttpRequest, branch: Branch, context: dict[str, Any]) -> None:
    """The branch's rate limit and capacity quota, with their forms for those who may change them
    (a form refused before is kept, with its errors)."""
    limit, quota = branch_limits(branch)
    context.update(limit=limit, quota=quota)
    if context["can_change_limits"]:
        context.setdefault("rate_form", RateLimitForm.for_limit(limit))
        context.setdefault("quota_form", CapacityQuotaForm.for_quota(quota))


def _limits_form(request: HtmxHttpRequest, form: RateLimitForm | CapacityQuotaForm, name: str) -> HttpResponse:
    user: User = request.user  # type: ignore[assignment]
    branch = get_branch_for_user(EVERYTHING, request.POST.get("branch"))
    if form.is_valid():
        try:
            if isinstance(form, RateLimitForm):
                services.set_rate_limit(
                    branch.owner, dict(form.cleaned_data), actor=user, address=client_address(request)
                )
            else:
                services.set_capacity_quota(branch.owner, form.values(), actor=user, address=client_address(request))
        except ValidationError as refusal:
            form.add_error(None, refusal.messages)
        else:
            return answer(
                request, "people", "limits", branch, done=_("Limits of %(branch)s saved.") % {"branch": branch.path}
            )
    return answer(request, "people", "limits", branch, invalid=True, forms={name: form})


@requires("change_limits", methods=["POST"])
def people_rate_limit(request: HtmxHttpRequest) -> HttpResponse:
    """Set a branch's requests and tokens per minute, tokens per day and monthly budget."""
    return _limits_form(request, RateLimitForm(request.POST), "rate_form")


@requires("change_limits", methods=["POST"])
def people_capacity_quota(request: HtmxHttpRequest) -> HttpResponse:
    """Set the GPUs, cores, memory and replicas a branch's models may hold."""
    return _limits_form(request, CapacityQuotaForm(request.POST), "quota_form")


# Usage -------------------------------------------------------------------------------------

PERIODS: dict[str, tuple[timedelta, Any]] = {
    "hour": (timedelta(hours=1), gettext_lazy("Last hour")),
    "day": (timedelta(days=1), gettext_lazy("Last day")),
    "week": (timedelta(days=7), gettext_lazy("Last week")),
    "month": (timedelta(days=30), gettext_lazy("Last month")),
}


@dataclass
class UsageTable:
    """Usage of a branch grouped one way: by its teams, its projects or its models."""

    title: str
    column: str
    rows: list[UsageRow] = field(default_factory=list)


def _total(label: str, rows: list[UsageRow]) -> UsageRow:
    total = UsageRow(group="", label=label)
    for row in rows:
        total.requests += row.requests
        total.errors += row.errors
        total.client_errors = (
            None
            if total.client_errors is None or row.client_errors is None
            else total.client_errors + row.client_errors
        )  # unknown in one part: unknown in the sum
        total.refusals += row.refusals
        total.requests_without_tokens += row.requests_without_tokens
        if row.prompt_tokens is not None:
            total.prompt_tokens = (total.prompt_tokens or 0) + row.prompt_tokens
        if row.completion_tokens is not None:
            total.completion_tokens = (total.completion_tokens or 0) + row.completion_tokens
        total.first_token_hist = histograms.merge(total.first_token_hist, row.first_token_hist)
        total.latency_hist = histograms.merge(total.latency_hist, row.latency_hist)
        total.queue_hist = histograms.merge(total.queue_hist, row.queue_hist)
    total.percentiles()
    return total


def usage_tables(user: User, branch: Branch, period: str) -> tuple[UsageRow, list[UsageTable]]:
    """The branch's total over the period, and its usage by child branch (an organisation's
    teams, a team's projects; every child listed, used or not) and by model."""
    until = timezone.now()
    since = until - PERIODS[period][0]
    within = branch.usage_within
    by_model = usage_summary(user, group_by=UsageGroup.MODEL, since=since, until=until, within=within)
    tables: list[UsageTable] = []
    children: list[Team] | list[Project] = []
    if branch.kind == "org":
        group, title, column = UsageGroup.TEAM, _("By team"), _("Team")
        children = list(Team.objects.filter(organization_id=branch.obj.pk).order_by("name"))
    elif branch.kind == "team":
        group, title, column = UsageGroup.PROJECT, _("By project"), _("Project")
        children = list(Project.objects.filter(team_id=branch.obj.pk).order_by("name"))
    if branch.kind in ("org", "team"):
        found = {row.group: row for row in usage_summary(user, group_by=group, since=since, until=until, within=within)}
        rows = []
        for child in children:
            row = found.pop(child.pk, None) or UsageRow(group=child.pk, label="")
            row.label = child.name
            rows.append(row)
        rows.sort(key=lambda row: (-row.requests, row.label))
        tables.append(UsageTable(title, column, rows + list(found.values())))
    tables.append(UsageTable(_("By model"), _("Model"), by_model))
    return _total(_("Total"), by_model), tables


def usage_tab(request: HtmxHttpRequest, branch: Branch, context: dict[str, Any]) -> None:
    """The branch's usage over the period the request names (a day when it names none it knows)."""
    user: User = request.user  # type: ignore[assignment]
    period = request.GET.get("period") or request.POST.get("period") or DEFAULT_PERIOD
    if period not in PERIODS:
        period = DEFAULT_PERIOD
    total, tables = usage_tables(user, branch, period)
    context.update(
        period=period,
        total=total,
        tables=tables,
        periods=[
            {
                "label": label,
                "url": panel_url(context["area"], "usage", branch, period=name),
                "current": name == period,
            }
            for name, (_length, label) in PERIODS.items()
        ],
    )
