"""Matching in the guard's worker processes says what matching here says (apps.guardrails.offload)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from apps.guardrails.engine import DETECTORS, ELSEWHERE, ELSEWHERE_CHARS, PolicySet, RuleSpec
from apps.guardrails.offload import Offload

RULES = [
    RuleSpec("p", "codename", "terms", "redact", terms=("Project Falcon",)),
    RuleSpec("p", "secret", "regex", "refuse", pattern=r"top\s+secret"),
    *(RuleSpec("p", name, "detector", "redact", detector=name) for name in DETECTORS),
]
TEXT = ("İstanbul'da ß ﬁyat " * 600) + "card 4111 1111 1111 1111, project\u200b falcon, ＴＯＰ secret"


@pytest.fixture
def offload() -> Iterator[Offload]:
    pool = Offload(processes=1)
    yield pool
    pool.shutdown()


def test_a_prompt_matched_in_a_worker_gets_the_same_verdict_and_masks(offload: Offload) -> None:
    policies = PolicySet(RULES)
    here = policies.check_texts([TEXT, "nothing here"])
    there = asyncio.run(offload.check_texts(policies, [TEXT, "nothing here"]))
    assert there == here
    assert here[0].refusal is not None and here[0].redacted


def test_a_guards_thread_has_its_long_texts_matched_in_a_worker_never_an_event_loop(offload: Offload) -> None:
    policies = PolicySet(RULES)
    asked: list[int] = []
    blocking = offload.matches_blocking

    def counted(rules: tuple[RuleSpec, ...], text: str) -> list[tuple[int, int, int]] | None:
        found = blocking(rules, text)
        asked.append(len(text) if found is not None else -1)
        return found

    offload.matches_blocking = counted  # type: ignore[method-assign]
    out: list[object] = []

    def guard_thread() -> None:
        with offload.elsewhere():
            out.append(policies.outbound.matches(TEXT))
            out.append(policies.outbound.matches("card 4111 1111 1111 1111"))  # short: here
        out.append(getattr(ELSEWHERE, "matches", None))

    thread = threading.Thread(target=guard_thread)
    thread.start()
    thread.join()
    short = "card 4111 1111 1111 1111"
    assert out == [policies.outbound.matches_here(TEXT), policies.outbound.matches_here(short), None]
    assert asked == [len(TEXT)] and len(TEXT) >= ELSEWHERE_CHARS

    async def on_a_loop() -> list[tuple[int, int, int]] | None:
        return offload.matches_blocking(tuple(policies.outbound.rules), TEXT)

    assert asyncio.run(on_a_loop()) is None  # an event loop's thread never waits on a worker
