"""Fixed-bucket latency histograms, kept as plain lists of counts in usage rollups.

Every histogram has one count per bucket in BOUNDS_MS: bucket i holds the values v with
BOUNDS_MS[i-1] < v <= BOUNDS_MS[i] (the first bucket starts at 0, the last one has no
upper end). Lists of counts add up bucket by bucket, so minute rollups merge into hours,
hours into days and keys into teams without losing anything the buckets kept.

A percentile is read by walking the counts to the bucket that holds the wanted rank and
interpolating linearly inside it. Its error is bounded by the bucket's width; values in
the open last bucket are reported as its lower bound (60 s: "at least a minute").

Pure code: no Django, no database.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["BOUNDS_MS", "empty", "merge", "merge_all", "observe", "percentile"]

BOUNDS_MS: tuple[float, ...] = (
    10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0, 60000.0, math.inf,
)


def empty() -> list[int]:
    """A histogram with no observations."""
    return [0] * len(BOUNDS_MS)


def _bucket(value: float) -> int:
    for index, bound in enumerate(BOUNDS_MS):
        if value <= bound:
            return index
    return len(BOUNDS_MS) - 1  # NaN lands here too; callers skip unknown values before


def observe(hist: list[int], value: float | None) -> list[int]:
    """Count one value (milliseconds) into `hist`, in place; None (unknown) is not counted.

    A list shorter than the bucket count (an older rollup, or []) is padded first.
    Returns the same list for chaining.
    """
    if value is None:
        return hist
    if len(hist) < len(BOUNDS_MS):
        hist.extend([0] * (len(BOUNDS_MS) - len(hist)))
    hist[_bucket(max(0.0, float(value)))] += 1
    return hist


def merge(*hists: Sequence[int] | None) -> list[int]:
    """A new histogram with the counts of all the given ones added bucket by bucket."""
    total = empty()
    for hist in hists:
        for index, count in enumerate(hist or ()):
            if index < len(total):
                total[index] += int(count)
    return total


def merge_all(hists: Iterable[Sequence[int] | None]) -> list[int]:
    return merge(*hists)


def percentile(hist: Sequence[int] | None, q: float) -> float | None:
    """The q-quantile (0 <= q <= 1, so 0.95 for p95) in milliseconds; None when nothing was observed.

    Linear interpolation inside the bucket that holds rank q × count; the open last bucket
    answers its lower bound.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q!r} is outside 0..1")
    counts = [int(c) for c in (hist or ())][: len(BOUNDS_MS)]
    total = sum(counts)
    if total <= 0:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(counts):
        if count <= 0:
            continue
        lower = BOUNDS_MS[index - 1] if index else 0.0
        upper = BOUNDS_MS[index]
        if seen + count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * max(0.0, rank - seen) / count
        seen += count
    return None  # unreachable: the last non-empty bucket always reaches the rank
