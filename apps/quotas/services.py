"""Every change to rate limits goes through here."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.utils import timezone

from apps.accounts import audit
from apps.accounts.models import User
from apps.quotas.models import LIMIT_FIELDS, RateLimit

__all__ = ["create_rate_limit", "delete_rate_limit", "update_rate_limit"]

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
    audit.record(actor, "rate_limit.create", limit, changes=audit.diff({}, _limits(limit)), scope=limit.scope,
                 address=address)
    return limit


@transaction.atomic
def update_rate_limit(limit: RateLimit, *, actor: User | None, address: str | None = None,
                      **changes: Any) -> RateLimit:
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
    audit.record(actor, "rate_limit.delete", limit, changes=audit.diff(_limits(limit), {}), scope=limit.scope,
                 address=address)
    limit.delete()
