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
