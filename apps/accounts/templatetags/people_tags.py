"""Filters for the People page: times with units, counts, and "-" for whatever is unknown."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils import formats
from django.utils.translation import gettext as _

from apps.accounts import access

register = template.Library()

UNKNOWN = "-"


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@register.filter
def ms(value: Any) -> str:
    """Milliseconds as "85 ms", or "1.2 s" from a second up; "-" when unknown."""
    if not _is_number(value):
        return UNKNOWN
    if value >= 1000:
        return _("%(value)s s") % {"value": formats.number_format(value / 1000, 1)}
    return _("%(value)s ms") % {"value": formats.number_format(round(value), 0)}


@register.filter
def count(value: Any) -> str:
    """A whole number with the language's grouping, or "-" when unknown."""
    if not _is_number(value):
        return UNKNOWN
    return str(formats.number_format(int(value), 0, force_grouping=True))


@register.filter
def manages_a_branch(user: Any) -> bool:
    return access.manages_a_branch(user)
