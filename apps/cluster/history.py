"""The last hour of each node's samples, kept outside the database, for its charts and the fleet's.

One point per heartbeat (`append_histories`): the node's CPU, memory, load, each card's use,
temperature, power and memory, and, where the node runs engines, each model's claims, use and
queue. Points are kept in a capped Redis list per node (one round trip for a whole batch of
heartbeats, shared by every web process), or in the local cache without Redis, and expire after
HISTORY_SECONDS. The same batch goes to the models' engine figures (apps.cluster.engine_history)
and the fleet rollup (apps.cluster.rollup), which keep theirs in the same Redis (`client`).

The history is a convenience: a Redis or cache that does not answer loses points, never the
heartbeats, and a read that fails gives no points rather than an error. A figure that was not
read is None, never 0. The gateway's queue depths come through the cluster's registry
(apps.cluster.extensions), filled by the gateway.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.cache import cache
from django.db import transaction
from django.utils import timezone

from agent.messages import GpuFigures, HeartbeatSample
from apps.cluster import engine_history, rollup
from apps.cluster.extensions import EXTENSIONS
from apps.cluster.models import Shard
from llmgw import redis_client

if TYPE_CHECKING:
    import redis

__all__ = [
    "HISTORY_POINTS",
    "HISTORY_SECONDS",
    "RECENT_POINTS",
    "append_histories",
    "client",
    "oldest_points",
    "recent_history",
    "sample_history",
]

log = logging.getLogger(__name__)

HISTORY_SECONDS = 3600
HISTORY_POINTS = 400  # an hour of 10-second heartbeats, with room for a faster interval
RECENT_POINTS = 60  # what recent_history reads of each node: ten minutes of 10-second heartbeats


def client() -> redis.Redis | None:
    """The Redis client the cluster keeps its figures in (the nodes' histories, the models' engine
    figures, the fleet rollup), shared by every web process; None without Redis. Two seconds at
    most per answer: a batch of heartbeats waits no longer than that for its history."""
    return redis_client.client(timeout=2.0)


def append_histories(samples: dict[int, HeartbeatSample]) -> None:
    """Add one history point per node: the last hour of points, kept outside the database in a
    capped Redis list per node (one round trip for them all), or in the local cache without Redis.
    Each point carries its node's per-model claims, use and queues where they were read. The
    engines' own figures in the samples go to their models' histories (apps.cluster.engine_history)."""
    engine_history.record(samples)
    try:
        rollup.record(samples, client())
    except Exception:  # the page's figures are a convenience too
        log.warning("could not fold the samples of %s nodes into the fleet rollup", len(samples), exc_info=True)
    try:
        store = client()
        if store is None:
            stored = {node_id: list(cache.get(_history_key(node_id)) or []) for node_id in samples}
            models = _model_figures(
                samples, {node_id: points[-1] if points else None for node_id, points in stored.items()}
            )
            for node_id, sample in samples.items():
                points = stored[node_id]
                points.append(_history_point(sample, models.get(node_id)))
                cache.set(_history_key(node_id), points[-HISTORY_POINTS:], timeout=HISTORY_SECONDS)
            return
        quiet = [node_id for node_id, sample in samples.items() if not sample.get("shards")]
        last: dict[int, dict[str, Any] | None] = {}
        if quiet:
            pipe = store.pipeline(transaction=False)
            for node_id in quiet:
                pipe.lindex(_history_key(node_id), -1)
            last = {
                node_id: json.loads(raw) if raw else None for node_id, raw in zip(quiet, pipe.execute(), strict=True)
            }
        models = _model_figures(samples, last)
        pipe = store.pipeline(transaction=False)
        for node_id, sample in samples.items():
            key = _history_key(node_id)
            pipe.rpush(key, json.dumps(_history_point(sample, models.get(node_id)), separators=(",", ":")))
            pipe.ltrim(key, -HISTORY_POINTS, -1)
            pipe.expire(key, HISTORY_SECONDS)
        pipe.execute()
    except Exception:  # the history is a convenience; a cache outage must not lose the heartbeats
        log.warning("could not keep the sample history of %s nodes", len(samples), exc_info=True)


def oldest_points(node_ids: Iterable[int]) -> dict[int, float]:
    """The time of each node's oldest point still kept, for the nodes that have one: one round trip."""
    ids = list(node_ids)
    if not ids:
        return {}
    found: dict[int, float] = {}
    try:
        store = client()
        if store is None:
            firsts = [(list(cache.get(_history_key(i)) or []) or [None])[0] for i in ids]
        else:
            pipe = store.pipeline(transaction=False)
            for node_id in ids:
                pipe.lindex(_history_key(node_id), 0)
            firsts = [json.loads(raw) if raw else None for raw in pipe.execute()]
    except Exception:
        log.warning("could not read the sample history of %s nodes", len(ids), exc_info=True)
        return {}
    for node_id, point in zip(ids, firsts, strict=True):
        t = point.get("t") if isinstance(point, dict) else None
        if isinstance(t, int | float) and not isinstance(t, bool):
            found[node_id] = float(t)
    return found


def sample_history(node_id: int) -> list[dict[str, Any]]:
    """Points of the last hour, oldest first."""
    key = _history_key(node_id)
    try:
        store = client()
        if store is not None:
            points = [json.loads(raw) for raw in store.lrange(key, 0, -1)]
        else:
            points = list(cache.get(key) or [])
    except Exception:
        log.warning("could not read the sample history of node %s", node_id, exc_info=True)
        return []
    cutoff = timezone.now().timestamp() - HISTORY_SECONDS
    return [p for p in points if (p.get("t") or 0) >= cutoff]


def recent_history(node_ids: Iterable[int], seconds: float) -> dict[int, list[dict[str, Any]]]:
    """Each node's points of the last `seconds` (at most its last RECENT_POINTS), oldest first:
    one round trip for them all. A node without history, or a cache that does not answer, gives []."""
    ids = list(node_ids)
    cutoff = timezone.now().timestamp() - seconds
    found: dict[int, list[dict[str, Any]]] = dict.fromkeys(ids, [])
    if not ids:
        return found
    try:
        store = client()
        if store is None:
            raw = {node_id: list(cache.get(_history_key(node_id)) or [])[-RECENT_POINTS:] for node_id in ids}
        else:
            pipe = store.pipeline(transaction=False)
            for node_id in ids:
                pipe.lrange(_history_key(node_id), -RECENT_POINTS, -1)
            raw = {
                node_id: [json.loads(item) for item in items]
                for node_id, items in zip(ids, pipe.execute(), strict=True)
            }
    except Exception:
        log.warning("could not read the recent history of %s nodes", len(ids), exc_info=True)
        return found
    for node_id, points in raw.items():
        found[node_id] = [p for p in points if isinstance(p, dict) and (p.get("t") or 0) >= cutoff]
    return found


def _history_key(node_id: int) -> str:
    return f"{settings.REDIS_PREFIX}:cluster:history:{node_id}"


def _history_point(sample: HeartbeatSample, models: dict[str, list[Any]] | None = None) -> dict[str, Any]:
    """One point of a node's hour. `models`, when the node's claims were read for it, is per model
    name: [cores claimed, memory bytes claimed, cores used, memory bytes used, requests queued],
    each None when unknown (a point without "models" knows none of them)."""
    total = sample.get("memory_total_bytes")
    used = sample.get("memory_used_bytes")
    load = sample.get("load")
    point = {
        "t": sample.get("taken_at") or timezone.now().timestamp(),
        "cpu": sample.get("cpu_utilization_pct"),
        "mem": (used / total * 100) if used is not None and total else None,
        "load": load[0] if load else None,
        "gpus": {
            str(g["index"]): [
                g.get("utilization_gpu_pct"),
                g.get("temperature_gpu_c"),
                g.get("power_draw_w"),
                _memory_pct(g),
            ]
            for g in sample.get("gpus") or []
            if g.get("parent") is None  # a slice's figures are its card's, or none of its own
        },
        "rapl": sample.get("cpu_package_power_w"),
    }
    if models is not None:
        point["models"] = models
    return point


def _memory_pct(gpu: GpuFigures) -> float | None:
    used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
    return (used / total * 100) if used is not None and total else None


def _figure(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _total(values: list[float | None]) -> float | None:
    """The sum, or None when one of the parts is unknown."""
    return None if not values or None in values else sum(v or 0.0 for v in values)


def _model_figures(
    samples: dict[int, HeartbeatSample], last: dict[int, dict[str, Any] | None]
) -> dict[int, dict[str, list[Any]]]:
    """Per node and model: what its shards there claim, what their engines use (from the sample),
    and the model's queue. Read for the nodes whose sample lists running engines, or whose `last`
    point found claims (a failed engine's claim is held until its replica is replaced): a heartbeat
    from a node that runs nothing costs no query."""
    from apps.cluster.inventory import CLAIMING_STATES

    ask = [
        node_id
        for node_id, sample in samples.items()
        if sample.get("shards") or (last.get(node_id) or {}).get("models")
    ]
    if not ask:
        return {}
    try:
        # In a savepoint: a registration calls this inside its transaction, which a failed read
        # must not take down with it.
        with transaction.atomic():
            rows = list(
                Shard.objects.filter(node_id__in=ask, replica__state__in=CLAIMING_STATES).values_list(
                    "node_id", "replica_id", "rank", "replica__model__name", "cpu_cores", "memory_bytes"
                )
            )
    except Exception:
        log.warning("could not read the claims of %s nodes for their history", len(ask), exc_info=True)
        return {}
    parts: dict[int, dict[str, list[tuple[float, int, float | None, float | None]]]] = {}
    for node_id, replica_id, rank, model, cores, memory in rows:
        entries = {str(e.get("shard")): e for e in samples[node_id].get("shards") or [] if isinstance(e, dict)}
        entry = entries.get(f"r{replica_id}s{rank}")
        used_cores = _figure(entry.get("cpu_cores")) if entry is not None else None
        used_memory = _figure(entry.get("memory_bytes")) if entry is not None else None
        parts.setdefault(node_id, {}).setdefault(model, []).append((float(cores), int(memory), used_cores, used_memory))
    queues = EXTENSIONS.waiting({model for by_model in parts.values() for model in by_model})
    figures: dict[int, dict[str, list[Any]]] = {node_id: {} for node_id in ask}
    for node_id, by_model in parts.items():
        for model, shards in by_model.items():
            memory_used = _total([s[3] for s in shards])
            figures[node_id][model] = [
                sum(s[0] for s in shards),
                sum(s[1] for s in shards),
                _total([s[2] for s in shards]),
                int(memory_used) if memory_used is not None else None,
                queues.get(model),
            ]
    return figures
