"""Questions only a node's agent can answer, as AgentRequest rows.

A request is created pending and sent to the node's connection at once (through the channel
layer; without Redis, the web process holding the connection looks for pending rows every
2 s). The agent's "response" answers it, or beat times it out; either way the row says what
happened, and a failed or timed-out one can be tried again. An agent that does not list the
request's feature at registration is refused at once, instead of being waited on for minutes.
Apps register what to do with an answer in apps.cluster.extensions (`add_request_handler`): the
fabrics app parses a map.
Every answer is read field by field against its kind's shape (agent.protocol.RESULTS) before
a handler sees it: a figure that fails its check (a string, a negative or impossible number)
is kept as null with the reason under "refused", never as the agent sent it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from agent import protocol
from apps.cluster.choices import NodeStatus
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.models import AgentRequest, Node
from llmgw.errors import ServiceError
from llmgw.ids import parse_id

__all__ = [
    "FEATURES",
    "RequestRefused",
    "claim",
    "create",
    "expire",
    "record_response",
    "retry",
]

log = logging.getLogger(__name__)

# The feature an agent lists at registration for each kind of request it answers.
FEATURES: dict[str, str] = {
    "ibnetdiscover": "ibnetdiscover.v1",
    "perftest.server": "perftest.v1",
    "perftest.client": "perftest.v1",
}
NEVER_SENT_GRACE = timedelta(seconds=60)


class RequestRefused(ServiceError, ValueError):
    """A request the node's agent cannot take now (too old an agent, one already pending): a conflict."""

    status = 409
    code = "agent_request_refused"


def check(node: Node, kind: str) -> None:
    feature = FEATURES.get(kind)
    if feature and feature not in (node.features or []):
        raise RequestRefused(
            _(
                "The agent of node %(node)s (version %(version)s) cannot answer %(kind)s requests: it lists "
                "%(features)s, not %(feature)s. Upgrade its agent."
            )
            % {
                "node": node.name,
                "version": node.agent_version or "-",
                "kind": kind,
                "features": ", ".join(node.features or []) or "-",
                "feature": feature,
            }
        )
    if node.live_status != NodeStatus.READY:
        raise RequestRefused(
            _("Node %(node)s is %(status)s, so its agent cannot be asked now.")
            % {"node": node.name, "status": node.live_status}
        )


def create(
    node: Node,
    kind: str,
    params: dict[str, Any] | None = None,
    *,
    timeout_s: int = 300,
    group: str = "",
    retry_of: AgentRequest | None = None,
) -> AgentRequest:
    """A pending request, sent once the transaction commits; RequestRefused says why it cannot be."""
    check(node, kind)
    row = AgentRequest.objects.create(
        node=node, kind=kind, params=params or {}, timeout_s=timeout_s, group=group, retry_of=retry_of
    )
    transaction.on_commit(lambda: notify(node.pk))
    return row


def notify(node_id: int) -> None:
    """Tell the node's connection, wherever it is, that a request waits for it."""
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from apps.cluster.actions import node_group

    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(node_group(node_id), {"type": "agent.request"})
    except Exception:
        log.warning("could not tell node %s of a request (its connection looks for them)", node_id, exc_info=True)


def claim(node_id: int) -> list[dict[str, Any]]:
    """The node's pending requests, marked sent: the bodies of their "request" messages."""
    if not has_pending(node_id):  # most often: one plain read, no transaction
        return []
    with transaction.atomic():
        rows = list(
            AgentRequest.objects.select_for_update()
            .filter(node_id=node_id, state=AgentRequest.State.PENDING)
            .order_by("pk")[:20]
        )
        now = timezone.now()
        for row in rows:
            row.state = AgentRequest.State.SENT
            row.sent_at = now
            row.save(update_fields=["state", "sent_at"])
    return [{"request_id": row.request_id, "kind": row.kind, "params": row.params} for row in rows]


def has_pending(node_id: int) -> bool:
    return AgentRequest.objects.filter(node_id=node_id, state=AgentRequest.State.PENDING).exists()


def record_response(node_id: int, body: dict[str, Any]) -> AgentRequest | None:
    """The agent's answer: the row answered (its kind's handler run on the result) or failed."""
    request_id = str(body.get("request_id") or "")
    pk = parse_id(request_id[4:], AgentRequest) if request_id.startswith("req-") else None
    if pk is None:
        return None
    with transaction.atomic():
        row = AgentRequest.objects.select_for_update().filter(pk=pk, node_id=node_id).first()
        if row is None or row.state not in (AgentRequest.State.SENT, AgentRequest.State.PENDING):
            return row
        row.answered_at = timezone.now()
        if body.get("ok"):
            _use_answer(row, protocol.read_result(row.kind, body.get("result")), node_id)
        else:
            row.state = AgentRequest.State.FAILED
            row.error = str(body.get("error") or _("the agent gave no reason"))[:4000]
        row.save(update_fields=["state", "result", "error", "answered_at"])
    return row


def _use_answer(row: AgentRequest, result: dict[str, Any], node_id: int) -> None:
    """The row answered with what its kind's handler made of the answer (read field by field, a
    refused figure kept as null with its reason under "refused"), or failed with the handler's
    reason."""
    handler = EXTENSIONS.request_handler(row.kind)
    try:
        stored = handler(row, result) if handler is not None else result
    except Exception as exc:
        log.exception("the answer to %s from node %s could not be used", row, node_id)
        row.state = AgentRequest.State.FAILED
        row.error = _("The answer could not be used: %(error)s") % {"error": exc}
        return
    if isinstance(stored, dict) and result.get("refused") and "refused" not in stored:
        stored = {**stored, "refused": result["refused"]}
    row.state = AgentRequest.State.ANSWERED
    row.result = stored


def expire(now: Any = None) -> int:
    """Sent requests unanswered past their timeout, and pending ones never sent, are timed out."""
    now = now or timezone.now()
    count = 0
    for row in AgentRequest.objects.filter(state__in=(AgentRequest.State.SENT, AgentRequest.State.PENDING)):
        if (
            row.state == AgentRequest.State.SENT
            and row.sent_at
            and now - row.sent_at > timedelta(seconds=row.timeout_s)
        ):
            row.error = _("No answer within %(seconds)s s.") % {"seconds": row.timeout_s}
        elif row.state == AgentRequest.State.PENDING and now - row.created_at > NEVER_SENT_GRACE + timedelta(
            seconds=row.timeout_s
        ):
            row.error = _("Never sent: the node's agent was not connected.")
        else:
            continue
        row.state = AgentRequest.State.TIMED_OUT
        row.save(update_fields=["state", "error"])
        count += 1
    return count


def retry(row: AgentRequest) -> AgentRequest:
    """The same request again, as a new row (the old one keeps what happened to it)."""
    if row.state in (AgentRequest.State.PENDING, AgentRequest.State.SENT):
        raise RequestRefused(_("Request %(id)s is still %(state)s.") % {"id": row.pk, "state": row.state})
    return create(row.node, row.kind, row.params, timeout_s=row.timeout_s, group=row.group, retry_of=row)
