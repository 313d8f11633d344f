from __future__ import annotations

from typing import Any

from django import template
from django.utils.translation import gettext as _

from apps.mirror.models import MirrorFile

register = template.Library()


@register.filter(name="bytes")
def size_text(value: Any) -> str:
    """A size in decimal units ("3.1 MB"); "-" where it is unknown."""
    from agent.install.fetch import human_bytes

    if value is None or value == "":
        return "-"
    return human_bytes(int(value))


@register.filter
def percent(file: MirrorFile) -> int | None:
    if not file.size:
        return None
    return min(100, int(100 * file.bytes_done / file.size))


@register.filter
def duration(seconds: Any) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds} s"


@register.filter
def group_kind(kind: str) -> str:
    return {
        "gguf": _("GGUF"),
        "split": _("split GGUF set"),
        "safetensors": _("safetensors set"),
        "projector": _("projector"),
        "adapter": _("adapter"),
    }.get(kind, kind)
