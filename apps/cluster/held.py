"""GPU time per owner: every second a replica's shard holds its cards (or, without a GPU, its
cores) is counted for its model's owner, by GPU class, in HeldTime's hourly rows.

Each shard carries `held_since`, the moment up to which its time was counted. Two things count it
on to now: the beat's `accrue_held_time` every minute, for every shard that holds a claim, and the
shard's own deletion (its replica released, a failed replica's claims given back, a model
deleted), for its last stretch. Both lock the shard's row and move `held_since` in the same
transaction as the time they add, so no second is counted twice or lost; a stretch across an hour
boundary is split between the two hours.

The energy the held cards drew is counted with the time: each card's measured power (a CPU
shard's share of the node's RAPL package power, by cores) from the node's latest fresh sample,
times the stretch. A stretch without a reading adds time and no energy, and `measured_seconds`
says how much of the time was measured, so a figure per watt-hour is given only when all of it was.

A slice of a card (a MIG device, an AMD compute partition) counts by its share of the card: a 1g
of 7 holds 1/7 of a GPU-second each second, and draws 1/7 of what its card draws (a slice has no
power reading of its own). AMD cards count by their own readings, as NVIDIA cards do.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from agent.messages import HeartbeatSample
from apps.cluster.gpu_classes import class_share
from apps.cluster.inventory import CLAIMING_STATES
from apps.cluster.models import Gpu, Node, Shard
from apps.quotas.models import HeldTime

__all__ = ["accrue_held_time", "accrue_shards", "owner_ids"]

HOUR = timedelta(hours=1)


def owner_ids(model: Any) -> tuple[int, int, int]:
    """(organisation, team, project) ids of a model's owner, each filled in from the one below it
    (a project's team and organisation), 0 where it has none."""
    project_id, team_id, org_id = model.project_id, model.team_id, model.organization_id
    if project_id and not team_id:
        team_id = model.project.team_id
    if team_id and not org_id:
        org_id = (model.team or model.project.team).organization_id  # ids only: no query for the organisation
    return (org_id or 0, team_id or 0, project_id or 0)


def _stretches(start: datetime, end: datetime) -> Iterable[tuple[datetime, float]]:
    """(hour it falls in, seconds) for [start, end), split at each hour boundary."""
    moment = start
    while moment < end:
        hour = moment.replace(minute=0, second=0, microsecond=0)
        stop = min(hour + HOUR, end)
        yield hour, (stop - moment).total_seconds()
        moment = stop


def _power(sample: HeartbeatSample | None, shard: Any, slices: dict[int, tuple[int, float]]) -> dict[Any, float]:
    """What the node's latest fresh sample says each of the shard's cards draws now (watts, by GPU
    index; a slice its share of what its card draws, `slices` giving each slice's card and share),
    or for a shard without a GPU its share of the CPU package power by its cores (key None); a
    reading the node does not give is absent."""
    if sample is None:
        return {}
    if shard.gpu_indices:
        draws = {
            g["index"]: draw for g in sample.get("gpus") or [] if isinstance(draw := g.get("power_draw_w"), int | float)
        }
        found = {i: float(draws[i]) for i in shard.gpu_indices if i in draws}
        for index in shard.gpu_indices:
            card, share = slices.get(index, (None, 1.0))
            if index not in found and card in draws:
                found[index] = float(draws[card]) * share
        return found
    package, cpus = sample.get("cpu_package_power_w"), sample.get("cpus")
    if isinstance(package, int | float) and isinstance(cpus, int) and cpus > 0 and shard.cpu_cores:
        return {None: float(package) * min(shard.cpu_cores / cpus, 1.0)}
    return {}


def _held(shards: Iterable[Any], until: datetime) -> dict[tuple[Any, ...], list[float]]:
    """What the shards held from their `held_since` to `until`, by HeldTime's key: [GPU seconds,
    core seconds, joules, measured seconds]. The power each draws now stands for the stretch (the
    beat counts every minute, so a stretch is a minute but for one after an outage)."""
    shards = list(shards)
    node_ids = {s.node_id for s in shards}
    classes: dict[tuple[int, int], str] = {}
    slices: dict[int, dict[int, tuple[int, float]]] = defaultdict(dict)  # node -> slice -> (card, share)
    for node_id, index, gpu_class, parent, share in Gpu.objects.filter(node_id__in=node_ids).values_list(
        "node_id", "index", "gpu_class", "parent_index", "share"
    ):
        classes[(node_id, index)] = gpu_class
        if parent is not None:  # a share its agent did not give is the one its class names
            slices[node_id][index] = (parent, share if share is not None and 0 < share <= 1 else class_share(gpu_class))
    samples = {n.pk: n.fresh_sample(until) for n in Node.objects.filter(pk__in=node_ids).only("sample", "sampled_at")}
    sums: dict[tuple[Any, ...], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for shard in shards:
        if shard.held_since >= until:
            continue
        model = shard.replica.model
        owner = owner_ids(model)
        cards: dict[str, list[Any]] = defaultdict(list)
        for index in shard.gpu_indices or ():
            cards[classes.get((shard.node_id, index), "")].append(index)
        shares = slices.get(shard.node_id, {})
        power = _power(samples.get(shard.node_id), shard, shares)
        for hour, seconds in _stretches(shard.held_since, until):
            for gpu_class, indices in cards.items():
                found = sums[(hour, model.name, *owner, gpu_class)]
                held = [shares[i][1] if i in shares else 1.0 for i in indices]
                found[0] += sum(held) * seconds
                found[2] += sum(power[i] for i in indices if i in power) * seconds
                found[3] += sum(part for i, part in zip(indices, held, strict=True) if i in power) * seconds
            if not cards and shard.cpu_cores:
                found = sums[(hour, model.name, *owner, "")]
                found[1] += shard.cpu_cores * seconds
                if None in power:
                    found[2] += power[None] * seconds
                    found[3] += shard.cpu_cores * seconds
    return sums


def _add(sums: dict[tuple[Any, ...], list[float]]) -> None:
    for (hour, model, org, team, project, gpu_class), (gpu_seconds, core_seconds, joules, measured) in sums.items():
        key = {
            "bucket_start": hour,
            "model": model,
            "organization_id": org,
            "team_id": team,
            "project_id": project,
            "gpu_class": gpu_class,
        }
        figures = {
            "gpu_seconds": gpu_seconds,
            "core_seconds": core_seconds,
            "energy_joules": joules,
            "measured_seconds": measured,
        }
        added = {name: F(name) + value for name, value in figures.items()}
        if HeldTime.objects.filter(**key).update(**added):
            continue
        try:
            with transaction.atomic():  # a savepoint: another count may start the same hour's row
                HeldTime.objects.create(**key, **figures)
        except IntegrityError:
            HeldTime.objects.filter(**key).update(**added)


def _claiming() -> Any:
    return Shard.objects.filter(replica__state__in=CLAIMING_STATES).select_related(
        "replica__model__organization", "replica__model__team__organization", "replica__model__project__team"
    )


@transaction.atomic
def accrue_shards(pks: Iterable[int], until: datetime | None = None) -> None:
    """Count the given shards' held time up to `until` (now), locking their rows."""
    until = until or timezone.now()
    shards = list(
        Shard.objects.select_for_update(of=("self",))
        .filter(pk__in=list(pks))
        .order_by("pk")  # locked in one order by every count, so two never wait on each other
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
