"""The last hour of each model's engine figures, for the charts on its card.

Agents send each engine's own figures with their heartbeats (agent.engine_metrics: requests
running and waiting, KV-cache use, token and prefix-cache counters, time to first token and per
output token as sums and counts). `record()` keeps them per model outside the database, as the
node history is kept: a capped Redis list per model (one round trip for a whole batch of
heartbeats), or the local cache without Redis. `model_charts()` turns them into one-minute
buckets: gauges added up over the replicas (the KV cache averaged), counters turned into rates
from one heartbeat to the next. A counter that went down (the engine restarted) gives no rate
for that step rather than a negative one; a minute no engine reported is a gap, never 0.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import cache
from django.utils import timezone
from django.utils.safestring import SafeString
from django.utils.translation import gettext as _

from agent.messages import HeartbeatSample
from llmgw.console.charts import line_chart

__all__ = ["BUCKET_SECONDS", "EngineChart", "model_charts", "model_points", "record"]

log = logging.getLogger(__name__)

HISTORY_SECONDS = 3600
#: Points kept per model: an hour of 10-second heartbeats for 50 replicas. A model with more
#: replicas charts a shorter span.
HISTORY_POINTS = 18_000
BUCKET_SECONDS = 60
#: Two heartbeats further apart than this give no rate between them (the agent was away).
MAX_STEP_SECONDS = 90

_SHARD = re.compile(r"^r(\d+)s(\d+)$")


def _key(model: str) -> str:
    return f"{settings.REDIS_PREFIX}:cluster:engine-history:{model}"


def record(samples: dict[int, HeartbeatSample]) -> None:
    """Keep the engine figures of these heartbeats (node id -> sample), per model."""
    found: list[tuple[int, float, dict[str, Any]]] = []
    for sample in samples.values():
        taken = sample.get("taken_at")
        t = float(taken) if isinstance(taken, int | float) else timezone.now().timestamp()
        for entry in sample.get("shards") or []:
            if not isinstance(entry, dict) or not isinstance(entry.get("engine"), dict) or not entry["engine"]:
                continue
            match = _SHARD.match(str(entry.get("shard", "")))
            if match is not None:
                found.append((int(match.group(1)), t, entry["engine"]))
    if not found:
        return
    from apps.cluster import history
    from apps.cluster.models import Replica

    try:
        names = dict(Replica.objects.filter(pk__in={r for r, _t, _f in found}).values_list("pk", "model__name"))
        by_model: dict[str, list[str]] = defaultdict(list)
        for replica, t, figures in found:
            if replica in names:
                point = {"t": t, "r": replica, "f": figures}
                by_model[names[replica]].append(json.dumps(point, separators=(",", ":")))
        client = history.client()
        if client is None:
            for model, points in by_model.items():
                stored = list(cache.get(_key(model)) or [])
                stored.extend(json.loads(p) for p in points)
                cache.set(_key(model), stored[-HISTORY_POINTS:], timeout=HISTORY_SECONDS)
            return
        pipe = client.pipeline(transaction=False)
        for model, points in by_model.items():
            pipe.rpush(_key(model), *points)
            pipe.ltrim(_key(model), -HISTORY_POINTS, -1)
            pipe.expire(_key(model), HISTORY_SECONDS)
        pipe.execute()
    except Exception:  # a convenience for the charts: a cache outage must not lose the heartbeats
        log.warning("could not keep the engine figures of %s replicas", len(found), exc_info=True)


def model_points(model: str) -> list[dict[str, Any]]:
    """The model's points of the last hour, oldest first: {"t", "r" (replica id), "f" (figures)}."""
    from apps.cluster import history

    try:
        client = history.client()
        if client is not None:
            points = [json.loads(raw) for raw in client.lrange(_key(model), 0, -1)]
        else:
            points = list(cache.get(_key(model)) or [])
    except Exception:
        log.warning("could not read the engine figures of model %s", model, exc_info=True)
        return []
    cutoff = timezone.now().timestamp() - HISTORY_SECONDS
    return sorted(
        (p for p in points if isinstance(p, dict) and isinstance(p.get("t"), int | float) and p["t"] >= cutoff),
        key=lambda p: p["t"],
    )


def _number(figures: dict[str, Any], key: str) -> float | None:
    value = figures.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass
class _Bucket:
    gauges: dict[str, dict[int, float]]  # figure -> replica -> its last value in the minute
    deltas: dict[str, dict[int, float]]  # counter -> replica -> its increase over the minute's steps
    seconds: dict[str, dict[int, float]]  # counter -> replica -> the seconds those steps covered


def buckets(points: list[dict[str, Any]]) -> dict[int, _Bucket]:
    """One-minute buckets (start, epoch seconds) of the points' gauges and counter increases."""
    out: dict[int, _Bucket] = {}
    last: dict[int, tuple[float, dict[str, Any]]] = {}
    counters = (
        "prompt_tokens",
        "generation_tokens",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "ttft_sum",
        "ttft_count",
        "tpot_sum",
        "tpot_count",
    )
    for point in points:
        t, replica, figures = float(point["t"]), point.get("r"), point.get("f")
        if not isinstance(replica, int) or not isinstance(figures, dict):
            continue
        start = int(t // BUCKET_SECONDS) * BUCKET_SECONDS
        bucket = out.setdefault(start, _Bucket(defaultdict(dict), defaultdict(dict), defaultdict(dict)))
        for key in ("requests_running", "requests_waiting", "kv_cache_usage_ratio"):
            value = _number(figures, key)
            if value is not None:
                bucket.gauges[key][replica] = value
        previous = last.get(replica)
        last[replica] = (t, figures)
        if previous is None or not 0 < t - previous[0] <= MAX_STEP_SECONDS:
            continue
        for key in counters:
            now, before = _number(figures, key), _number(previous[1], key)
            if now is None or before is None or now < before:
                continue
            deltas, seconds = bucket.deltas[key], bucket.seconds[key]
            deltas[replica] = deltas.get(replica, 0.0) + now - before
            seconds[replica] = seconds.get(replica, 0.0) + t - previous[0]
    return out


@dataclass(frozen=True)
class EngineChart:
    title: str
    svg: SafeString


def model_charts(model: str) -> list[EngineChart]:
    """The card's charts of the model's engines over the last hour; [] when none reported."""
    points = model_points(model)
    if not points:
        return []
    by_minute = sorted(buckets(points).items())

    def series(pick: Any) -> list[tuple[float, float | None]]:
        return [(float(start + BUCKET_SECONDS / 2), pick(bucket)) for start, bucket in by_minute]

    def total(key: str) -> Any:
        return lambda b: sum(b.gauges[key].values()) if b.gauges.get(key) else None

    def mean_percent(key: str) -> Any:
        return lambda b: sum(b.gauges[key].values()) / len(b.gauges[key]) * 100 if b.gauges.get(key) else None

    def rate(key: str) -> Any:
        # Per second across the replicas: each replica's increase over the seconds it covered, added up.
        def value(b: _Bucket) -> float | None:
            seconds = b.seconds.get(key)
            if not seconds:
                return None
            return sum(b.deltas[key][r] / s for r, s in seconds.items() if s > 0)

        return value

    def ratio(numerator: str, denominator: str, scale: float) -> Any:
        # Over the replicas that reported both: a mean per request or token, a share of lookups.
        def value(b: _Bucket) -> float | None:
            below, above = b.deltas.get(denominator) or {}, b.deltas.get(numerator) or {}
            both = [r for r in below if r in above]
            total = sum(below[r] for r in both)
            return sum(above[r] for r in both) / total * scale if total > 0 else None

        return value

    gap = BUCKET_SECONDS * 2

    def chart(title: str, values: list[tuple[float, float | None]], **kwargs: Any) -> EngineChart:
        return EngineChart(title, line_chart(values, label=title, gap_seconds=gap, **kwargs))

    return [
        chart(_("Requests running in the engines"), series(total("requests_running"))),
        chart(_("Requests waiting in the engines"), series(total("requests_waiting"))),
        chart(_("KV cache in use"), series(mean_percent("kv_cache_usage_ratio")), y_max=100, unit="%"),
        chart(_("Tokens generated per second"), series(rate("generation_tokens"))),
        chart(_("Time to first token (mean)"), series(ratio("ttft_sum", "ttft_count", 1000)), unit="ms"),
        chart(_("Time per output token (mean)"), series(ratio("tpot_sum", "tpot_count", 1000)), unit="ms"),
        chart(
            _("Prompt tokens found in the prefix cache"),
            series(ratio("prefix_cache_hits", "prefix_cache_queries", 100)),
            y_max=100,
            unit="%",
        ),
    ]
