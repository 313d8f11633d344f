"""How many examples the property tests draw.

A property test's full count (the figure written at its `@settings`) finds the rare shapes, and
costs minutes: the placement properties alone drew 400 clusters. The suite's own run (`make test`,
CI) draws a bounded share of each, deadline-free as before, so that it stays a quarter of an hour
on two cores; the full counts run on their own, as a nightly job would:

    make properties        # LLMGW_TEST_FULL_PROPERTIES=1, only the tests marked `properties`

Every test hypothesis drives is marked `properties` (tests/conftest.py), so `-m properties` picks
them all and `-m "not properties"` leaves them out.
"""

from __future__ import annotations

import os

__all__ = ["FULL", "examples"]

FULL = os.environ.get("LLMGW_TEST_FULL_PROPERTIES") == "1"
SHARE = 5  # the suite's run draws a fifth of the full count,
LEAST = 20  # and never fewer than this (or the full count, when that is smaller)


def examples(full: int) -> int:
    """The examples to draw: `full` in the full run, else a fifth of it, at least LEAST."""
    if FULL:
        return full
    return min(full, max(LEAST, full // SHARE))
