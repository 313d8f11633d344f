"""Every change to rate limits and capacity quotas goes through here."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.accounts import audit
from apps.accounts.models import Organization, Project, Team, User
from apps.quotas.models import LIMIT_FIELDS, CapacityQuota, RateLimit

__all__ = [
    "create_capacity_quota",
    "create_rate_limit",
    "delete_capacity_quota",
    "delete_rate_limit",
    "remove_branch_limits",
    "set_capacity_quota",
    "set_rate_limit",
    "update_capacity_quota",
    "update_rate_limit",
]

Branch = Organization | Team | Project

OWNER_FIELDS = ("organization", "team", "project", "api_key")


def _limits(limit: RateLimit) -> dict[str, Any]:
    return {name: getattr(limit, name) for name in LIMIT_FIELDS}


@transaction.atomic
def create_rate_limit(*, actor: User | None, address: str | None = None, **fields: Any) -> RateLimit:
    """A new rate limit for one owner (organization, team, project or api_key) with its limits."""
    unknown = set(fields) - set(OWNER_FIELDS) - set(LIMIT_FIELDS)
    if unknown:
        raise TypeError(f"unknown rate limit fields: {sorted(unknown)}")
    limit = RateLimit(**fields)
    limit.full_clean()
    limit.save()
    audit.record(
        actor, "rate_limit.create", limit, changes=audit.diff({}, _limits(limit)), scope=limit.scope, address=address
    )
    return limit


@transaction.atomic
def update_rate_limit(limit: RateLimit, *, actor: User | None, address: str | None = None, **changes: Any) -> RateLimit:
    """Change an owner's limits (None removes a limit). The owner itself does not change."""
    unknown = set(changes) - set(LIMIT_FIELDS)
    if unknown:
        raise TypeError(f"only limits can change, not {sorted(unknown)}")
    before = _limits(limit)
    for name, value in changes.items():
        setattr(limit, name, value)
    limit.full_clean()
    difference = audit.diff(before, _limits(limit))
    if difference:
        limit.updated_at = timezone.now()
        limit.save(update_fields=[*changes, "updated_at"])
        audit.record(actor, "rate_limit.update", limit, changes=difference, scope=limit.scope, address=address)
    return limit


@transaction.atomic
def delete_rate_limit(limit: RateLimit, *, actor: User | None, address: str | None = None) -> None:
    audit.record(
        actor, "rate_limit.delete", limit, changes=audit.diff(_limits(limit), {}), scope=limit.scope, address=address
    )
    limit.delete()


# Capacity quotas ---------------------------------------------------------------------------

QUOTA_FIELDS = ("gpus", "cpu_cores", "memory_bytes", "replicas")
QUOTA_OWNER_FIELDS = ("organization", "team", "project")


def _quota(quota: CapacityQuota) -> dict[str, Any]:
    return {name: getattr(quota, name) for name in QUOTA_FIELDS}


@transaction.atomic
def create_capacity_quota(*, actor: User | None, address: str | None = None, **fields: Any) -> CapacityQuota:
    """A new capacity quota for one owner (organization, team or project). Placement reads it at once."""
    unknown = set(fields) - set(QUOTA_OWNER_FIELDS) - set(QUOTA_FIELDS)
    if unknown:
        raise TypeError(f"unknown capacity quota fields: {sorted(unknown)}")
    quota = CapacityQuota(**fields)
    quota.full_clean()
    quota.save()
    audit.record(
        actor,
        "capacity_quota.create",
        quota,
        changes=audit.diff({}, _quota(quota)),
        owner=quota.owner_key,
        address=address,
    )
    return quota


@transaction.atomic
def update_capacity_quota(
    quota: CapacityQuota, *, actor: User | None, address: str | None = None, **changes: Any
) -> CapacityQuota:
    """Change an owner's quota (None removes a limit). The owner itself does not change."""
    unknown = set(changes) - set(QUOTA_FIELDS)
    if unknown:
        raise TypeError(f"only quota limits can change, not {sorted(unknown)}")
    before = _quota(quota)
    for name, value in changes.items():
        setattr(quota, name, value)
    quota.full_clean()
    difference = audit.diff(before, _quota(quota))
    if difference:
        quota.save(update_fields=list(changes))
        audit.record(actor, "capacity_quota.update", quota, changes=difference, owner=quota.owner_key, address=address)
    return quota


@transaction.atomic
def delete_capacity_quota(quota: CapacityQuota, *, actor: User | None, address: str | None = None) -> None:
    audit.record(
        actor,
        "capacity_quota.delete",
        quota,
        changes=audit.diff(_quota(quota), {}),
        owner=quota.owner_key,
        address=address,
    )
    quota.delete()


# A branch's limits, as the People page edits them ----------------------------------------------------


@transaction.atomic
def set_rate_limit(
    owner: dict[str, Branch], values: dict[str, Any], *, actor: User | None, address: str | None = None
) -> None:
    """Make a branch's rate limit say `values` (None: no limit), changing only what differs.

    `owner` is {"organization": org}, {"team": team} or {"project": project}. A limit is created
    when the branch has none, and deleted when every value is cleared; each change audited.
    """
    _set(
        RateLimit.objects.filter(**owner).first(),
        owner,
        values,
        create=create_rate_limit,
        update=update_rate_limit,
        delete=delete_rate_limit,
        actor=actor,
        address=address,
    )


@transaction.atomic
def set_capacity_quota(
    owner: dict[str, Branch], values: dict[str, Any], *, actor: User | None, address: str | None = None
) -> None:
    """Make a branch's capacity quota say `values` (None: no limit), as set_rate_limit does."""
    _set(
        CapacityQuota.objects.filter(**owner).first(),
        owner,
        values,
        create=create_capacity_quota,
        update=update_capacity_quota,
        delete=delete_capacity_quota,
        actor=actor,
        address=address,
    )


def _set(
    current: Any,
    owner: dict[str, Branch],
    values: dict[str, Any],
    *,
    create: Any,
    update: Any,
    delete: Any,
    actor: User | None,
    address: str | None,
) -> None:
    wanted = {name: value for name, value in values.items() if value is not None}
    if current is None:
        if wanted:
            create(actor=actor, address=address, **owner, **wanted)
    elif not wanted:
        delete(current, actor=actor, address=address)
    else:
        changes = {name: value for name, value in values.items() if getattr(current, name) != value}
        if changes:
            update(current, actor=actor, address=address, **changes)


def remove_branch_limits(branch: Branch, actor: User | None, address: str | None) -> None:
    """A removed organisation, team or project's rate limit and capacity quota: they describe only
    it, so they go before it, each audited (registered in QuotasConfig.ready())."""
    kind = "organization" if isinstance(branch, Organization) else "team" if isinstance(branch, Team) else "project"
    owner = {kind: branch}
    for limit in RateLimit.objects.filter(**owner):
        delete_rate_limit(limit, actor=actor, address=address)
    for quota in CapacityQuota.objects.filter(**owner):
        delete_capacity_quota(quota, actor=actor, address=address)
