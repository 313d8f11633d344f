"""Latency sketches: pure functions, no database.

The exact quantile the sketch is held to is nearest-rank, computed here on its own: the
q-quantile of n values is the k-th smallest, k = ⌈q·n⌉ (at least 1), with q·n worked out in
exact fractions so that 0.95 × 20 is 19, not a float a hair either side.
"""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.quotas import histograms
from apps.quotas.histograms import ALPHA, MAX_BINS, count, empty, load, merge, nearest_rank, observe, percentile
from tests.budget import examples

QUANTILES = ("0", "0.01", "0.07", "0.25", "0.5", "0.9", "0.95", "0.99", "0.999", "1")
SHORTEST_MS, LONGEST_MS = 0.01, 10 * 60 * 1000.0


def sketch_of(*values: float) -> histograms.Sketch:
    sketch = empty()
    for value in values:
        observe(sketch, value)
    return sketch


def exact(values: list[float], q: str) -> float:
    ordered = sorted(values)
    rank = max(1, math.ceil(Fraction(q) * len(ordered)))
    return ordered[rank - 1]


def assert_close(read: float | None, wanted: float) -> None:
    """Within the sketch's 1 % (the float rounding at a bucket's edge aside); the promise is 2 %."""
    assert read is not None
    assert abs(read - wanted) <= wanted * ALPHA * (1 + 1e-9), (read, wanted)


def assert_quantiles_close(values: list[float]) -> None:
    sketch = sketch_of(*values)
    stored = json.loads(json.dumps(sketch))  # as a rollup keeps it
    for q in QUANTILES:
        assert_close(percentile(stored, float(q)), exact(values, q))


def draw(distribution: str, size: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    makers = {
        "log-uniform": lambda: math.exp(rng.uniform(math.log(SHORTEST_MS), math.log(LONGEST_MS))),
        "uniform": lambda: rng.uniform(SHORTEST_MS, LONGEST_MS),
        "exponential": lambda: rng.expovariate(1 / 800),
        "lognormal": lambda: rng.lognormvariate(math.log(300), 1.5),
        "pareto": lambda: 20 * rng.paretovariate(1.2),
        "bimodal": lambda: rng.gauss(40, 5) if rng.random() < 0.9 else rng.gauss(30_000, 4_000),
        "few values": lambda: rng.choice((0.36, 12.5, 30_000.0)),
    }
    return [min(LONGEST_MS, max(SHORTEST_MS, makers[distribution]())) for _ in range(size)]


times = st.floats(min_value=SHORTEST_MS, max_value=LONGEST_MS, allow_nan=False, allow_infinity=False)


# Accuracy ---------------------------------------------------------------------------------------------


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(times, min_size=1, max_size=400))
def test_every_quantile_is_within_one_percent_of_the_exact_one(values: list[float]) -> None:
    assert_quantiles_close(values)


@settings(max_examples=examples(120), deadline=None)
@given(
    st.sampled_from(["log-uniform", "uniform", "exponential", "lognormal", "pareto", "bimodal", "few values"]),
    st.integers(min_value=1, max_value=3000),
    st.integers(min_value=0, max_value=2**32),
)
def test_quantiles_of_drawn_distributions_are_within_one_percent(distribution: str, size: int, seed: int) -> None:
    assert_quantiles_close(draw(distribution, size, seed))


@pytest.mark.parametrize("value", [30_000.0, 30_000.4, 0.36, SHORTEST_MS, LONGEST_MS, 1.0])
def test_one_request_reads_as_itself_at_every_percentile(value: float) -> None:
    sketch = sketch_of(value)
    for q in (0.0, 0.5, 0.95, 0.99, 1.0):
        assert_close(percentile(sketch, q), value)
    assert abs(percentile(sketch, 0.5) - value) <= value * 0.02  # the promise


def test_a_single_30_s_request_is_30_s_at_p50_and_p99() -> None:
    sketch = sketch_of(30_000.0)
    assert percentile(sketch, 0.5) == pytest.approx(30_000.0, rel=0.02)
    assert percentile(sketch, 0.99) == pytest.approx(30_000.0, rel=0.02)
    assert percentile(sketch, 0.5) == percentile(sketch, 0.99)


def test_the_rank_is_nearest_rank() -> None:
    assert [nearest_rank(q, 1) for q in (0.0, 0.5, 0.99, 1.0)] == [1, 1, 1, 1]
    assert (nearest_rank(0.95, 20), nearest_rank(0.07, 100), nearest_rank(0.5, 4), nearest_rank(0.5, 5)) == (
        19,
        7,
        2,
        3,
    )
    for n in range(1, 300):
        for q in QUANTILES:
            assert nearest_rank(float(q), n) == max(1, math.ceil(Fraction(q) * n))


def test_the_median_of_an_even_count_is_the_lower_middle_value() -> None:
    assert_close(percentile(sketch_of(5, 15, 30, 200), 0.5), 15)
    assert_close(percentile(sketch_of(5, 15, 30, 200), 0.95), 200)


# Edges ------------------------------------------------------------------------------------------------


def test_unknown_is_not_counted_and_nothing_has_no_percentiles() -> None:
    assert observe(empty(), None) == empty()
    assert percentile(empty(), 0.5) is None
    assert percentile([], 0.99) is None
    assert percentile(None, 0.95) is None
    assert percentile({}, 0.5) is None  # the rollup's default


def test_zero_is_counted_apart_and_reads_as_zero() -> None:
    sketch = sketch_of(0, 0, 0, 40)
    assert sketch["zero"] == 3 and count(sketch) == 4
    assert percentile(sketch, 0.5) == 0.0
    assert_close(percentile(sketch, 1.0), 40)


def test_nonsense_times_neither_overflow_nor_crash() -> None:
    sketch = sketch_of(1e300, 5e-324)
    assert count(sketch) == 2
    assert percentile(sketch, 1.0) == pytest.approx(histograms.MAX_MS, rel=ALPHA)
    assert math.isfinite(percentile(sketch, 0.0))


def test_a_sketch_never_keeps_more_than_max_bins_and_keeps_its_count() -> None:
    values = [1.0001**-i * 1e-3 for i in range(0, 3000 * 250, 250)] + [900.0] * 10  # 3000 buckets apart
    sketch = sketch_of(*values)
    assert len(sketch["bins"]) <= MAX_BINS
    assert count(sketch) == len(values)
    assert_close(percentile(sketch, 1.0), 900.0)  # the upper quantiles keep their accuracy


def test_a_quantile_outside_0_to_1_is_a_mistake() -> None:
    with pytest.raises(ValueError):
        percentile(sketch_of(1), 95)


def test_stored_garbage_reads_as_nothing_rather_than_failing() -> None:
    for stored in (
        "x",
        3,
        {"v": 1, "zero": "a", "bins": {"x": 1, "4": "y", "5": -2}},
        {"v": 99, "bins": {"1": 5}},
        [None, "a", True, -4],
    ):
        assert percentile(stored, 0.5) is None


# Merging ----------------------------------------------------------------------------------------------


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(times, min_size=1, max_size=300), st.lists(st.integers(min_value=0, max_value=300), max_size=6))
def test_sketches_built_in_pieces_merge_into_the_sketch_built_whole(values: list[float], cuts: list[int]) -> None:
    edges = sorted({0, len(values), *(min(cut, len(values)) for cut in cuts)})
    pieces = [json.loads(json.dumps(sketch_of(*values[a:b]))) for a, b in zip(edges, edges[1:], strict=False)]
    whole = sketch_of(*values)
    assert merge(*pieces) == whole
    assert merge(*reversed(pieces)) == whole
    assert histograms.merge_all(pieces) == whole
    assert merge(whole, None, []) == whole
    for q in QUANTILES:
        assert percentile(merge(*pieces), float(q)) == percentile(whole, float(q))


def test_merge_leaves_its_inputs_alone() -> None:
    a, b = sketch_of(5, 30), sketch_of(30, 2000)
    merged = merge(a, b)
    assert count(merged) == 4
    assert a == sketch_of(5, 30) and b == sketch_of(30, 2000)
    histograms.merge_into(a, b)
    assert a == merged


# Rollups written before sketches ---------------------------------------------------------------------


def legacy(**counts: int) -> list[int]:
    """An old 13-bucket histogram: legacy(b10=2) is two values in (0, 10 ms]."""
    hist = [0] * len(histograms.LEGACY_BOUNDS_MS)
    for name, times in counts.items():
        bound = math.inf if name == "open" else float(name[1:])
        hist[histograms.LEGACY_BOUNDS_MS.index(bound)] += times
    return hist


def test_an_old_bucket_reads_as_its_values_spread_through_it() -> None:
    one = legacy(b60000=1)  # one value in (30 s, 60 s]: its middle, as the old reading put it
    assert_close(percentile(one, 0.5), 45_000.0)
    assert_close(percentile(one, 0.99), 45_000.0)
    thousand = legacy(b30000=1000)  # (10 s, 30 s]: the middles of a thousand equal slices
    spread = [10_000 + 20_000 * (k - 0.5) / 1000 for k in range(1, 1001)]
    for q in QUANTILES:
        assert_close(percentile(thousand, float(q)), exact(spread, q))
    assert count(thousand) == 1000


def test_an_old_open_bucket_reads_as_a_minute() -> None:
    assert_close(percentile(legacy(open=3), 0.5), 60_000.0)


def test_old_lists_keep_their_counts_even_when_huge_and_short() -> None:
    assert count(legacy(b10=10**9, open=5)) == 10**9 + 5
    assert count([1]) == 1  # a short list from an even older writer
    assert_close(percentile([1], 0.5), 5.0)


def test_an_old_list_merges_with_a_sketch() -> None:
    merged = merge(legacy(b25=1, b250=1), sketch_of(40.0, 3000.0))
    assert count(merged) == 4
    assert_close(percentile(merged, 0.0), 17.5)  # the middle of (10, 25]
    assert_close(percentile(merged, 1.0), 3000.0)
    assert load(legacy()) == empty()
