from __future__ import annotations

import re

from llmgw.console.charts import line_chart


def coordinates(svg: str) -> list[tuple[float, float]]:
    path = re.search(r' d="([^"]*)"', svg)
    assert path is not None
    return [(float(x), float(y)) for x, y in re.findall(r"(-?[\d.]+),(-?[\d.]+)", path.group(1))]


def test_an_empty_series_draws_a_no_data_chart() -> None:
    svg = line_chart([], label="CPU")
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert "no data" in svg
    assert "<path" not in svg


def test_a_series_of_only_unknown_values_has_no_data_either() -> None:
    assert "no data" in line_chart([(0, None), (10, None)])


def test_a_gap_breaks_the_line_instead_of_dropping_to_zero() -> None:
    svg = line_chart([(0, 50), (10, 60), (20, None), (30, 40), (40, 45)], y_max=100)
    path = re.search(r' d="([^"]*)"', svg).group(1)
    assert path.count("M") == 2
    bottom = 120 - 18
    assert all(y < bottom for _x, y in coordinates(svg))


def test_a_lone_point_between_gaps_is_still_drawn() -> None:
    svg = line_chart([(0, None), (10, 30), (20, None)], y_max=100)
    assert "<circle" in svg
    assert "<path" not in svg


def test_points_too_far_apart_break_the_line() -> None:
    svg = line_chart([(0, 1), (10, 2), (500, 3), (510, 4)], gap_seconds=60)
    assert re.search(r' d="([^"]*)"', svg).group(1).count("M") == 2


def test_values_are_scaled_inside_the_box() -> None:
    width, height = 300, 100
    svg = line_chart([(0, 0), (30, 250), (60, 100), (90, -5)], width=width, height=height, y_max=100)
    points = coordinates(svg)
    assert len(points) == 4
    for x, y in points:
        assert 0 <= x <= width and 0 <= y <= height
    xs = [x for x, _y in points]
    assert xs == sorted(xs) and xs[0] < xs[-1]
    # 250 is over the top of a 0-100 chart: clipped to the top edge, level with 100
    assert points[1][1] == points[2][1]


def test_the_axes_carry_min_and_max_labels() -> None:
    svg = line_chart([(0, 10), (60, 20)], y_max=100, unit="%")
    assert ">100%<" in svg and ">0%<" in svg
    assert re.search(r">\d\d:\d\d<", svg)


def test_without_a_maximum_the_highest_value_is_the_top() -> None:
    svg = line_chart([(0, 1.5), (60, 3.25)])
    assert ">3.2<" in svg or ">3.3<" in svg


def test_the_label_is_escaped() -> None:
    svg = line_chart([(0, 1), (1, 2)], label='<script>"x"</script>')
    assert "<script>" not in svg
    assert "&lt;script&gt;" in svg
    assert "<script>" not in line_chart([], label="<script>")


def test_two_points_of_one_time_one_unknown_are_drawn_not_compared() -> None:
    # Two samples of one second, one without the value (a model chart over two shards): sorting
    # the points by value as well as time raised TypeError and the node page answered 500.
    svg = line_chart([(10.0, None), (10.0, 3.0), (20.0, 4.0)], label="tokens")
    assert "<svg" in svg and "no data" not in svg


def test_a_chart_carries_a_drawing_for_phones_with_larger_type() -> None:
    """On a phone a 480-unit chart is drawn some 320 px wide: its 10-unit labels came out at 6 or 7 px.
    The narrow drawing (shown there by the stylesheet) has 17-unit labels: 11 px at that width."""
    from llmgw.console.charts import NARROW, WIDE, bar_chart

    for svg in (line_chart([(0, 10), (60, 20)], y_max=100, unit="%"), bar_chart([("acme", 3.0), ("b", None)])):
        assert svg.count("<svg") == 1
        wide = svg[svg.index(f'<g class="{WIDE.css}"') : svg.index(f'<g class="{NARROW.css}"')]
        narrow = svg[svg.index(f'<g class="{NARROW.css}"') :]
        sizes = [int(size) for size in re.findall(r'font-size="(\d+)"', narrow)]
        assert sizes and min(sizes) >= NARROW.font and max(int(s) for s in re.findall(r'font-size="(\d+)"', wide)) < 17
        # 17 units in a 480-unit chart drawn 294 px wide (a 360 px phone's card) are 10.4 px
        assert NARROW.font * 294 / 480 >= 10


def test_no_data_is_said_in_the_persons_language() -> None:
    from django.utils import translation

    with translation.override("tr"):
        assert "no data" not in line_chart([])
