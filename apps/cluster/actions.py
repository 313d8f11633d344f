"""What operators do to nodes: cordon, drain, revoke, labels, engines, a doctor run.

Each action takes the node, the acting user (None for the system) and the address the request
came from; it locks the row where another writer may be at work, saves the fields it changes by
name, and writes its audit event in the same transaction. What the node's agent or the reconciler
must hear goes out after commit, so a rolled-back decision never reaches a node.

The agent's connection is reached through its node's channel group (`node_group`); `tell_agent`
sends to it, best effort: the connections' own periodic check against their node rows
(apps.cluster.heartbeats) is the second path for what the channel layer does not deliver.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from agent import protocol
from apps.accounts import audit
from apps.accounts.models import User
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.cluster.models import Node, Replica

__all__ = [
    "cordon_node",
    "drain_node",
    "drain_status",
    "node_group",
    "request_doctor",
    "revoke_node",
    "set_disabled_engines",
    "set_engine_build",
    "set_labels",
    "tell_agent",
    "uncordon_node",
]

log = logging.getLogger(__name__)


def node_group(node_id: int) -> str:
    return f"agent.node.{node_id}"


def tell_agent(node_id: int, message: dict[str, Any]) -> None:
    """Send `message` to the node's agent connection when a channel layer is configured; a failure
    is logged, never raised."""
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(node_group(node_id), message)
    except Exception:
        log.warning("could not reach the connection of node %s", node_id, exc_info=True)


# Operator actions --------------------------------------------------------------------------


@transaction.atomic
def cordon_node(node: Node, *, reason: str, actor: User | None, address: str | None = None) -> Node:
    before = {"cordoned": node.cordoned, "reason": node.cordon_reason}
    node.cordoned = True
    node.cordon_reason = reason.strip()[:500]
    node.save(update_fields=["cordoned", "cordon_reason"])
    after = {"cordoned": True, "reason": node.cordon_reason}
    audit.record(actor, "node.cordon", node, changes=audit.diff(before, after), address=address)
    return node


@transaction.atomic
def set_disabled_engines(
    node: Node, *, disable: list[str], enable: list[str], actor: User | None, address: str | None = None
) -> Node:
    """Keep engines off a node, or let them back; the node hears at once (its desired state)."""
    from apps.cluster.engines import nodes_changed

    node = Node.objects.select_for_update().get(pk=node.pk)
    before = sorted(node.disabled_engines or [])
    after = sorted((set(before) | set(disable)) - set(enable))
    if after != before:
        node.disabled_engines = after
        node.save(update_fields=["disabled_engines"])
        audit.record(actor, "node.engines", node, changes={"disabled_engines": [before, after]}, address=address)
        pk = node.pk
        transaction.on_commit(lambda: nodes_changed({pk}))
    return node


@transaction.atomic
def set_engine_build(node: Node, build: str, *, actor: User | None, address: str | None = None) -> Node:
    """Choose which CUDA build of vLLM and SGLang the node installs (auto, cu13, cu129, none);
    the node hears at once and installs that build (the one it has stays until the new one works)."""
    from apps.cluster.engines import EngineConfigError, nodes_changed

    if build not in Node.EngineBuild.values:
        raise EngineConfigError(
            _("build: expected one of %(known)s, got %(value)r")
            % {"known": ", ".join(Node.EngineBuild.values), "value": build}
        )
    node = Node.objects.select_for_update().get(pk=node.pk)
    before = node.engine_build
    if build != before:
        node.engine_build = build
        node.save(update_fields=["engine_build"])
        audit.record(actor, "node.engine_build", node, changes={"engine_build": [before, build]}, address=address)
        pk = node.pk
        transaction.on_commit(lambda: nodes_changed({pk}))
    return node


@transaction.atomic
def uncordon_node(node: Node, *, actor: User | None, address: str | None = None) -> Node:
    """Let replicas be placed on the node again; a drain under way ends (what moved stays moved)."""
    before = {"cordoned": node.cordoned, "reason": node.cordon_reason, "draining": node.drain_requested_at is not None}
    node.cordoned = False
    node.cordon_reason = ""
    node.drain_requested_at = node.drain_grace = None
    node.drain_force = False
    node.save(update_fields=["cordoned", "cordon_reason", "drain_requested_at", "drain_grace", "drain_force"])
    audit.record(
        actor,
        "node.uncordon",
        node,
        changes=audit.diff(before, {"cordoned": False, "reason": "", "draining": False}),
        address=address,
    )
    return node


@transaction.atomic
def set_labels(
    node: Node, *, set_labels: dict[str, str], remove: list[str], actor: User | None, address: str | None = None
) -> Node:
    """Keep labels on the node over what its agent says (a rack it was moved to), or drop kept ones."""
    from apps.cluster.reconciler import request_reconcile

    with transaction.atomic():
        node = Node.objects.select_for_update().get(pk=node.pk)
        before = dict(node.labels or {})
        after = {k: v for k, v in before.items() if k not in set(remove)}
        after.update({str(k): str(v) for k, v in set_labels.items()})
        if after == before:
            return node
        node.labels = after
        node.save(update_fields=["labels"])
        changed = sorted(set(before) ^ set(after) | {k for k in after if before.get(k) != after[k]})
        audit.record(
            actor,
            "node.labels",
            node,
            changes={k: [before.get(k), after.get(k)] for k in changed},
            address=address,
        )
    request_reconcile()
    return node


def drain_node(
    node: Node, *, grace: int | None = None, force: bool = False, actor: User | None, address: str | None = None
) -> Node:
    """Cordon the node and move its replicas away: each is replaced elsewhere first (the model's
    minimum kept), then stopped: its engines run on for the requests in flight, `grace` seconds at
    most (LLMGW_DRAIN_GRACE_SECONDS when None), each stopped as soon as it is idle. A replica that
    cannot be placed elsewhere is waited for (its reasons shown) unless `force`, which stops it anyway."""
    from apps.cluster.reconciler import request_reconcile

    before = {"cordoned": node.cordoned, "draining": node.drain_requested_at is not None}
    node.cordoned = True
    node.cordon_reason = node.cordon_reason or str(_("draining"))
    node.drain_requested_at = node.drain_requested_at or timezone.now()
    node.drain_grace = grace
    node.drain_force = force
    node.save(update_fields=["cordoned", "cordon_reason", "drain_requested_at", "drain_grace", "drain_force"])
    audit.record(
        actor,
        "node.drain",
        node,
        changes=audit.diff(before, {"cordoned": True, "draining": True}),
        grace=grace,
        force=force or None,
        address=address,
    )
    request_reconcile()
    return node


def drain_status(node: Node) -> dict[str, Any] | None:
    """A drain under way: the replicas left on the node, and why each that cannot move waits."""
    from apps.cluster.model_selectors import translate_reason

    if node.drain_requested_at is None:
        return None
    left = (
        Replica.objects.filter(shards__node=node)
        .exclude(state=ReplicaState.STOPPING)
        .select_related("model")
        .distinct()
        .order_by("pk")
    )
    waiting = []
    for replica in left:
        replacement = Replica.objects.filter(replaces=replica).first()
        reasons = [
            translate_reason(r) for r in (replacement.rejections if replacement else []) or [] if isinstance(r, dict)
        ][:3]
        waiting.append(
            {
                "replica": replica.pk,
                "model": replica.model.name,
                "state": "moving" if replacement else "queued",
                "reasons": reasons,
            }
        )
    return {
        "requested_at": node.drain_requested_at,
        "grace": node.drain_grace,
        "force": node.drain_force,
        "left": len(waiting),
        "replicas": waiting,
    }


@transaction.atomic
def revoke_node(node: Node, *, actor: User | None, address: str | None = None) -> Node:
    """Cut a node off: its credential stops working and its websocket is closed at once."""
    node.credential_hash = None
    node.revoked_at = timezone.now()
    node.status = NodeStatus.REVOKED
    node.save(update_fields=["credential_hash", "revoked_at", "status"])
    audit.record(actor, "node.revoke", node, address=address)
    node_id = node.pk
    transaction.on_commit(lambda: tell_agent(node_id, {"type": "agent.revoke", "reason": "revoked"}))
    return node


def request_doctor(node: Node, *, actor: User | None, address: str | None = None) -> bool:
    """Ask the node's agent to run `llmgw doctor` now; its answer lands in `node.doctor`.
    False when the request could not be sent (no channel layer reaches the agent)."""
    now = timezone.now()
    Node.objects.filter(pk=node.pk).update(doctor_requested_at=now)
    node.doctor_requested_at = now
    audit.record(actor, "node.doctor", node, address=address)
    layer = get_channel_layer()
    if layer is None:
        return False
    text = protocol.encode("request", {"request_id": f"doctor-{secrets.token_hex(8)}", "kind": "doctor"})
    try:
        async_to_sync(layer.group_send)(node_group(node.pk), {"type": "agent.send", "text": text})
    except Exception:
        log.warning("could not ask node %s to run its checks", node.name, exc_info=True)
        return False
    return True
