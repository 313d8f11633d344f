"""The console's usage page: requests, tokens, server and client errors, refusals, time percentiles and
the wait for a slot of a busy model, per group.

What a person sees is decided by selectors.usage_summary: their own use, the branches they
manage, or everything for staff who read everything (billing and administrators among them).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.http import HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, pgettext

from apps.accounts.access import requires
from apps.quotas import selectors
from apps.quotas.choices import UsageGroup
from llmgw.console.charts import bar_chart
from llmgw.http import HtmxHttpRequest

__all__ = ["PERIODS", "usage"]

# The ranges the page offers, ending now.
PERIODS: dict[str, tuple[Any, timedelta]] = {
    "hour": (gettext_lazy("Last hour"), timedelta(hours=1)),
    "day": (gettext_lazy("Last day"), timedelta(days=1)),
    "week": (gettext_lazy("Last week"), timedelta(days=7)),
    "month": (gettext_lazy("Last month"), timedelta(days=30)),
}
DEFAULT_PERIOD = "day"
DEFAULT_GROUP = UsageGroup.MODEL
CHART_GROUPS = 12  # the busiest groups drawn; the table lists them all


@dataclass(frozen=True)
class Chart:
    title: str
    svg: SafeString


def _charts(rows: list[selectors.UsageRow]) -> list[Chart]:
    top = rows[:CHART_GROUPS]

    def tokens(row: selectors.UsageRow) -> float | None:
        if row.prompt_tokens is None and row.completion_tokens is None:
            return None
        return float((row.prompt_tokens or 0) + (row.completion_tokens or 0))

    def seconds(value: float | None) -> float | None:
        return value / 1000 if value is not None else None

    in_seconds = " " + pgettext("seconds, after a number", "s")
    specs: list[tuple[str, list[tuple[str, float | None]], str, int]] = [
        (_("Requests"), [(r.label, float(r.requests)) for r in top], "", 0),
        (_("Tokens"), [(r.label, tokens(r)) for r in top], "", 0),
        (_("Server errors and refusals"), [(r.label, float(r.errors + r.refusals)) for r in top], "", 0),
        (_("First token, p95"), [(r.label, seconds(r.first_token_ms_p95)) for r in top], in_seconds, 2),
        (_("Latency, p95"), [(r.label, seconds(r.latency_ms_p95)) for r in top], in_seconds, 2),
        (_("Queue wait, p99"), [(r.label, seconds(r.queue_ms_p99)) for r in top], in_seconds, 2),
    ]
    return [
        Chart(title, bar_chart(items, label=title, unit=unit, digits=digits)) for title, items, unit, digits in specs
    ]


@requires("signed_in", methods=["GET"])
def usage(request: HtmxHttpRequest) -> HttpResponse:
    """?period=hour|day|week|month and ?group=organization|team|project|key|model|user."""
    period = request.GET.get("period", DEFAULT_PERIOD)
    if period not in PERIODS:
        period = DEFAULT_PERIOD
    group = request.GET.get("group", DEFAULT_GROUP)
    if group not in UsageGroup.values:
        group = DEFAULT_GROUP
    until = timezone.now()
    since = until - PERIODS[period][1]
    rows = selectors.usage_summary(request.user, group_by=group, since=since, until=until)  # type: ignore[arg-type]
    context = {
        "rows": rows,
        "charts": _charts(rows),
        "period": period,
        "group": group,
        "periods": [(key, label) for key, (label, _length) in PERIODS.items()],
        "groups": list(UsageGroup.choices),
        "group_label": UsageGroup(group).label,
        "since": since,
        "until": until,
        "guardrails": selectors.guardrail_counts(request.user, since=since, until=until),  # type: ignore[arg-type]
    }
    template = "quotas/usage.html"
    if request.htmx and not request.htmx.boosted:
        template += "#usage-body"
    return render(request, template, context)
