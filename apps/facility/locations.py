"""Where a node is: the llmgw.io/site, room, row, rack and pdu labels (no Django).

A node's labels are its agent's (agent.yaml) with the ones kept in the store (`llmgw ctl label`,
the console) over them, as the inventory already merges them. A domain is one level and value:
`rack=r12`. A level the node does not name is unknown, never a value of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["LEVELS", "PREFIX", "label_of", "location", "parse_domain"]

LEVELS = ("site", "room", "row", "rack", "pdu")
PREFIX = "llmgw.io/"


def label_of(level: str) -> str:
    return f"{PREFIX}{level}"


def location(labels: Mapping[str, str] | None) -> dict[str, str | None]:
    """Each level -> the node's value (None: not said)."""
    labels = labels or {}
    found: dict[str, str | None] = {}
    for level in LEVELS:
        value = labels.get(label_of(level))
        found[level] = str(value).strip() or None if value is not None else None
    return found


def parse_domain(text: str) -> tuple[str, str]:
    """`rack=r12` -> ("rack", "r12"); ValueError naming the levels on anything else."""
    level, sep, value = (text or "").partition("=")
    level, value = level.strip().lower(), value.strip()
    if not sep or level not in LEVELS or not value:
        raise ValueError(f"expected LEVEL=NAME with LEVEL one of {', '.join(LEVELS)}, got {text!r}")
    if len(value) > 100:
        raise ValueError(f"a {level} name is at most 100 characters, got {len(value)}")
    return level, value
