"""Latency sketches kept in usage rollups: log-spaced buckets with a bounded relative error.

A sketch (the DDSketch idea) counts a value v > 0 in the bucket i = ⌈log_γ v⌉, which holds the
values in (γ^(i-1), γ^i], with γ = (1 + α) / (1 - α) for a relative accuracy α of 1 %. A bucket
answers 2γ^i / (γ + 1), which is within α of every value it holds. Buckets keep the order of
their values, so the bucket that holds the k-th smallest value answers within 1 % of it: every
quantile read from a sketch is within 1 % of the exact quantile of the values counted, however
many there were, and one request's p50 and p99 are its own time. Zero (and anything not above
zero) is counted apart and answers 0; values above MAX_MS are counted as MAX_MS.

Quantiles are nearest-rank: the q-quantile of n values is the k-th smallest, k = ⌈q·n⌉ and at
least 1 (`nearest_rank`). No value is invented between two that were measured.

A sketch is stored as JSON, sparse, with only the buckets that hold something:

    {"v": 1, "zero": 0, "bins": {"<bucket index>": count, ...}}

Times from 0.01 ms to 10 minutes span 888 buckets; a sketch never keeps more than MAX_BINS
(beyond that its lowest buckets are folded into the next one up, which keeps the count and
the accuracy of the upper quantiles). Sketches add up bucket by bucket, so minute rollups
merge into hours, hours into days and keys into teams, and a merged sketch is the very
sketch that counting all the values at once would have made (short of MAX_BINS buckets,
which real times never come near).

Rollups written before sketches hold a list of 13 counts, one per bucket of LEGACY_BOUNDS_MS
(bucket i: LEGACY_BOUNDS_MS[i-1] < v <= LEGACY_BOUNDS_MS[i], the first from 0, the last open).
They are read as what they said: c values in a bucket are c values spread evenly through it
(the middles of c equal slices), and values in the open last bucket are 60 s ("at least a
minute"). Their figures are only as close as those buckets were. A writer that adds into
such a row stores it as a sketch from then on.

Pure code: no Django, no database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = [
    "ALPHA",
    "GAMMA",
    "LEGACY_BOUNDS_MS",
    "MAX_BINS",
    "MAX_MS",
    "Sketch",
    "bucket_index",
    "bucket_value",
    "count",
    "empty",
    "load",
    "merge",
    "merge_all",
    "merge_into",
    "nearest_rank",
    "observe",
    "percentile",
]

Sketch = dict[str, Any]

ALPHA = 0.01  # relative accuracy of every quantile
GAMMA = (1 + ALPHA) / (1 - ALPHA)
_LN_GAMMA = math.log(GAMMA)
_ANSWER = 2 / (GAMMA + 1)  # a bucket answers γ^i times this
FORMAT = 1
MAX_BINS = 2048
MAX_MS = 1e15  # about 31,700 years; anything above is nonsense counted here rather than overflowing

LEGACY_BOUNDS_MS: tuple[float, ...] = (
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
    10000.0,
    30000.0,
    60000.0,
    math.inf,
)


def empty() -> Sketch:
    """A sketch with no observations."""
    return {"v": FORMAT, "zero": 0, "bins": {}}


def bucket_index(value: float) -> int:
    """The bucket that counts `value` (> 0): ⌈log_γ value⌉."""
    return math.ceil(math.log(value) / _LN_GAMMA)


def bucket_value(index: int) -> float:
    """What bucket `index` answers: 2γ^index / (γ + 1), within α of everything it holds."""
    return math.exp(index * _LN_GAMMA) * _ANSWER


def _add(sketch: Sketch, index: int, times: int) -> None:
    bins = sketch["bins"]
    key = str(index)
    bins[key] = bins.get(key, 0) + times


def _add_value(sketch: Sketch, value: float, times: int = 1) -> None:
    if not value > 0:  # zero, and NaN (callers leave unknown values out before)
        sketch["zero"] += times
        return
    _add(sketch, bucket_index(min(value, MAX_MS)), times)


def _bound(sketch: Sketch) -> Sketch:
    """Fold the lowest buckets into the next one up until at most MAX_BINS are left."""
    bins = sketch["bins"]
    if len(bins) > MAX_BINS:
        order = sorted(bins, key=int)
        folded = sum(bins.pop(key) for key in order[: len(order) - MAX_BINS])
        bins[order[len(order) - MAX_BINS]] += folded
    return sketch


def observe(sketch: Sketch, value: float | None) -> Sketch:
    """Count one value (milliseconds) into `sketch`, in place; None (unknown) is not counted.

    Returns the same sketch for chaining.
    """
    if value is None:
        return sketch
    _add_value(sketch, float(value))
    return _bound(sketch)


def _whole(value: Any) -> int:
    """A stored count as a non-negative int; anything else counts nothing."""
    if isinstance(value, bool):
        return 0
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return max(number, 0)


def _add_legacy(sketch: Sketch, counts: list[Any]) -> None:
    """Add a fixed-bucket histogram: c values of bucket (lower, upper] at the middles of c equal slices of it."""
    for position, raw in enumerate(counts[: len(LEGACY_BOUNDS_MS)]):
        times = _whole(raw)
        if not times:
            continue
        lower = LEGACY_BOUNDS_MS[position - 1] if position else 0.0
        upper = LEGACY_BOUNDS_MS[position]
        if math.isinf(upper):
            _add_value(sketch, lower, times)  # "at least a minute", as it was read
            continue
        width = upper - lower
        first = bucket_index(lower + width * 0.5 / times)
        last = bucket_index(lower + width * (times - 0.5) / times)
        placed = 0
        for index in range(first, last):
            # How many of the values lower + width·(k - ½)/times, k = 1..times, are at most γ^index.
            up_to = min(times, max(0, math.floor((math.exp(index * _LN_GAMMA) - lower) * times / width + 0.5)))
            if up_to > placed:
                _add(sketch, index, up_to - placed)
                placed = up_to
        _add(sketch, last, times - placed)


def merge_into(sketch: Sketch, *stored: Any) -> Sketch:
    """Add the counts of stored sketches (or old fixed-bucket lists, or None) into `sketch`, in place."""
    for other in stored:
        if isinstance(other, list):
            _add_legacy(sketch, other)
        elif isinstance(other, dict) and other.get("v", FORMAT) == FORMAT:  # {} is the model's default
            sketch["zero"] += _whole(other.get("zero"))
            bins = other.get("bins")
            for key, raw in bins.items() if isinstance(bins, dict) else ():
                times = _whole(raw)
                try:
                    index = int(key)
                except (TypeError, ValueError):
                    continue
                if times:
                    _add(sketch, index, times)
    return _bound(sketch)


def load(stored: Any) -> Sketch:
    """A sketch from what a rollup holds: a sketch, an old fixed-bucket list, or nothing (None, [], {})."""
    return merge_into(empty(), stored)


def merge(*stored: Any) -> Sketch:
    """A new sketch with the counts of all the given ones (sketches, old lists or None) added up."""
    return merge_into(empty(), *stored)


def merge_all(stored: Iterable[Any]) -> Sketch:
    return merge_into(empty(), *stored)


def count(stored: Any) -> int:
    """How many values a stored sketch (or old list) holds."""
    sketch = load(stored)
    return int(sketch["zero"] + sum(sketch["bins"].values()))


def nearest_rank(q: float, total: int) -> int:
    """The rank (1-based) of the q-quantile of `total` values: ⌈q·total⌉, at least 1.

    q·total is rounded to 9 decimals first, so that 0.07 × 100 is rank 7, not 8.
    """
    return min(total, max(1, math.ceil(round(q * total, 9))))


def percentile(stored: Any, q: float) -> float | None:
    """The q-quantile (0 <= q <= 1, so 0.95 for p95) in milliseconds; None when nothing was observed.

    Nearest-rank, within ALPHA (1 %) of the exact value for anything counted into a sketch.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q!r} is outside 0..1")
    sketch = load(stored)
    seen = sketch["zero"]
    total = seen + sum(sketch["bins"].values())
    if total <= 0:
        return None
    rank = nearest_rank(q, total)
    if seen >= rank:
        return 0.0
    for index, times in sorted((int(key), times) for key, times in sketch["bins"].items()):
        seen += times
        if seen >= rank:
            return bucket_value(index)
    return None  # unreachable: the counts add up to total
