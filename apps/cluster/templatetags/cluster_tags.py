"""Filters for the node pages: figures with units, and "-" for whatever is unknown."""

from __future__ import annotations

from typing import Any

from django import template
from django.utils import formats
from django.utils.translation import gettext as _

from apps.accounts import access

register = template.Library()

UNKNOWN = "-"
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@register.filter
def gib(value: Any) -> str:
    """Bytes as GiB with one decimal; TiB from 1 TiB up, and MiB under 1 GiB, so that an engine
    holding 19 MiB does not read "0.0 GiB" (whole MiB from 10 MiB, one decimal under)."""
    if not _is_number(value):
        return UNKNOWN
    if abs(value) >= TIB:
        return _("%(value)s TiB") % {"value": formats.number_format(value / TIB, 1)}
    if value and abs(value) < GIB:
        mib = value / MIB
        return _("%(value)s MiB") % {"value": formats.number_format(mib, 0 if abs(mib) >= 10 else 1)}
    return _("%(value)s GiB") % {"value": formats.number_format(value / GIB, 1)}


@register.filter
def mib_gib(value: Any) -> str:
    """MiB (as GPUs report memory) shown like bytes."""
    return gib(value * 1024**2) if _is_number(value) else UNKNOWN


@register.filter
def num(value: Any, digits: int = 0) -> str:
    """A number with `digits` decimals in the page's language, or "-"."""
    if not _is_number(value):
        return UNKNOWN
    return str(formats.number_format(round(value, int(digits)), int(digits)))


@register.filter
def cores(value: Any) -> str:
    """CPU cores with one decimal, two under one core (an idle engine's 0.02 is not "0.0"), or "-"."""
    if not _is_number(value):
        return UNKNOWN
    return num(value, 2 if abs(value) < 1 else 1)


@register.filter
def pct(value: Any) -> str:
    """A percentage without decimals, or "-"."""
    return UNKNOWN if not _is_number(value) else _("%(value)s%%") % {"value": num(value)}


@register.filter
def kw(value: Any) -> str:
    """Watts shown as kilowatts with one decimal, or "-"."""
    if not _is_number(value):
        return UNKNOWN
    return _("%(value)s kW") % {"value": num(value / 1000, 1)}


@register.filter
def meter(value: Any) -> str:
    """The value of a 0-100 <meter>: clipped, with a dot whatever the language."""
    if not _is_number(value):
        return "0"
    return f"{min(max(float(value), 0.0), 100.0):.1f}"


@register.filter
def can_read_everything(user: Any) -> bool:
    return access.can_read_everything(user)


@register.filter
def can_change_cluster(user: Any) -> bool:
    return access.can_change_cluster(user)
