"""Filters for the usage page: times as people read them, and "-" for what was not measured."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils import formats
from django.utils.translation import gettext as _

register = template.Library()

UNKNOWN = "-"


@register.filter
def ms(value: Any) -> str:
    """Milliseconds: "0.36 ms" under 10, "840 ms" under a second, "1.25 s" from one up, "-" when unknown."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return UNKNOWN
    if value < 10:  # a sub-millisecond time is not "0 ms"
        return _("%(value)s ms") % {"value": formats.number_format(round(value, 2), 2)}
    if value < 1000:
        return _("%(value)s ms") % {"value": formats.number_format(round(value), 0)}
    return _("%(value)s s") % {"value": formats.number_format(round(value / 1000, 2), 2)}


@register.filter
def held_hours(value: Any) -> str:
    """GPU-hours by class ({"H100-80GB": 12.0, "A10": 0.5}) as their total with one decimal, "-" when
    not counted."""
    if not isinstance(value, dict):
        return UNKNOWN
    return str(formats.number_format(round(sum(value.values()), 1), 1))


@register.filter
def held_classes(value: Any) -> str:
    """The same by class, for a tooltip: "H100-80GB 12.0 · A10 0.5"."""
    if not isinstance(value, dict):
        return ""
    return " · ".join(f"{name} {formats.number_format(round(hours, 1), 1)}" for name, hours in sorted(value.items()))
