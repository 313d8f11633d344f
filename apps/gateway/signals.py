"""Tell the gateways to reload their tables after a change to keys, limits, models or replicas.

This is cache invalidation of derived data (the gateway's in-memory tables), the one use of
signals here: whatever path changes these rows, the gateway must hear of it.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import F
from django.db.models.signals import post_delete, post_save

from llmgw import redis_client

__all__ = ["announce", "bump", "connect"]

#: What the gateway's key table reads of an organisation, team or project.
BRANCH_FIELDS = {"weight", "band", "organization", "team"}


def bump() -> None:
    from apps.gateway.models import TableVersion

    def run() -> None:
        if TableVersion.objects.filter(pk=1).update(version=F("version") + 1) == 0:
            TableVersion.objects.get_or_create(pk=1, defaults={"version": 1})
        announce()

    transaction.on_commit(run)


def announce() -> None:
    """Tell every gateway process to read its tables now rather than at its next look at the version:
    the one in this process directly, the others through Redis. Best effort: the version stays the
    source of truth, read every LLMGW_GATEWAY_REFRESH_SECONDS."""
    import sys

    here = sys.modules.get("apps.gateway.asgi")
    if here is not None:
        here.gateway_app.wake_from_thread()
    try:
        publisher = redis_client.client()
        if publisher is not None:
            from apps.gateway.tables import tables_channel

            publisher.publish(tables_channel(), "changed")
    except Exception:  # noqa: BLE001 - a hint only; the periodic check catches up
        pass


def _changed(sender: Any, **kwargs: Any) -> None:
    update_fields = kwargs.get("update_fields")
    # last-used stamps and heartbeat figures do not change what the gateway routes
    if update_fields is not None and set(update_fields) <= {"last_used_at", "cores_used", "memory_used_bytes"}:
        return
    bump()


def connect() -> None:
    from apps.accounts.models import ApiKey, Organization, Project, Team, User
    from apps.catalog.models import Model, Profile
    from apps.cluster.models import Node, Replica, Shard
    from apps.guardrails.models import Policy, Rule

    # A policy or rule changed: the tables carry the compiled rules.
    senders: list[Any] = [ApiKey, User, Model, Profile, Replica, Shard, Policy, Rule]
    try:
        from apps.quotas.models import RateLimit

        senders.append(RateLimit)
    except ImportError:
        pass
    for sender in senders:
        post_save.connect(_changed, sender=sender, dispatch_uid=f"gateway-{sender.__name__}-save")
        post_delete.connect(_changed, sender=sender, dispatch_uid=f"gateway-{sender.__name__}-delete")

    def node_changed(sender: Any, **kwargs: Any) -> None:
        fields = kwargs.get("update_fields")
        if fields is None or {"address", "status", "revoked_at", "credential_hash"} & set(fields):
            bump()

    post_save.connect(node_changed, sender=Node, dispatch_uid="gateway-Node-save")

    def branch_changed(sender: Any, **kwargs: Any) -> None:
        # The key table carries each key's organisation, team and project weights and its project's
        # band (apps.gateway.tables.KeyEntry): a change to one of them is a change to every key under it.
        fields = kwargs.get("update_fields")
        if fields is None or BRANCH_FIELDS & set(fields):
            bump()

    for sender in (Organization, Team, Project):
        post_save.connect(branch_changed, sender=sender, dispatch_uid=f"gateway-{sender.__name__}-save")
