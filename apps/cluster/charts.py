"""Line and bar charts drawn on the server as inline SVG: no JavaScript, no chart library.

Unknown values (None) break the line instead of dropping it to 0, so a missed heartbeat or a
GPU that did not answer shows as a gap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime

from django.utils import formats, timezone
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext as _

__all__ = ["bar_chart", "line_chart"]

# Room around the plot for the axis labels, in SVG units.
PAD_LEFT = 44
PAD_RIGHT = 8
PAD_TOP = 8
PAD_BOTTOM = 18
FONT_SIZE = 10


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
    return mark_safe(  # noqa: S308 - every text in it went through escape()
        _svg_open(width, height, label)
        + f'<rect x="0.5" y="0.5" width="{width - 1}" height="{height - 1}" fill="none" stroke="#cbd5e1"/>'
        + f'<text x="{width / 2:.1f}" y="{height / 2:.1f}" text-anchor="middle" dominant-baseline="middle" '
        f'font-size="{FONT_SIZE + 2}" fill="#64748b">{escape(_("no data"))}</text></svg>'
    )


def _clean(series: Sequence[tuple[float, float | None]]) -> list[tuple[float, float | None]]:
    """Points in time order, without unusable times; a value that is not a finite number is None."""
    # By time alone: two points of one time, one of them None, cannot be compared by value.
    points = sorted(((float(t), v) for t, v in series if t is not None and math.isfinite(float(t))), key=lambda p: p[0])
    return [(t, float(v) if v is not None and math.isfinite(float(v)) else None) for t, v in points]


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
    was claimed, beside what was used), is drawn as a grey dashed line under the first.
    """
    points = _clean(series)
    others = _clean(reference or [])
    values = [v for _t, v in points + others if v is not None]
    if not values:
        return _empty(width, height, label)

    left, right = PAD_LEFT, width - PAD_RIGHT
    top, bottom = PAD_TOP, height - PAD_BOTTOM
    low = min(0.0, min(values))
    high = float(y_max) if y_max is not None else max(values)
    if high <= low:
        high = low + 1.0
    times = [t for t, _v in points + others]
    t_first, t_last = min(times), max(times)

    def x_of(t: float) -> float:
        if t_last == t_first:
            return (left + right) / 2
        return left + (t - t_first) / (t_last - t_first) * (right - left)

    def y_of(v: float) -> float:
        v = min(max(v, low), high)
        return bottom - (v - low) / (high - low) * (bottom - top)

    def shapes(line: list[tuple[float, float | None]]) -> tuple[list[str], list[tuple[float, float]]]:
        """The line's path pieces, and the lone points between gaps (drawn as dots)."""
        segments: list[list[tuple[float, float]]] = []
        current: list[tuple[float, float]] = []
        previous_t: float | None = None
        for t, v in line:
            broken = v is None or (gap_seconds is not None and previous_t is not None and t - previous_t > gap_seconds)
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

    paths, lone = shapes(points)
    dots = [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5" fill="currentColor"/>' for x, y in lone]

    suffix = escape(unit)
    parts = [
        _svg_open(width, height, label),
        f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" fill="none" stroke="#e2e8f0"/>',
        f'<g font-size="{FONT_SIZE}" fill="#64748b">',
        f'<text x="{left - 4}" y="{top + FONT_SIZE - 2}" text-anchor="end">{escape(_number(high))}{suffix}</text>',
        f'<text x="{left - 4}" y="{bottom}" text-anchor="end">{escape(_number(low))}{suffix}</text>',
        f'<text x="{left}" y="{height - 4}" text-anchor="start">{escape(_clock(t_first))}</text>',
        f'<text x="{right}" y="{height - 4}" text-anchor="end">{escape(_clock(t_last))}</text>',
        "</g>",
    ]
    if others:
        ref_paths, ref_lone = shapes(others)
        parts.append('<g stroke="#94a3b8" fill="#94a3b8">')
        if ref_paths:
            parts.append(f'<path d="{" ".join(ref_paths)}" fill="none" stroke-width="1.5" stroke-dasharray="4 3"/>')
        parts.extend(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.5"/>' for x, y in ref_lone)
        parts.append("</g>")
    parts.append('<g class="text-indigo-700">')
    if paths:
        parts.append(
            f'<path d="{" ".join(paths)}" fill="none" stroke="currentColor" stroke-width="1.5" '
            'stroke-linejoin="round" stroke-linecap="round"/>'
        )
    parts.extend(dots)
    parts.append("</g></svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every text in it went through escape()


BAR_ROW = 20  # height of one bar's row
BAR_LABEL_WIDTH = 150  # room for the group names on the left
BAR_VALUE_WIDTH = 64  # room for the figure after the longest bar
BAR_LABEL_CHARS = 24


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
    whole name as the bar's tooltip.
    """
    rows = [(str(name), float(v) if v is not None and math.isfinite(float(v)) else None) for name, v in items]
    known = [v for _name, v in rows if v is not None]
    if not rows or not known:
        return _empty(width, max(BAR_ROW * 2, 40), label)
    height = PAD_TOP * 2 + BAR_ROW * len(rows)
    left = BAR_LABEL_WIDTH
    right = max(left + 20, width - BAR_VALUE_WIDTH)
    high = max(max(known), 0.0) or 1.0
    parts = [_svg_open(width, height, label), f'<g font-size="{FONT_SIZE + 1}" dominant-baseline="middle">']
    for index, (name, value) in enumerate(rows):
        middle = PAD_TOP + BAR_ROW * index + BAR_ROW / 2
        shown = "-" if value is None else f"{_figure(value, digits)}{unit}"
        parts.append(f"<g><title>{escape(name)}: {escape(shown)}</title>")
        parts.append(
            f'<text x="{left - 6}" y="{middle:.1f}" text-anchor="end" fill="#334155">{escape(_clipped(name))}</text>'
        )
        end = float(left)
        if value is not None and value > 0:
            end = left + max(1.0, value / high * (right - left))
            parts.append(
                f'<rect x="{left}" y="{middle - BAR_ROW * 0.35:.1f}" width="{end - left:.1f}" '
                f'height="{BAR_ROW * 0.7:.1f}" rx="2" class="text-indigo-600" fill="currentColor"/>'
            )
        parts.append(f'<text x="{end + 4:.1f}" y="{middle:.1f}" fill="#64748b">{escape(shown)}</text></g>')
    parts.append("</g></svg>")
    return mark_safe("".join(parts))  # noqa: S308 - every text in it went through escape()


def _figure(value: float, digits: int) -> str:
    return str(formats.number_format(round(value, digits), digits, use_l10n=True, force_grouping=True))
