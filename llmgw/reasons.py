"""Why something was refused: a code, an English msgid and the numbers (no Django).

Placement refuses nodes and profiles with a `Reason` (apps.cluster.placement.reasons names each
one); the catalogue refuses a profile field's value with one (llmgw.fields). Every template
is wrapped in `gettext_noop` with a string literal, so Django's makemessages extracts it; the
Django side translates `template` and applies `params`. `Reason.message()` is the English text
(`template % params`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GIB", "Reason", "gb", "gettext_noop", "number"]

GIB = 1024**3


def gettext_noop(s: str) -> str:
    """Mark a msgid for extraction without translating it (placement never imports Django)."""
    return s


@dataclass(slots=True)
class Reason:
    code: str
    template: str
    params: dict[str, Any]
    # The message, once worked out: a reason that follows from the nodes alone is kept and given
    # again (a node without the profile's class), and its refusals need not format it again.
    _text: str | None = field(default=None, init=False, compare=False, repr=False)

    def message(self) -> str:
        text = self._text
        if text is None:
            text = self._text = self.template % self.params
        return text


def gb(value: float | None) -> str:
    """Bytes as GB (GiB, as everywhere in llmgw) with at most one decimal: 31, 15.5."""
    if value is None:
        return "-"
    return number(round(value / GIB, 1))


def number(value: float) -> str:
    """2.0 -> "2", 1.5 -> "1.5": counts and cores without a useless fraction."""
    if value == int(value):
        return str(int(value))
    return f"{value:.2f}".rstrip("0").rstrip(".")
