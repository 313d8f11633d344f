"""Read-side views of models: how each runs, where, and why not."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.catalog.models import Model
from apps.cluster.choices import ReplicaState
from apps.cluster.models import Replica, Shard

__all__ = ["model_status", "models_with_replicas", "translate_reason"]


def models_with_replicas() -> QuerySet[Model]:
    return Model.objects.prefetch_related(
        "profiles",
        Prefetch("replicas", queryset=Replica.objects.order_by("created_at").prefetch_related(
            Prefetch("shards", queryset=Shard.objects.select_related("node").order_by("rank")))),
    ).select_related("organization", "team", "project")


def model_status(model: Model) -> dict[str, Any]:
    """Ready of wanted, how many are starting, and the nodes: one line of the models list."""
    replicas = list(model.replicas.all())
    states = Counter(r.state for r in replicas)
    nodes = sorted({s.node.name for r in replicas if r.state != ReplicaState.STOPPING for s in r.shards.all()})
    pending = [r for r in replicas if r.state == ReplicaState.PENDING]
    return {
        "wanted": model.wanted_replicas(timezone.now()),
        "ready": states.get(ReplicaState.READY, 0),
        "starting": states.get(ReplicaState.STARTING, 0),
        "pending": states.get(ReplicaState.PENDING, 0),
        "failed": states.get(ReplicaState.FAILED, 0),
        "stopping": states.get(ReplicaState.STOPPING, 0),
        "nodes": nodes,
        "message": (pending[0].message if pending else ""),
    }


def translate_reason(rejection: dict[str, Any]) -> str:
    """A placement refusal in the reader's language (placement writes English with its template)."""
    template = rejection.get("template")
    params = rejection.get("params") or {}
    if template:
        try:
            return _(template) % params
        except (KeyError, TypeError, ValueError):
            pass
    return str(rejection.get("message", ""))
