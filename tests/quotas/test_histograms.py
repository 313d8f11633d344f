"""Latency histograms: pure functions, no database."""

from __future__ import annotations

import math

import pytest

from apps.quotas import histograms
from apps.quotas.histograms import BOUNDS_MS, empty, merge, observe, percentile


def hist_of(*values: float) -> list[int]:
    hist = empty()
    for value in values:
        observe(hist, value)
    return hist


def test_values_land_in_the_bucket_whose_upper_bound_holds_them() -> None:
    hist = hist_of(0, 10, 10.5, 25, 60000, 60001, 10**9)
    assert hist[0] == 2  # 0 and 10
    assert hist[1] == 2  # 10.5 and 25
    assert hist[BOUNDS_MS.index(60000.0)] == 1
    assert hist[-1] == 2  # past a minute
    assert sum(hist) == 7


def test_unknown_is_not_counted() -> None:
    assert observe(empty(), None) == empty()


def test_an_empty_histogram_has_no_percentiles() -> None:
    assert percentile(empty(), 0.5) is None
    assert percentile([], 0.99) is None
    assert percentile(None, 0.95) is None


def test_percentiles_interpolate_inside_the_bucket() -> None:
    hist = hist_of(5, 15, 30, 200)
    # rank 2 of 4 is the end of the 10-25 bucket; 3.8 and 3.96 fall inside 100-250.
    assert percentile(hist, 0.5) == pytest.approx(25.0)
    assert percentile(hist, 0.95) == pytest.approx(220.0)
    assert percentile(hist, 0.99) == pytest.approx(244.0)
    assert percentile(hist, 0.0) == pytest.approx(0.0)
    assert percentile(hist, 1.0) == pytest.approx(250.0)


def test_a_single_bucket_spreads_its_values_evenly() -> None:
    hist = hist_of(*([300] * 10))  # all in 250-500
    assert percentile(hist, 0.5) == pytest.approx(375.0)


def test_the_open_last_bucket_answers_its_lower_bound() -> None:
    assert percentile(hist_of(120000), 0.5) == 60000.0
    assert not math.isinf(percentile(hist_of(1, 120000), 0.99) or 0)


def test_merge_adds_bucket_by_bucket_and_pads_short_lists() -> None:
    a, b = hist_of(5, 30), hist_of(30, 2000)
    merged = merge(a, b, [1], None)
    assert merged[0] == 2 and merged[2] == 2 and sum(merged) == 5
    assert len(merged) == len(BOUNDS_MS)
    assert a == hist_of(5, 30)  # inputs unchanged
    assert histograms.merge_all([a, b]) == merge(a, b)


def test_observe_pads_an_old_short_list() -> None:
    hist: list[int] = [1]
    observe(hist, 70000)
    assert len(hist) == len(BOUNDS_MS) and hist[0] == 1 and hist[-1] == 1


def test_a_quantile_outside_0_to_1_is_a_mistake() -> None:
    with pytest.raises(ValueError):
        percentile(hist_of(1), 95)
