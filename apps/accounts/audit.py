"""The one way to write an audit event, and the way to read its changes."""

from __future__ import annotations

import json
from typing import Any

from django.db import models

from apps.accounts.models import AuditEvent, User

__all__ = ["change_lines", "diff", "record"]


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, list[Any]]:
    """{"field": [old, new]} for every field whose value changed."""
    return {
        key: [before.get(key), after.get(key)]
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    }


def record(
    actor: User | None,
    action: str,
    target: models.Model | None = None,
    *,
    changes: dict[str, Any] | None = None,
    address: str | None = None,
    **extra: Any,
) -> AuditEvent:
    """Write one audit event. Call inside the service's transaction so both land or neither."""
    payload = dict(changes or {})
    if extra:
        payload.update({key: value for key, value in extra.items() if value is not None})
    actor_obj = actor if actor is not None and getattr(actor, "pk", None) else None
    return AuditEvent.objects.create(
        actor=actor_obj,
        actor_label=actor_obj.email if actor_obj else "system",
        action=action,
        target_type=target._meta.label_lower if target is not None else "",
        target_id=str(target.pk) if target is not None else "",
        target_label=str(target)[:300] if target is not None else "",
        changes=payload,
        address=address,
    )


def _value(value: Any) -> str:
    """One value as the Audit page shows it: "-" for none, JSON for the rest of what is not text."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def change_lines(changes: Any) -> list[str]:
    """ "field: old → new" for each changed field (as diff() writes them), "field: value" for the rest."""
    if not isinstance(changes, dict):
        return [_value(changes)] if changes not in (None, "", [], {}) else []
    lines = []
    # Sorted by field: PostgreSQL's jsonb keeps no key order, and the log must read the same on either.
    for key, value in sorted(changes.items()):
        if isinstance(value, list) and len(value) == 2:
            lines.append(f"{key}: {_value(value[0])} → {_value(value[1])}")
        else:
            lines.append(f"{key}: {_value(value)}")
    return lines
