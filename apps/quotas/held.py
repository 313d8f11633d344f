"""GPU time per owner: every second a replica's shard holds its cards (or, without a GPU, its
cores) is counted for its model's owner, by GPU class, in HeldTime's hourly rows.

Each shard carries `held_since`, the moment up to which its time was counted. Two things count it
on to now: the beat's `accrue_held_time` every minute, for every shard that holds a claim, and the
shard's own deletion (its replica released, a failed replica's claims given back, a model
deleted), for its last stretch. Both lock the shard's row and move `held_since` in the same
transaction as the time they add, so no second is counted twice or lost; a stretch across an hour
boundary is split between the two hours.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from apps.quotas.models import HeldTime

__all__ = ["accrue_held_time", "accrue_shards", "owner_ids"]

HOUR = timedelta(hours=1)


def owner_ids(model: Any) -> tuple[int, int, int]:
    """(organisation, team, project) ids of a model's owner, each filled in from the one below it
    (a project's team and organisation), 0 where it has none."""
    project, team, org = model.project, model.team, model.organization
    if project is not None:
        team = team or project.team
    if team is not None:
        org = org or team.organization
    return (org.pk if org else 0, team.pk if team else 0, project.pk if project else 0)


def _stretches(start: datetime, end: datetime) -> Iterable[tuple[datetime, float]]:
    """(hour it falls in, seconds) for [start, end), split at each hour boundary."""
    moment = start
    while moment < end:
        hour = moment.replace(minute=0, second=0, microsecond=0)
        stop = min(hour + HOUR, end)
        yield hour, (stop - moment).total_seconds()
        moment = stop


def _held(shards: Iterable[Any], until: datetime) -> dict[tuple[Any, ...], list[float]]:
    """What the shards held from their `held_since` to `until`, by HeldTime's key."""
    from apps.cluster.models import Gpu

    shards = list(shards)
    classes = {
        (node_id, index): gpu_class
        for node_id, index, gpu_class in Gpu.objects.filter(node_id__in={s.node_id for s in shards}).values_list(
            "node_id", "index", "gpu_class"
        )
    }
    sums: dict[tuple[Any, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for shard in shards:
        if shard.held_since >= until:
            continue
        model = shard.replica.model
        owner = owner_ids(model)
        cards: dict[str, int] = defaultdict(int)
        for index in shard.gpu_indices or ():
            cards[classes.get((shard.node_id, index), "")] += 1
        for hour, seconds in _stretches(shard.held_since, until):
            for gpu_class, count in cards.items():
                sums[(hour, model.name, *owner, gpu_class)][0] += count * seconds
            if not cards and shard.cpu_cores:
                sums[(hour, model.name, *owner, "")][1] += shard.cpu_cores * seconds
    return sums


def _add(sums: dict[tuple[Any, ...], list[float]]) -> None:
    for (hour, model, org, team, project, gpu_class), (gpu_seconds, core_seconds) in sums.items():
        key = {
            "bucket_start": hour,
            "model": model,
            "organization_id": org,
            "team_id": team,
            "project_id": project,
            "gpu_class": gpu_class,
        }
        updated = HeldTime.objects.filter(**key).update(
            gpu_seconds=F("gpu_seconds") + gpu_seconds, core_seconds=F("core_seconds") + core_seconds
        )
        if not updated:
            HeldTime.objects.create(**key, gpu_seconds=gpu_seconds, core_seconds=core_seconds)


def _claiming() -> Any:
    from apps.cluster.inventory import CLAIMING_STATES
    from apps.cluster.models import Shard

    return Shard.objects.filter(replica__state__in=CLAIMING_STATES).select_related(
        "replica__model__organization", "replica__model__team__organization", "replica__model__project__team"
    )


@transaction.atomic
def accrue_shards(pks: Iterable[int], until: datetime | None = None) -> None:
    """Count the given shards' held time up to `until` (now), locking their rows."""
    from apps.cluster.models import Shard

    until = until or timezone.now()
    shards = list(
        Shard.objects.select_for_update(of=("self",))
        .filter(pk__in=list(pks))
        .select_related(
            "replica__model__organization", "replica__model__team__organization", "replica__model__project__team"
        )
    )
    _add(_held(shards, until))
    Shard.objects.filter(pk__in=[s.pk for s in shards], held_since__lt=until).update(held_since=until)


def accrue_held_time(now: datetime | None = None) -> int:
    """Count every claiming shard's held time up to now (the beat runs it every minute). Returns how
    many shards were counted."""
    until = now or timezone.now()
    pks = list(_claiming().filter(held_since__lt=until).values_list("pk", flat=True))
    for start in range(0, len(pks), 1000):
        accrue_shards(pks[start : start + 1000], until)
    return len(pks)
