"""Reading usage: sums and percentiles per group, and single requests, as each person may see them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q
from django.utils.translation import gettext as _

from apps.accounts.access import can_read_everything
from apps.accounts.choices import MembershipRole
from apps.accounts.models import ApiKey, Membership, Organization, Project, Team, User
from apps.quotas import histograms
from apps.quotas.choices import RollupPeriod, UsageGroup
from apps.quotas.models import UsageRecord, UsageRollup

__all__ = [
    "MINUTE_ROLLUPS_UP_TO",
    "UNKNOWN_MODEL",
    "UsageRow",
    "get_request_for_user",
    "guardrail_counts",
    "period_for",
    "usage_summary",
    "visible_rollups",
]

# The model of requests for a model that does not exist (the gateway answered 404), so that
# names made up by callers do not each become a group of their own.
UNKNOWN_MODEL = "-"
# Ranges up to this long are read from minute rollups, longer ones from hour rollups.
MINUTE_ROLLUPS_UP_TO = timedelta(hours=6)
PERIOD_LENGTH = {RollupPeriod.MINUTE: timedelta(minutes=1), RollupPeriod.HOUR: timedelta(hours=1)}
GROUP_COLUMNS = {
    UsageGroup.ORGANIZATION: "organization_id",
    UsageGroup.TEAM: "team_id",
    UsageGroup.PROJECT: "project_id",
    UsageGroup.KEY: "api_key_id",
    UsageGroup.MODEL: "model",
    UsageGroup.USER: "user_id",
}


@dataclass
class UsageRow:
    """One group's usage over a range. Token sums are None when no request in the group had counts;
    percentiles (milliseconds, nearest-rank, within 1 % of the exact value) are None when nothing
    was timed. `errors` are server errors (also `server_errors`); `client_errors` is None when part
    of the range was written before client errors were counted."""

    group: int | str
    label: str
    requests: int = 0
    errors: int = 0
    client_errors: int | None = 0
    refusals: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    requests_without_tokens: int = 0
    first_token_ms_p50: float | None = None
    first_token_ms_p95: float | None = None
    first_token_ms_p99: float | None = None
    latency_ms_p50: float | None = None
    latency_ms_p95: float | None = None
    latency_ms_p99: float | None = None
    # The wait for a slot in the gateway's queue (0 for a request that took a free one), over the
    # requests whose wait is known; None when none is.
    queue_ms_p50: float | None = None
    queue_ms_p99: float | None = None
    # GPU-hours held by the group's replicas, by GPU class, and core-hours of those that hold no
    # GPU (apps.cluster.held); None where held time is not counted (per key, per person) or not shown.
    gpu_hours: dict[str, float] | None = None
    core_hours: float | None = None
    # The energy that held time drew (None unless every held second was measured), and the tokens
    # served (prompt and completion) per GPU-hour and per watt-hour.
    watt_hours: float | None = None
    tokens_per_gpu_hour: float | None = None
    tokens_per_watt_hour: float | None = None
    energy_joules: float = field(default=0.0, repr=False)
    measured_seconds: float = field(default=0.0, repr=False)
    first_token_hist: histograms.Sketch = field(default_factory=histograms.empty, repr=False)
    latency_hist: histograms.Sketch = field(default_factory=histograms.empty, repr=False)
    queue_hist: histograms.Sketch = field(default_factory=histograms.empty, repr=False)

    def percentiles(self) -> None:
        """Work out every percentile from the row's sketches."""
        for q, suffix in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            setattr(self, f"first_token_ms_{suffix}", histograms.percentile(self.first_token_hist, q))
            setattr(self, f"latency_ms_{suffix}", histograms.percentile(self.latency_hist, q))
        self.queue_ms_p50 = histograms.percentile(self.queue_hist, 0.5)
        self.queue_ms_p99 = histograms.percentile(self.queue_hist, 0.99)

    @property
    def server_errors(self) -> int:
        """Status 500 and above, or an answer that broke after it began: `errors` by its full name."""
        return self.errors

    def as_dict(self) -> dict[str, Any]:
        return {
            name: getattr(self, name)
            for name in (
                "group",
                "label",
                "requests",
                "errors",
                "server_errors",
                "client_errors",
                "refusals",
                "prompt_tokens",
                "completion_tokens",
                "requests_without_tokens",
                "gpu_hours",
                "core_hours",
                "watt_hours",
                "tokens_per_gpu_hour",
                "tokens_per_watt_hour",
                "first_token_ms_p50",
                "first_token_ms_p95",
                "first_token_ms_p99",
                "latency_ms_p50",
                "latency_ms_p95",
                "latency_ms_p99",
                "queue_ms_p50",
                "queue_ms_p99",
            )
        }


def period_for(since: datetime, until: datetime) -> str:
    return RollupPeriod.MINUTE if until - since <= MINUTE_ROLLUPS_UP_TO else RollupPeriod.HOUR


def _visibility(user: User) -> Q | None:
    """None: everything. Otherwise the rollups/records the person may see: their own, and
    every branch they manage."""
    if can_read_everything(user):
        return None
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return Q(pk__in=[])
    visible = Q(user_id=user.pk)
    for org_id, team_id, project_id in Membership.objects.filter(user=user, role=MembershipRole.MANAGER).values_list(
        "organization_id", "team_id", "project_id"
    ):
        if project_id:
            visible |= Q(project_id=project_id)
        elif team_id:
            visible |= Q(team_id=team_id)
        else:
            visible |= Q(organization_id=org_id)
    return visible


def visible_rollups(user: User) -> Any:
    visible = _visibility(user)
    rollups = UsageRollup.objects.all()
    return rollups if visible is None else rollups.filter(visible)


def _labels(group_by: str, ids: Iterable[Any]) -> dict[Any, str]:
    wanted = {i for i in ids if i}
    if group_by == UsageGroup.MODEL:
        return {name: name for name in wanted}
    if group_by == UsageGroup.ORGANIZATION:
        return {o.pk: o.name for o in Organization.objects.filter(pk__in=wanted)}
    if group_by == UsageGroup.TEAM:
        return {t.pk: str(t) for t in Team.objects.filter(pk__in=wanted).select_related("organization")}
    if group_by == UsageGroup.PROJECT:
        return {p.pk: str(p) for p in Project.objects.filter(pk__in=wanted).select_related("team__organization")}
    if group_by == UsageGroup.KEY:
        return {k.pk: f"{k.name} ({k.prefix}…)" for k in ApiKey.objects.filter(pk__in=wanted).only("name", "prefix")}
    return {u.pk: u.email for u in User.objects.filter(pk__in=wanted).only("email")}


# The groups held time is counted for: a model's owner and the model (not keys or people).
HELD_GROUPS = {UsageGroup.ORGANIZATION, UsageGroup.TEAM, UsageGroup.PROJECT, UsageGroup.MODEL}


def _held_visibility(user: User) -> Q | None:
    """None: every owner's held time; else the branches the person manages (held time belongs to
    owners, not to a person, so a member who manages nothing sees none)."""
    if can_read_everything(user):
        return None
    visible = Q(pk__in=[])
    if user is None or not getattr(user, "is_authenticated", False) or not user.is_active:
        return visible
    for org_id, team_id, project_id in Membership.objects.filter(user=user, role=MembershipRole.MANAGER).values_list(
        "organization_id", "team_id", "project_id"
    ):
        if project_id:
            visible |= Q(project_id=project_id)
        elif team_id:
            visible |= Q(team_id=team_id)
        else:
            visible |= Q(organization_id=org_id)
    return visible


def _held_time(
    user: User,
    groups: dict[Any, UsageRow],
    group_by: str,
    since: datetime,
    until: datetime,
    within: dict[str, int] | None,
) -> None:
    """Add each group's GPU-hours (by class) and core-hours over the hours overlapping [since, until);
    a group that held cards and served nothing gets a row of its own."""
    from apps.quotas.models import HeldTime

    visible = _held_visibility(user)
    rows = HeldTime.objects.filter(bucket_start__gt=since - timedelta(hours=1), bucket_start__lt=until)
    if visible is not None:
        rows = rows.filter(visible)
    if within:
        rows = rows.filter(**within)
    column = GROUP_COLUMNS[UsageGroup(group_by)]
    for group, gpu_class, gpu_seconds, core_seconds, joules, measured in rows.values_list(
        column, "gpu_class", "gpu_seconds", "core_seconds", "energy_joules", "measured_seconds"
    ).iterator():
        summary = groups.setdefault(group, UsageRow(group=group, label=""))
        summary.gpu_hours = summary.gpu_hours or {}
        summary.core_hours = summary.core_hours or 0.0
        summary.energy_joules += joules
        summary.measured_seconds += measured
        if gpu_seconds:
            name = gpu_class or "-"
            summary.gpu_hours[name] = summary.gpu_hours.get(name, 0.0) + gpu_seconds / 3600
        if core_seconds:
            summary.core_hours += core_seconds / 3600
    for summary in groups.values():
        if visible is None:  # every owner's held time is counted here: none held is 0, not unknown
            summary.gpu_hours = summary.gpu_hours or {}
            summary.core_hours = summary.core_hours or 0.0
        if summary.gpu_hours is None and summary.core_hours is None:
            continue
        held = sum((summary.gpu_hours or {}).values()) * 3600 + (summary.core_hours or 0.0) * 3600
        if held and summary.measured_seconds >= held * 0.999:  # all of it measured
            summary.watt_hours = summary.energy_joules / 3600


def _efficiency(summary: UsageRow) -> None:
    """Tokens served per GPU-hour and per watt-hour, where both sides are known."""
    if summary.prompt_tokens is None and summary.completion_tokens is None:
        return
    tokens = (summary.prompt_tokens or 0) + (summary.completion_tokens or 0)
    gpu_hours = sum((summary.gpu_hours or {}).values())
    if gpu_hours > 0:
        summary.tokens_per_gpu_hour = tokens / gpu_hours
    if summary.watt_hours:
        summary.tokens_per_watt_hour = tokens / summary.watt_hours


def usage_summary(
    user: User,
    *,
    group_by: str = UsageGroup.MODEL,
    since: datetime,
    until: datetime,
    period: str | None = None,
    within: dict[str, int] | None = None,
) -> list[UsageRow]:
    """Requests, server and client errors, refusals, tokens and time percentiles per group, busiest first.

    Reads minute rollups for ranges up to six hours and hour rollups beyond, so the range
    is widened to whole buckets: every bucket that overlaps [since, until) counts.
    `within` narrows to one branch, e.g. {"team_id": 3}.
    """
    if group_by not in GROUP_COLUMNS:
        raise ValueError(f"cannot group usage by {group_by!r}")
    period = period or period_for(since, until)
    column = GROUP_COLUMNS[UsageGroup(group_by)]
    rollups = visible_rollups(user).filter(
        period=period, bucket_start__gt=since - PERIOD_LENGTH[RollupPeriod(period)], bucket_start__lt=until
    )
    if within:
        unknown = set(within) - {"organization_id", "team_id", "project_id"}
        if unknown:
            raise ValueError(f"cannot narrow usage by {sorted(unknown)}")
        rollups = rollups.filter(**within)
    groups: dict[Any, UsageRow] = {}
    known_tokens: dict[Any, bool] = {}
    for row in rollups.values_list(
        column,
        "requests",
        "errors",
        "client_errors",
        "refusals",
        "prompt_tokens",
        "completion_tokens",
        "requests_without_tokens",
        "first_token_hist",
        "latency_hist",
        "queue_hist",
    ).iterator():
        group, requests, errors, client_errors, refusals, prompt, completion, without, *sketches = row
        summary = groups.setdefault(group, UsageRow(group=group, label=""))
        summary.requests += requests
        summary.errors += errors
        # A row from before client errors were counted leaves the group's count unknown, not short.
        summary.client_errors = (
            None if summary.client_errors is None or client_errors is None else summary.client_errors + client_errors
        )
        summary.refusals += refusals
        summary.prompt_tokens = (summary.prompt_tokens or 0) + prompt
        summary.completion_tokens = (summary.completion_tokens or 0) + completion
        summary.requests_without_tokens += without
        known_tokens[group] = known_tokens.get(group, False) or without < requests
        first_hist, latency_hist, queue_hist = sketches
        histograms.merge_into(summary.first_token_hist, first_hist)
        histograms.merge_into(summary.latency_hist, latency_hist)
        histograms.merge_into(summary.queue_hist, queue_hist)
    if group_by in HELD_GROUPS:
        _held_time(user, groups, group_by, since, until, within)
    labels = _labels(group_by, groups)
    for group, summary in groups.items():
        if not group:
            summary.label = _("(none)")
        elif group_by == UsageGroup.MODEL and group == UNKNOWN_MODEL:
            summary.label = _("(no such model)")
        else:
            summary.label = labels.get(group) or _("#%(id)s (deleted)") % {"id": group}
        if not known_tokens.get(group, False):  # every request's counts unknown: unknown, not zero
            summary.prompt_tokens = summary.completion_tokens = None
        if group_by == UsageGroup.MODEL:  # tokens are the callers' and held time the model owner's:
            _efficiency(summary)  # only per model are they of the same thing
        summary.percentiles()
    return sorted(groups.values(), key=lambda s: (-s.requests, s.label))


def get_request_for_user(user: User, request_id: str) -> UsageRecord | None:
    """One request, for its owner and for staff who read everything; None for anyone else."""
    record = (
        UsageRecord.objects.filter(request_id=request_id)
        .select_related("api_key", "organization", "team", "project", "user")
        .first()
    )
    if record is None:
        return None
    if can_read_everything(user) or (record.user_id is not None and record.user_id == getattr(user, "pk", None)):
        return record
    return None


GUARDRAIL_ACTIONS = ("refuse", "redact", "stop", "log")


def guardrail_counts(user: User, *, since: datetime, until: datetime) -> list[dict[str, Any]]:
    """What each guardrail policy did to the requests the person may see in [since, until): per
    policy, the requests it refused, redacted, stopped or only logged (a request counts once per
    policy and action, however many of its rules acted), busiest first. Read from the requests'
    own verdicts, so a policy since renamed or deleted is counted under the name it had."""
    records = UsageRecord.objects.filter(guardrail__isnull=False, created_at__gte=since, created_at__lt=until)
    visible = _visibility(user)
    if visible is not None:
        records = records.filter(visible)
    counts: dict[str, dict[str, int]] = {}
    for verdict in records.values_list("guardrail", flat=True).iterator(chunk_size=2000):
        seen = {
            (str(f.get("policy")), str(f.get("action")))
            for f in verdict or []
            if isinstance(f, dict) and f.get("action") in GUARDRAIL_ACTIONS
        }
        for policy, action in seen:
            counts.setdefault(policy, dict.fromkeys(GUARDRAIL_ACTIONS, 0))[action] += 1
    rows = [{"policy": policy, **found} for policy, found in counts.items()]
    return sorted(rows, key=lambda r: (-(r["refuse"] + r["stop"] + r["redact"] + r["log"]), r["policy"]))
