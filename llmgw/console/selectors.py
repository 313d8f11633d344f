"""Read-side queries for the console's shell."""

from __future__ import annotations

from typing import Any

from django.apps import apps
from django.db.models import Q
from django.utils import timezone

__all__ = ["first_steps", "landing_counts"]

# (label, app_label.Model) pairs counted on the landing page; a model that an app has not
# defined yet counts as 0, which is exactly how many of it exist.
COUNTED = (("nodes", "cluster.Node"), ("models", "catalog.Model"), ("replicas", "cluster.Replica"))


def landing_counts() -> dict[str, int]:
    counts: dict[str, int] = {}
    for label, dotted in COUNTED:
        app_label, model_name = dotted.split(".")
        try:
            model = apps.get_model(app_label, model_name)
        except LookupError:
            counts[label] = 0
            continue
        counts[label] = model._default_manager.count()
    return counts


def first_steps(user: Any, *, operator_steps: bool) -> dict[str, Any]:
    """What the Overview's first steps have come to for this person: `nodes` (joined: an agent
    registered, not revoked) with the first of them as `node`, `models` (declared, not deleted)
    with the first as `model`, and `keys` (their own active API keys, the chat page's session keys
    left out). The node and model steps are an operator's (`operator_steps`), so for others
    they are left out (None)."""
    steps: dict[str, Any] = {"nodes": None, "node": None, "models": None, "model": None}
    if operator_steps:
        joined = apps.get_model("cluster", "Node").objects.filter(registered_at__isnull=False, revoked_at__isnull=True)
        steps["nodes"] = joined.count()
        steps["node"] = joined.order_by("registered_at", "pk").first()
        declared = apps.get_model("catalog", "Model").objects.filter(deleted_at__isnull=True)
        steps["models"] = declared.count()
        steps["model"] = declared.order_by("pk").first()
    now = timezone.now()
    keys = apps.get_model("accounts", "ApiKey").objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now), user=user, revoked_at__isnull=True, is_session_key=False
    )
    steps["keys"] = keys.count()
    return steps
