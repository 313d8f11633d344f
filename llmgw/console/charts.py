"""Line and bar charts drawn on the server as inline SVG: no JavaScript, no chart library.

Unknown values (None) break the line instead of dropping it to 0, so a missed heartbeat or a
GPU that did not answer shows as a gap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from django.utils import formats, timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _

__all__ = ["Layout", "NARROW", "WIDE", "bar_chart", "line_chart"]


@dataclass(frozen=True)
class Layout:
    """Room and type size for one way of drawing a chart, in SVG units.

    A chart is one SVG scaled to its box, so its labels shrink with it: on a phone (a box of some
    320 px for 480 units) 10 units of text came out at 6 or 7 px. Each chart therefore carries its
    figures twice: WIDE for screens where the box is about as wide as the chart, NARROW (larger
    type, more room for it, shorter names) for phones, and the stylesheet shows one
    (.chart-wide, .chart-narrow: the narrow one under 560 px, where the box is under 480 px)."""

    css: str
    font: int
    pad_left: int
    pad_top: int
    pad_bottom: int
    label_width: int  # a bar chart's room for the names on the left
    value_width: int  # and for the figure after the longest bar
    label_chars: int


# On a 360 px phone the chart's box is some 294 px: 17 units are 10.4 px there.
WIDE = Layout(
    "chart-wide", font=10, pad_left=44, pad_top=8, pad_bottom=18, label_width=150, value_width=64, label_chars=24
)
NARROW = Layout(
    "chart-narrow", font=17, pad_left=64, pad_top=10, pad_bottom=24, label_width=172, value_width=92, label_chars=16
)
PAD_RIGHT = 8
# Kept for what imports them: the wide layout's room around the plot.
PAD_LEFT, PAD_TOP, PAD_BOTTOM, FONT_SIZE = WIDE.pad_left, WIDE.pad_top, WIDE.pad_bottom, WIDE.font


def _number(value: float) -> str:
    digits = 0 if abs(value) >= 10 or float(value).is_integer() else 1
    return str(formats.number_format(round(value, digits), digits))


def _clock(epoch: float) -> str:
    return timezone.localtime(datetime.fromtimestamp(epoch, tz=UTC)).strftime("%H:%M")


def _svg_open(width: int, height: int, label: str) -> str:
    text = escape(label)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" class="h-auto max-w-full" role="img" aria-label="{text}">'
        f"<title>{text}</title>"
    )


def _empty(width: int, height: int, label: str) -> SafeString:
    # One text for both layouts: 16 units read as 10 px or more in a phone's box, and not too large elsewhere.
    # gettext outside the f-string: makemessages does not look inside one, so "no data" never
    # reached the catalogue and stayed English in Turkish.
    words = escape(_("no data"))
    return mark_safe(  # noqa: S308 - every text in it went through escape()
        _svg_open(width, height, label)
        + f'<rect x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" fill="none" stroke="#cbd5e1"/>'
        + f'<text x="{width / 2:.1f}" y="{height / 2:.1f}" text-anchor="middle" dominant-baseline="middle" '
        f'font-size="{NARROW.font - 1}" fill="#64748b">{words}</text></svg>'
    )


def _clean(series: Sequence[tuple[float, float | None]]) -> list[tuple[float, float | None]]:
    """Points in time order, without unusable times; a value that is not a finite number is None."""
    # By time alone: two points of one time, one of them None, cannot be compared by value.
    points = sorted(((float(t), v) for t, v in series if t is not None and math.isfinite(float(t))), key=lambda p: p[0])
    return [(t, float(v) if v is not None and math.isfinite(float(v)) else None) for t, v in points]


Line = list[tuple[float, float | None]]


def line_chart(
    series: Sequence[tuple[float, float | None]],
    *,
    width: int = 480,
    height: int = 120,
    y_max: float | None = None,
    label: str = "",
    unit: str = "",
    gap_seconds: float | None = None,
    reference: Sequence[tuple[float, float | None]] | None = None,
) -> SafeString:
    """An SVG line of (epoch seconds, value or None) points, with min/max labels on both axes.

    The y axis runs from 0 (or the lowest value, if negative) to `y_max`, or to the highest value
    when `y_max` is None; values outside are clipped to the box. A None value, or two points more
    than `gap_seconds` apart, breaks the line. `reference`, a second series of the same kind (what
    was claimed, beside what was used), is drawn as a grey dashed line under the first. Drawn in
    both layouts (WIDE first, then NARROW).
    """
    points = _clean(series)
    others = _clean(reference or [])
    values = [v for _t, v in points + others if v is not None]
    if not values:
        return _empty(width, height, label)
    low = min(0.0, min(values))
    high = float(y_max) if y_max is not None else max(values)
    if high <= low:
        high = low + 1.0
    times = [t for t, _v in points + others]
    plot = _Plot(width, height, low, high, min(times), max(times), gap_seconds, escape(unit))
    parts = [_svg_open(width, height, label)]
    for layout in (WIDE, NARROW):
        parts += [f'<g class="{layout.css}">', *plot.draw(layout, points, others), "</g>"]
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every text in it went through escape()


@dataclass(frozen=True)
class _Plot:
    width: int
    height: int
    low: float
    high: float
    t_first: float
    t_last: float
    gap_seconds: float | None
    suffix: str  # the unit, escaped

    def draw(self, layout: Layout, points: Line, others: Line) -> list[str]:
        """The box, the axes' labels, the reference line and the line, in `layout`."""
        left, right = layout.pad_left, self.width - PAD_RIGHT
        top, bottom = layout.pad_top, self.height - layout.pad_bottom
        x_of, y_of = self._scales(left, right, top, bottom)
        font = layout.font
        parts = [
            f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#e2e8f0"/>',
            f'<g font-size="{font}" fill="#64748b">',
            f'<text x="{left - 4}" y="{top + font - 2}" text-anchor="end">'
            f"{escape(_number(self.high))}{self.suffix}</text>",
            f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{escape(_number(self.low))}{self.suffix}</text>',
            f'<text x="{left}" y="{self.height - 4}" text-anchor="start">{escape(_clock(self.t_first))}</text>',
            f'<text x="{right}" y="{self.height - 4}" text-anchor="end">{escape(_clock(self.t_last))}</text>',
            "</g>",
        ]
        if others:
            ref_paths, ref_lone = self._shapes(others, x_of, y_of)
            parts.append('<g stroke="#94a3b8" fill="#94a3b8">')
            if ref_paths:
                parts.append(f'<path d="{" ".join(ref_paths)}" fill="none" stroke-width="1.5" stroke-dasharray="4 3"/>')
            parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5"/>' for x, y in ref_lone)
            parts.append("</g>")
        paths, lone = self._shapes(points, x_of, y_of)
        parts.append('<g class="text-indigo-700">')
        if paths:
            parts.append(
                f'<path d="{" ".join(paths)}" fill="none" stroke="currentColor" stroke-width="1.5" '
                'stroke-linejoin="round" stroke-linecap="round"/>'
            )
        parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5" fill="currentColor"/>' for x, y in lone)
        parts.append("</g>")
        return parts

    def _scales(
        self, left: float, right: float, top: float, bottom: float
    ) -> tuple[Callable[[float], float], Callable[[float], float]]:
        def x_of(t: float) -> float:
            if self.t_last == self.t_first:
                return (left + right) / 2
            return left + (t - self.t_first) / (self.t_last - self.t_first) * (right - left)

        def y_of(v: float) -> float:
            v = min(max(v, self.low), self.high)
            return bottom - (v - self.low) / (self.high - self.low) * (bottom - top)

        return x_of, y_of

    def _shapes(
        self, line: Line, x_of: Callable[[float], float], y_of: Callable[[float], float]
    ) -> tuple[list[str], list[tuple[float, float]]]:
        """The line's path pieces, and the lone points between gaps (drawn as dots)."""
        segments: list[list[tuple[float, float]]] = []
        current: list[tuple[float, float]] = []
        previous_t: float | None = None
        for t, v in line:
            broken = v is None or (
                self.gap_seconds is not None and previous_t is not None and t - previous_t > self.gap_seconds
            )
            if broken and current:
                segments.append(current)
                current = []
            if v is not None:
                current.append((x_of(t), y_of(v)))
                previous_t = t
            else:
                previous_t = None
        if current:
            segments.append(current)
        pieces = ["M" + " L".join(f"{x:.1f},{y:.1f}" for x, y in s) for s in segments if len(s) > 1]
        return pieces, [s[0] for s in segments if len(s) == 1]


BAR_ROW = 28  # height of one bar's row: room for the narrow layout's type
# Kept for what imports them: the wide layout's room for names and figures.
BAR_LABEL_WIDTH, BAR_VALUE_WIDTH, BAR_LABEL_CHARS = WIDE.label_width, WIDE.value_width, WIDE.label_chars


def _clipped(text: str, limit: int = BAR_LABEL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def bar_chart(
    items: Sequence[tuple[str, float | None]],
    *,
    width: int = 480,
    label: str = "",
    unit: str = "",
    digits: int = 0,
) -> SafeString:
    """Horizontal bars, one per (name, value), scaled to the largest value, each with its figure.

    An unknown value (None) draws no bar and says "-", never 0. Long names are clipped, with the
    whole name as the bar's tooltip. Drawn in both layouts (WIDE first, then NARROW).
    """
    rows = [(str(name), float(v) if v is not None and math.isfinite(float(v)) else None) for name, v in items]
    known = [v for _name, v in rows if v is not None]
    if not rows or not known:
        return _empty(width, max(BAR_ROW * 2, 40), label)
    height = PAD_TOP * 2 + BAR_ROW * len(rows)
    high = max(max(known), 0.0) or 1.0
    parts = [_svg_open(width, height, label)]
    for layout in (WIDE, NARROW):
        parts.append(f'<g class="{layout.css}" font-size="{layout.font + 1}" dominant-baseline="middle">')
        parts += _bars(rows, layout, width, high, unit, digits)
        parts.append("</g>")
    parts.append("</svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every text in it went through escape()


def _bars(
    rows: list[tuple[str, float | None]], layout: Layout, width: int, high: float, unit: str, digits: int
) -> list[str]:
    left = layout.label_width
    right = max(left + 20, width - layout.value_width)
    parts = []
    for index, (name, value) in enumerate(rows):
        middle = PAD_TOP + BAR_ROW * index + BAR_ROW / 2
        shown = "-" if value is None else f"{_figure(value, digits)}{unit}"
        parts.append(f"<g><title>{escape(name)}: {escape(shown)}</title>")
        parts.append(
            f'<text x="{left - 6}" y="{middle:.1f}" text-anchor="end" fill="#334155">'
            f"{escape(_clipped(name, layout.label_chars))}</text>"
        )
        end = float(left)
        if value is not None and value > 0:
            end = left + max(1.0, value / high * (right - left))
            parts.append(
                f'<rect x="{left}" y="{middle - BAR_ROW * 0.3:.1f}" width="{end - left:.1f}" '
                f'height="{BAR_ROW * 0.6:.1f}" rx="2" class="text-indigo-600" fill="currentColor"/>'
            )
        parts.append(f'<text x="{end + 4:.1f}" y="{middle:.1f}" fill="#64748b">{escape(shown)}</text></g>')
    return parts


def _figure(value: float, digits: int) -> str:
    return str(formats.number_format(round(value, digits), digits, use_l10n=True, force_grouping=True))
