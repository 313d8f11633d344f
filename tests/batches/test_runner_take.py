"""The runner's look for lines: finding none of a model without replicas must not hold back the
models it serves (it did: an empty answer to "any line of another model?" kept it from taking lines
of the served model for its whole look-again interval, so the slots ran dry half the time)."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any

import pytest

from apps.batches import runner as runner_module
from apps.batches.runner import BatchRunner


def served(capacity: int) -> Any:
    route = SimpleNamespace(upstreams=[SimpleNamespace(capacity=capacity)])
    return SimpleNamespace(tables=SimpleNamespace(models={"m": route}))


async def test_no_line_of_an_unserved_model_does_not_stop_the_served_one_from_taking_lines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[tuple[dict[str, int], int]] = []

    def claim_lines(holder: str, wanted: dict[str, int], *, others: int = 1) -> list[Any]:
        asked.append((dict(wanted), others))
        return []

    monkeypatch.setattr(runner_module, "claim_lines", claim_lines)
    runner = BatchRunner(served(2), advance_s=60.0)
    runner.buffer["m"] = deque(SimpleNamespace(model="m") for _ in range(4))  # a round held: m wants none
    await runner._take()
    assert asked == [({"m": 0}, 1)]  # only a line of another model was looked for, and none came

    runner.buffer["m"].clear()  # the round ran: m wants lines again, at once
    await runner._take()
    assert asked[-1] == ({"m": 4}, 0)  # asked at once, without looking for other models again yet

    await runner._take()  # none came for m either: now the runner waits before looking again
    await runner._take()
    assert len(asked) == 2
