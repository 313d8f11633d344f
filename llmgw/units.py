"""Sizes as people write them: "24GB", "512 MiB", "1.5G", or a bare number of gigabytes.

Memory is counted as operators and the kernel count RAM: a GB is 1024^3 bytes, as in "64 GB of
RAM". No Django, no app: the catalogue reads a profile's memory with it, the quotas app a capacity
quota's.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["UNITS", "parse_memory"]

# Bytes per unit, by the unit as written (in lower case).
UNITS = {
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "ki": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mi": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gi": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1024**4,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_memory(value: Any) -> int:
    """Bytes from 24, "24GB", "24 GiB", "1.5G" (a bare number is gigabytes; a GB is 1024^3 bytes)."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        return value * 1024**3
    if isinstance(value, float):
        number, unit = value, "gb"
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        unit = (match.group(2).lower() or "gb") if match else ""
        if not match or unit not in UNITS:
            raise ValueError
        number = float(match.group(1))
    size = number * UNITS[unit]
    if not math.isfinite(size):  # "1e999", .inf in YAML: no size at all
        raise ValueError
    return int(size)
