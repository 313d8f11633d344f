"""What the Guardrails page and a person's account page show: the policies, where each applies, and
what their rules did lately (from the usage records' verdicts)."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from django.db.models import Prefetch, Q
from django.utils import timezone

from apps.guardrails.models import Policy, Rule, problem_text

__all__ = ["action_counts", "guardrails_page", "policies_for"]

RECENT = 50  # actions listed
COUNTED = 10_000  # the most recent verdicts counted per policy


def _rule_row(policy: Policy, rule: Rule) -> dict[str, Any]:
    problem = rule.problem() if rule.kind in ("terms", "regex", "detector") else None
    return {
        "name": rule.name,
        "kind": rule.get_kind_display(),
        "action": rule.action,
        "action_label": rule.get_action_display(),
        "applies_to": rule.get_applies_to_display(),
        "detector": rule.get_detector_display() if rule.detector else "",
        "enabled": rule.enabled,
        # A rule the gateway cannot run: why, and whether it refuses the policy's requests for it.
        "problem": problem_text(problem) if problem is not None else "",
        "blocks": problem is not None and policy.enabled and rule.enabled and rule.action != "log",
    }


def _policy_row(policy: Policy) -> dict[str, Any]:
    kind, where = policy.scope
    return {
        "name": policy.name,
        "description": policy.description,
        "enabled": policy.enabled,
        "scope": kind,
        "where": where,
        "rules": [_rule_row(policy, rule) for rule in policy.rules.all()],
    }


def _policies() -> Any:
    return Policy.objects.select_related(
        "organization", "team__organization", "project__team", "model"
    ).prefetch_related(Prefetch("rules", queryset=Rule.objects.order_by("order", "pk")))


ACTIONS = ("refuse", "redact", "stop", "log")


def _verdicts(hours: int, **filters: Any) -> Any:
    from apps.quotas.models import UsageRecord

    since = timezone.now() - timedelta(hours=hours)
    return (
        UsageRecord.objects.filter(guardrail__isnull=False, created_at__gte=since, **filters)
        .order_by("-created_at")
        .values("request_id", "created_at", "model", "endpoint", "status", "guardrail")[:COUNTED]
    )


def _count(counts: dict[str, Counter[str]], record: dict[str, Any]) -> list[dict[str, Any]]:
    findings = [f for f in record["guardrail"] or [] if isinstance(f, dict)]
    for finding in findings:
        counts.setdefault(str(finding.get("policy")), Counter())[str(finding.get("action"))] += 1
    return findings


def action_counts(hours: int = 24, **filters: Any) -> dict[str, dict[str, int]]:
    """What each policy's rules did in the last `hours`, by action: {"pii": {"refuse": 3, ...}}, only
    the policies that did something (of the most recent COUNTED requests with a verdict). `filters`
    narrow the usage records (a key's, a project's)."""
    counts: dict[str, Counter[str]] = {}
    for record in _verdicts(hours, **filters):
        _count(counts, record)
    return {policy: {a: found.get(a, 0) for a in ACTIONS} for policy, found in sorted(counts.items())}


def guardrails_page(hours: int = 24) -> dict[str, Any]:
    """Every policy with its rules; counts of what each did in the last `hours` by action; the most
    recent actions with their request."""
    counts: dict[str, Counter[str]] = {}
    recent: list[dict[str, Any]] = []
    for record in _verdicts(hours):
        for finding in _count(counts, record):
            if len(recent) < RECENT:
                recent.append(
                    {**{k: record[k] for k in ("request_id", "created_at", "model", "endpoint", "status")}, **finding}
                )
    policies = [_policy_row(p) for p in _policies()]
    for row in policies:
        found = counts.get(row["name"], Counter())
        row["counts"] = {action: found.get(action, 0) for action in ACTIONS}
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
