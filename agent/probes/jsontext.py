"""JSON that a tool or a file wrote, read with bounds so that reading it cannot fail.

``json.loads`` alone raises RecursionError on a document nested a thousand levels deep (1,500
``[`` are enough), ValueError on an integer of more than 4,300 digits, and hands back integers of
a few hundred digits that ``float()`` then refuses with OverflowError. Real output of
``sensors -j``, ``findmnt --json``, ``ip -j addr``, ``nvidia-imex-ctl -N -j`` or a safetensors
header nests a handful of levels and holds numbers of a few digits. So :func:`read_json` counts
the nesting before decoding (a linear scan that skips strings) and refuses a document deeper than
``MAX_DEPTH``; it reads an integer longer than ``MAX_DIGITS`` digits, a float that does not fit a
float and ``NaN``/``Infinity`` as None (unknown), and says how many it met.

No Django import; Python 3.11+.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_DIGITS", "read_json"]

#: Deeper than any tool's output; far below the interpreter's recursion limit.
MAX_DEPTH = 64
#: A 64-bit counter has 20 digits.
MAX_DIGITS = 30

# A string (possessive, so a string without its closing quote cannot make the scan backtrack) or
# one bracket.
_TOKEN_RE = re.compile(r'"(?:[^"\\]++|\\.)*+"|[\[\]{}]')


def _depth_exceeds(text: str, limit: int) -> bool:
    depth = 0
    for m in _TOKEN_RE.finditer(text):
        token = m.group()
        if token in "[{":
            depth += 1
            if depth > limit:
                return True
        elif token in "]}":
            depth = max(0, depth - 1)
    return False


def read_json(text: str) -> tuple[Any, list[str]]:
    """``(document, notes)``: the decoded document and what was read as unknown in it, or
    ``(None, [why])`` when the text is not JSON or nests deeper than MAX_DEPTH. Never raises."""
    body = (text or "").lstrip("\ufeff")
    if _depth_exceeds(body, MAX_DEPTH):
        return None, [f"the JSON is nested deeper than {MAX_DEPTH} levels, which no tool writes; not read"]
    unreadable = 0

    def unknown(_digits: str) -> None:
        nonlocal unreadable
        unreadable += 1

    def parse_int(digits: str) -> int | None:
        if len(digits.lstrip("-")) <= MAX_DIGITS:
            return int(digits)
        unknown(digits)
        return None

    def parse_float(digits: str) -> float | None:
        value = float(digits) if len(digits) <= 400 else math.inf
        if math.isfinite(value):
            return value
        unknown(digits)
        return None

    try:
        data = json.loads(body, parse_int=parse_int, parse_float=parse_float, parse_constant=unknown)
    except (ValueError, RecursionError) as exc:
        return None, [f"not valid JSON ({str(exc)[:120]})"]
    notes = [f"{unreadable} numbers too long or not finite were read as unknown"] if unreadable else []
    return data, notes
