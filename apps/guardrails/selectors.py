"""What the Guardrails page and a person's account page show: the policies, where each applies, and
what their rules did lately (from the usage records' verdicts)."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from django.db.models import Prefetch, Q
from django.utils import timezone

from apps.guardrails.models import Policy, Rule

__all__ = ["guardrails_page", "policies_for"]

RECENT = 50  # actions listed
COUNTED = 10_000  # the most recent verdicts counted per policy


def _policy_row(policy: Policy) -> dict[str, Any]:
    kind, where = policy.scope
    return {
        "name": policy.name,
        "description": policy.description,
        "enabled": policy.enabled,
        "scope": kind,
        "where": where,
        "rules": [
            {
                "name": rule.name,
                "kind": rule.get_kind_display(),
                "action": rule.action,
                "action_label": rule.get_action_display(),
                "applies_to": rule.get_applies_to_display(),
                "detector": rule.get_detector_display() if rule.detector else "",
                "enabled": rule.enabled,
            }
            for rule in policy.rules.all()
        ],
    }


def _policies() -> Any:
    return Policy.objects.select_related(
        "organization", "team__organization", "project__team", "model"
    ).prefetch_related(Prefetch("rules", queryset=Rule.objects.order_by("order", "pk")))


def guardrails_page(hours: int = 24) -> dict[str, Any]:
    """Every policy with its rules; counts of what each did in the last `hours` by action; the most
    recent actions with their request."""
    from apps.quotas.models import UsageRecord

    since = timezone.now() - timedelta(hours=hours)
    counts: dict[str, Counter[str]] = {}
    recent: list[dict[str, Any]] = []
    records = (
        UsageRecord.objects.filter(guardrail__isnull=False, created_at__gte=since)
        .order_by("-created_at")
        .values("request_id", "created_at", "model", "endpoint", "status", "guardrail")[:COUNTED]
    )
    for record in records:
        for finding in record["guardrail"] or []:
            if not isinstance(finding, dict):
                continue
            counts.setdefault(str(finding.get("policy")), Counter())[str(finding.get("action"))] += 1
            if len(recent) < RECENT:
                recent.append(
                    {**{k: record[k] for k in ("request_id", "created_at", "model", "endpoint", "status")}, **finding}
                )
    policies = [_policy_row(p) for p in _policies()]
    for row in policies:
        found = counts.get(row["name"], Counter())
        row["counts"] = {action: found.get(action, 0) for action in ("refuse", "redact", "stop", "log")}
    return {"policies": policies, "recent": recent, "hours": hours}


def policies_for(user: Any) -> list[dict[str, Any]]:
    """The enabled policies in force for a person's requests: those on everyone, on the organisations,
    teams and projects they belong to or their API keys are for, and those on a model (which apply
    when they use it)."""
    from apps.accounts.models import ApiKey, Membership

    orgs: set[int] = set()
    teams: set[int] = set()
    projects: set[int] = set()
    for membership in Membership.objects.filter(user=user):
        orgs.add(membership.organization_id)
        if membership.team_id:
            teams.add(membership.team_id)
        if membership.project_id:
            projects.add(membership.project_id)
    for key in ApiKey.objects.active().filter(user=user, project__isnull=False).select_related("project__team"):
        project = key.project
        assert project is not None
        projects.add(project.pk)
        teams.add(project.team_id)
        orgs.add(project.team.organization_id)
    found = (
        _policies()
        .filter(enabled=True)
        .filter(
            Q(organization__isnull=True, team__isnull=True, project__isnull=True, model__isnull=True)
            | Q(organization_id__in=orgs)
            | Q(team_id__in=teams)
            | Q(project_id__in=projects)
            | Q(model__isnull=False)
        )
    )
    return [_policy_row(p) for p in found.distinct()]
