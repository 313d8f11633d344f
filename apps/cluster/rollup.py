"""Fleet figures kept as heartbeats are written, so that the cluster page reads a few keys
instead of every node's hour of history and every node's sample.

Two things are kept, in Redis when one is configured (shared by every web process) or in the
local cache without it:

- per node, the cards that rest now (under IDLE_BELOW_PCT busy) and since when each has rested
  without a break. A run begins at the first sample that found the card resting; a sample that
  finds it busy, or without a figure, ends it, and so does a gap of more than GAP_SECONDS
  between two samples (what the card did meanwhile is unknown). A run that was already going
  when the node's first sample was kept here is marked open: it began at least that long ago.
  The key expires with the history, so a node that went away is forgotten.
- per GPU class and CHART_BUCKET_SECONDS slot, the sum and count of the cards' utilisation:
  the class's average over the hour is one small read per slot.

A sample older than the one already kept for its node (a late batch) changes nothing.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from django.conf import settings
from django.core.cache import cache

from agent.messages import HeartbeatSample

__all__ = [
    "CHART_BUCKET_SECONDS",
    "GAP_SECONDS",
    "IDLE_BELOW_PCT",
    "Resting",
    "class_series",
    "mask_of",
    "record",
    "resting",
]

log = logging.getLogger(__name__)

IDLE_BELOW_PCT = 5.0
CHART_BUCKET_SECONDS = 30
GAP_SECONDS = 300.0
KEEP_SECONDS = 3600 + 2 * CHART_BUCKET_SECONDS
FRESH_SECONDS = 60.0  # as Node.fresh_sample: an older state does not stand for now


class Resting(NamedTuple):
    """What the rollup knows of one node now: when its last sample was kept (server time), its time
    (the sample's own), and the runs of its resting cards: (since, open, mask of card indices),
    the cards that began to rest together in one run (most often all of them)."""

    seen: float
    t: float
    runs: Sequence[Sequence[Any]]

    @property
    def cards(self) -> dict[int, tuple[float, bool]]:
        """{card index: (resting since, open)} of every resting card."""
        return {i: (run[0], bool(run[1])) for run in self.runs for i in range(run[2].bit_length()) if run[2] >> i & 1}

    def span(self, mask: int) -> tuple[float, bool] | None:
        """Since when every card of `mask` has rested (the latest of their runs' starts), and whether
        that run is open; None when one of them does not rest. A run whose start is unknown (NaN)
        makes the span's start unknown too."""
        covered, since, is_open, unknown = 0, -math.inf, False, False
        for start, run_open, run_mask in self.runs:
            if run_mask & mask:
                covered |= run_mask
                if math.isnan(start):
                    unknown = True
                elif start > since:
                    since, is_open = start, bool(run_open)
                elif start == since:
                    is_open = is_open or bool(run_open)
        if covered & mask != mask:
            return None
        return (math.nan, False) if unknown else (since, is_open)


def mask_of(indices: Iterable[int]) -> int:
    mask = 0
    for index in indices:
        mask |= 1 << index
    return mask


def _node_key(node_id: int) -> str:
    return f"{settings.REDIS_PREFIX}:cluster:rollup:node:{node_id}"


def _slot_key(slot: int) -> str:
    return f"{settings.REDIS_PREFIX}:cluster:rollup:util:{slot}"


def _figure(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        return None
    return float(value)


def _decode(raw: Any) -> Resting | None:
    if raw is None:
        return None
    try:
        # Written by _encode alone, and read as it is: this is every node, on every look at the page.
        seen, t, runs = json.loads(raw) if isinstance(raw, bytes | str) else raw
        return Resting(seen, t, runs) if isinstance(runs, list) else None
    except (TypeError, ValueError):
        return None


def _encode(state: Resting) -> str:
    runs = [[round(since, 3), 1 if is_open else 0, mask] for since, is_open, mask in state.runs]
    return json.dumps([round(state.seen, 3), round(state.t, 3), runs], separators=(",", ":"))


def _step(previous: Resting | None, sample: HeartbeatSample, t: float, seen: float) -> Resting | None:
    """The node's state after this sample, or None when the sample is older than what is kept."""
    if previous is not None and t < previous.t:
        return None
    before = previous.cards if previous is not None and t - previous.t <= GAP_SECONDS else {}
    runs: dict[tuple[float, bool], int] = defaultdict(int)
    for gpu in sample.get("gpus") or []:
        if not isinstance(gpu, dict):
            continue
        index = gpu.get("index")
        util = _figure(gpu.get("utilization_gpu_pct"))
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 1024:
            continue
        if util is None or util >= IDLE_BELOW_PCT:
            continue
        # A card resting already at the node's first sample here may have rested for long: an open run.
        run = before.get(index) or (t, previous is None)
        runs[run] |= 1 << index
    return Resting(seen=seen, t=t, runs=[(since, is_open, mask) for (since, is_open), mask in sorted(runs.items())])


def _classes(sample: HeartbeatSample) -> Iterable[tuple[str, float]]:
    for gpu in sample.get("gpus") or []:
        if isinstance(gpu, dict):
            util = _figure(gpu.get("utilization_gpu_pct"))
            if util is not None:
                yield str(gpu.get("gpu_class") or gpu.get("name") or "?"), util


def record(samples: dict[int, HeartbeatSample], client: Any = None) -> None:
    """Fold a batch of samples ({node id: sample}) into the rollup: one read and one write."""
    if not samples:
        return
    now = time.time()
    times = {node_id: _figure(sample.get("taken_at")) or now for node_id, sample in samples.items()}
    sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for node_id, sample in samples.items():
        slot = int(times[node_id] // CHART_BUCKET_SECONDS)
        for gpu_class, util in _classes(sample):
            figures = sums[slot][gpu_class]
            figures[0] += util
            figures[1] += 1
    ids = list(samples)
    if client is None:
        previous = cache.get_many([_node_key(i) for i in ids])
        states = {}
        for node_id in ids:
            state = _step(_decode(previous.get(_node_key(node_id))), samples[node_id], times[node_id], now)
            if state is not None:
                states[_node_key(node_id)] = _encode(state)
        cache.set_many(states, timeout=KEEP_SECONDS)
        for slot, classes in sums.items():
            kept = dict(cache.get(_slot_key(slot)) or {})
            for gpu_class, (total, count) in classes.items():
                old = kept.get(gpu_class, (0.0, 0.0))
                kept[gpu_class] = (old[0] + total, old[1] + count)
            cache.set(_slot_key(slot), kept, timeout=KEEP_SECONDS)
        return
    raw = client.mget([_node_key(i) for i in ids])
    pipe = client.pipeline(transaction=False)
    for node_id, before in zip(ids, raw, strict=True):
        state = _step(_decode(before), samples[node_id], times[node_id], now)
        if state is not None:
            pipe.set(_node_key(node_id), _encode(state), ex=KEEP_SECONDS)
    for slot, classes in sums.items():
        key = _slot_key(slot)
        for gpu_class, (total, count) in classes.items():
            pipe.hincrbyfloat(key, f"{gpu_class}\x1fs", total)
            pipe.hincrby(key, f"{gpu_class}\x1fn", int(count))
        pipe.expire(key, KEEP_SECONDS)
    pipe.execute()


def resting(node_ids: Iterable[int], client: Any = None, now: float | None = None) -> dict[int, Resting]:
    """The fresh state of each node that has one: one read for them all. A node whose last sample
    was kept more than FRESH_SECONDS ago is left out (its cards' figures are unknown now)."""
    ids = list(node_ids)
    if not ids:
        return {}
    now = now or time.time()
    if client is None:
        found = cache.get_many([_node_key(i) for i in ids])
        raw = [found.get(_node_key(i)) for i in ids]
    else:
        raw = client.mget([_node_key(i) for i in ids])
    states = {}
    for node_id, value in zip(ids, raw, strict=True):
        state = _decode(value)
        if state is not None and now - state.seen <= FRESH_SECONDS:
            states[node_id] = state
    return states


def class_series(client: Any = None, now: float | None = None) -> dict[str, list[tuple[float, float]]]:
    """Each GPU class's average utilisation per slot over the last hour, oldest first."""
    now = now or time.time()
    last = int(now // CHART_BUCKET_SECONDS)
    slots = list(range(last - 3600 // CHART_BUCKET_SECONDS, last + 1))
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    if client is None:
        found = cache.get_many([_slot_key(s) for s in slots])
        for slot in slots:
            for gpu_class, (total, count) in (found.get(_slot_key(slot)) or {}).items():
                if count:
                    series[gpu_class].append((slot * CHART_BUCKET_SECONDS, total / count))
        return dict(series)
    pipe = client.pipeline(transaction=False)
    for slot in slots:
        pipe.hgetall(_slot_key(slot))
    for slot, fields in zip(slots, pipe.execute(), strict=True):
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, value in fields.items():
            gpu_class, _sep, kind = name.decode().rpartition("\x1f")
            totals[gpu_class][0 if kind == "s" else 1] = float(value)
        for gpu_class, (total, count) in totals.items():
            if count:
                series[gpu_class].append((slot * CHART_BUCKET_SECONDS, total / count))
    return dict(series)
