"""The mirror's part in placement: a model served from the mirror runs only where its node holds
the version, by the node's own word.

A source under LLMGW_MIRROR_NODE_DIR is only ever there once the node's agent has fetched and
verified it (agent.mirror), so the built-in weights filter (which refuses a source only inside
the directories a node reports, and lets one outside them through) is not enough: between the
model's declaration and the node's next heartbeat the node has said nothing of the version yet,
and a node whose model_dirs do not hold the directory reports none of it. Registered under the
built-in's name, this filter keeps the built-in's rule for every other source.
"""

from __future__ import annotations

from django.conf import settings
from django.utils.translation import gettext_noop

from apps.cluster.placement import REGISTRY, NodeSnapshot, PlacementContext, Reason, Registry, filters, reasons

__all__ = ["register", "weights"]


def weights(ctx: PlacementContext, node: NodeSnapshot) -> Reason | None:
    """A source from the mirror is placed on a node that holds it whole: its probe lists it, or its
    agent says it holds the version. Otherwise the node's word on the version is the reason (it
    refused, failed, or is still fetching), or, when it said nothing of it yet, that it has not."""
    source = ctx.request.source
    if not source.startswith(settings.MIRROR_NODE_DIR + "/") or source in node.weights:
        return filters.weights_on_node(ctx, node)
    fetch = filters.fetch_of(node, source) if node.fetches else None
    if fetch is None:
        return Reason(
            "weights_not_fetched",
            gettext_noop("node %(node)s has not fetched %(source)s from the mirror yet"),
            {"node": node.name, "source": source},
        )
    state, message = fetch
    if state == "held":
        return None
    if state == "refused":
        return reasons.weights_refused(node.name, source, message)
    if state == "failed":
        return reasons.weights_failed(node.name, source, message)
    return reasons.weights_fetching(node.name, source, message)


def register(registry: Registry = REGISTRY) -> None:
    registry.register_filter(weights, name="weights", order=75, applies=lambda ctx: ctx.request.source.startswith("/"))
