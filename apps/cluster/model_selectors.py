"""Read-side views of models: how each runs, where, and why not."""

from __future__ import annotations

from collections import Counter
from typing import Any

from django.db.models import Prefetch, QuerySet
from django.utils import timezone
from django.utils.translation import gettext as _

from apps.catalog.models import Model
from apps.cluster.choices import ReplicaState, ShardState
from apps.cluster.models import Replica, Shard

__all__ = ["failures", "model_status", "models_with_replicas", "translate_reason"]


def models_with_replicas() -> QuerySet[Model]:
    return (
        Model.objects.live()
        .prefetch_related(
            "profiles",
            Prefetch(
                "replicas",
                queryset=Replica.objects.order_by("created_at").prefetch_related(
                    Prefetch("shards", queryset=Shard.objects.select_related("node").order_by("rank"))
                ),
            ),
        )
        .select_related("organization", "team", "project")
    )


def model_status(model: Model) -> dict[str, Any]:
    """Ready of wanted, how many are starting, and the nodes: one line of the models list."""
    replicas = list(model.replicas.all())
    states = Counter(r.state for r in replicas)
    nodes = sorted({s.node.name for r in replicas if r.state != ReplicaState.STOPPING for s in r.shards.all()})
    pending = [r for r in replicas if r.state == ReplicaState.PENDING]
    wanted = model.wanted_replicas(timezone.now())
    return {
        "wanted": wanted,
        "ready": states.get(ReplicaState.READY, 0),
        "starting": states.get(ReplicaState.STARTING, 0),
        "pending": states.get(ReplicaState.PENDING, 0),
        "failed": states.get(ReplicaState.FAILED, 0),
        "stopping": states.get(ReplicaState.STOPPING, 0),
        "nodes": nodes,
        "message": (pending[0].message if pending else ""),
        # Why the first pending replica is not placed: the first refusals placement met.
        "reasons": [translate_reason(r) for r in (pending[0].rejections if pending else [])[:STATUS_REASONS]],
        "failures": failures(replicas),
        "rolling": rolling_status(model, replicas, wanted),
    }


STATUS_REASONS = 5  # refusals of a pending replica given with the models list
STATUS_LOG_LINES = 12  # lines of a failed engine's log given with the models list (the model has them all)


def failures(replicas: list[Replica]) -> list[dict[str, Any]]:
    """The failed engines of failed replicas: where, the exit code, the agent's message and the
    last lines of the engine's own log (its real reason is there, not in its exit code)."""
    return [
        {
            "replica": replica.pk,
            "node": shard.node.name,
            "rank": shard.rank,
            "exit_code": shard.exit_code,
            "message": shard.message,
            "log_tail": [str(line) for line in (shard.log_tail or [])][-STATUS_LOG_LINES:],
        }
        for replica in replicas
        if replica.state == ReplicaState.FAILED
        for shard in replica.shards.all()
        if shard.state == ShardState.FAILED
    ]


def rolling_status(model: Model, replicas: list[Replica], wanted: int) -> dict[str, int] | None:
    """While a changed spec is rolled out: how many of the wanted replicas run it ready ("rolling 1
    of 3"); None when every replica runs the model's current spec."""
    from apps.cluster.inventory import running_spec

    current = {p.pk: running_spec(model, p) for p in model.profiles.all()}
    live = [r for r in replicas if r.state in (ReplicaState.STARTING, ReplicaState.READY)]
    stale = [r for r in live if r.spec and r.spec != current.get(r.profile_id)]  # type: ignore[arg-type]
    replacing = [r for r in replicas if r.replaces_id and r.state != ReplicaState.STOPPING]
    if not stale and not replacing:
        return None
    done = sum(
        1
        for r in live
        if r.state == ReplicaState.READY
        and not r.replaces_id
        and r.profile_id is not None
        and r.spec == current.get(r.profile_id)
    )
    return {"done": min(done, wanted), "of": wanted}


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
