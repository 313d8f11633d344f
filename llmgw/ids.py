"""Ids and whole numbers as they arrive in text (a URL, a query string, a form, a header, a label),
read in one place so that what Python takes and the database does not never reaches a query.

`str.isdigit()` passes "²" and "³", which `int()` then refuses with a ValueError (a 500);
`int()` itself takes "１２", " 12 " and "1_000"; and ASCII digits can still name a number past
what the column holds, which PostgreSQL refuses ("out of range for type bigint"). So:

- `parse_id()` takes ASCII digits only and a value the id column can hold (1 to 2**63 - 1 for
  the BigAutoField every llmgw table has; a model's own pk column when given); anything else
  names no row, and the caller answers as for an id that names nothing (a 404);
- `IdConverter` is the same rule for URL patterns (`<id:pk>`): a path it refuses matches no
  pattern, and is a 404;
- `whole_number()` is the rule for a number that is not an id (seconds, watts): ASCII digits,
  within the bounds the caller gives, else None;
- `column_range()` is what an integer column holds, on PostgreSQL's sizes (SQLite holds 64 bits
  in all of them, so a bound checked only there would pass what PostgreSQL refuses).
"""

from __future__ import annotations

import re
from typing import Any

from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.models import Field, Model

__all__ = ["MAX_ID", "IdConverter", "column_range", "parse_id", "whole_number"]

#: The largest id of a BigAutoField (DEFAULT_AUTO_FIELD), 19 digits.
MAX_ID = 2**63 - 1
_DIGITS = re.compile(r"[0-9]{1,20}")  # ASCII; 20 digits hold every unsigned 64-bit number


def column_range(field: Field[Any, Any]) -> tuple[int, int]:
    """The smallest and largest value an integer column holds (a foreign key's: its target's).
    Raises KeyError for a column that is not an integer."""
    target = field.target_field if field.is_relation else field  # type: ignore[attr-defined]
    return BaseDatabaseOperations.integer_field_ranges[target.get_internal_type()]


def whole_number(raw: object, low: int, high: int) -> int | None:
    """`raw` as a whole number from `low` to `high` when it is ASCII digits (no sign, no spaces),
    else None."""
    if not isinstance(raw, str) or not _DIGITS.fullmatch(raw):
        return None
    value = int(raw)
    return value if low <= value <= high else None


def parse_id(raw: object, model: type[Model] | None = None) -> int | None:
    """The id `raw` names: ASCII digits from 1 to what the id column holds (`model`'s primary key,
    else a BigAutoField's). None for anything else, which names no row."""
    pk = model._meta.pk if model is not None else None
    return whole_number(raw, 1, column_range(pk)[1] if pk is not None else MAX_ID)


class IdConverter:
    """`<id:pk>` in a URL pattern: an id as parse_id() reads it; anything else matches nothing (404)."""

    regex = "[0-9]{1,20}"

    def to_python(self, value: str) -> int:
        number = parse_id(value)
        if number is None:
            raise ValueError(value)  # Django's resolver: this pattern does not match
        return number

    def to_url(self, value: int | str) -> str:
        return str(value)
