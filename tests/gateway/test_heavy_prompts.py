"""Long prompts are matched in the guard's worker processes, one of an API key at a time, and never
keep anyone else waiting.

The gateway and Django (for /healthz) run for real on one port (the `web` fixture of
test_guardrails_load). While every worker process is held by a job that waits for the test (it
stands for a long match), a client's long prompt waits for one, and meanwhile another client's
short chat, the model list and /healthz are answered, with the guard's threads all taken as well:
nothing short waits on the long prompt, and the long prompt needs no thread. Then the workers are
let go, and the long prompt reaches the engine with its card and codename masked. No time is
measured (bench/guardrails.py --noisy measures the other clients' p99).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from apps.gateway import guard
from apps.gateway.tables import Guards
from apps.guardrails import offload as offload_module
from apps.guardrails.engine import ELSEWHERE_CHARS, MASK
from apps.guardrails.offload import Offload, OffloadFailed
from tests.gateway.harness import KEY, OTHER_KEY, WAIT, Gateway, entry
from tests.gateway.mock_engine import MockEngine
from tests.gateway.test_guardrails_load import ADVERSARIAL, CARD, RULES, TakenThreads, chat, streamed_text, web

__all__ = ["web"]  # the fixture, used here

LONG = ADVERSARIAL * 2_000 + f"pay with {CARD}, re Project\nFalcon"


class HeldWorkers:
    """Every worker process of a pool held by a job that reads a FIFO (a standard library call, so
    the workers import nothing of the tests) until `release()` writes to it."""

    def __init__(self, offload: Offload, folder: Path) -> None:
        self.fifo = folder / "hold"
        os.mkfifo(self.fifo)
        loop = asyncio.get_running_loop()
        self.jobs = [loop.run_in_executor(offload.pool(), self.fifo.read_text) for _ in range(offload.processes)]

    async def release(self) -> list[str]:  # what each job read ("go", or "" when it opened it late)
        async with asyncio.timeout(WAIT * 4):
            while not all(job.done() for job in self.jobs):
                try:
                    fd = os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:  # no job has opened it yet
                    await asyncio.sleep(0.01)
                    continue
                os.write(fd, b"go")
                os.close(fd)
                await asyncio.sleep(0.01)
            return await asyncio.gather(*self.jobs)


@pytest.fixture
def offload(monkeypatch: pytest.MonkeyPatch) -> Iterator[Offload]:
    """The guard's worker processes, this test's own (two of them)."""
    pool = Offload(processes=2)
    monkeypatch.setattr(guard, "offload", pool)
    yield pool
    pool.shutdown()


async def test_a_long_prompt_waits_for_a_worker_process_while_short_requests_are_answered(
    gw: Gateway, engine: MockEngine, web: str, offload: Offload, tmp_path: Path
) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)
    assert len(LONG) >= guard.HEAVY_CHARS
    held = HeldWorkers(offload, tmp_path)
    taken = TakenThreads()
    try:
        async with aiohttp.ClientSession() as session:
            prompt = asyncio.create_task(chat(session, web, LONG))
            async with asyncio.timeout(WAIT):
                while not guard.lanes.waiting(1):  # its lane taken: it waits for a worker
                    await asyncio.sleep(0.01)
            async with session.get(f"{web}/healthz") as health:
                assert health.status == 200
            async with session.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as models:
                assert models.status == 200
            status, body = await chat(session, web, "a short question about project falcon")
            assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Hello there"
            assert len(engine.seen) == 1 and not prompt.done()  # the long prompt has not reached the engine
            assert len(await held.release()) == offload.processes
            async with asyncio.timeout(WAIT * 4):
                prompt_status, _answer = await prompt  # with the guard's threads still taken
    finally:
        await held.release()
        taken.release()
    assert prompt_status == 200
    assert engine.seen[-1].body["messages"][0]["content"].endswith("pay with [redacted], re [redacted]")
    assert not guard.lanes.waiting(1)


async def test_a_keys_long_prompts_wait_on_each_other_not_on_another_keys(gw: Gateway, engine: MockEngine) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)
    gw.set_key(OTHER_KEY, entry(key_id=2))
    lanes = guard.lanes
    async with lanes.lane(1):  # one of key 1's long prompts is being matched
        queued = asyncio.create_task(gw.chat(messages=[{"role": "user", "content": LONG}]))
        async with asyncio.timeout(WAIT):
            while lanes.waiting(1) < 2:
                await asyncio.sleep(0.01)
        other = await gw.chat(key=OTHER_KEY, messages=[{"role": "user", "content": LONG + " again"}])
        assert other.status == 200, other.text
        assert engine.seen[-1].body["messages"][0]["content"].endswith("re [redacted] again")
        assert not queued.done() and lanes.waiting(1) == 2
    answer = await asyncio.wait_for(queued, WAIT * 4)
    assert answer.status == 200
    assert engine.seen[-1].body["messages"][0]["content"].endswith("pay with [redacted], re [redacted]")
    assert not lanes.waiting(1) and not lanes.waiting(2)


async def test_a_long_prompt_is_still_checked_when_no_worker_process_can_match_it(
    gw: Gateway, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)

    async def failing(_policies: object, _texts: object) -> None:
        raise OffloadFailed("a worker died")

    monkeypatch.setattr(guard.offload, "check_texts", failing)
    answer = await gw.chat(messages=[{"role": "user", "content": LONG}])
    assert answer.status == 200
    assert engine.seen[-1].body["messages"][0]["content"].endswith("pay with [redacted], re [redacted]")
    refused = RULES + [guard_rule_refusing_cards()]
    gw.app.tables.guards = Guards(everyone=refused)
    answer = await gw.chat(messages=[{"role": "user", "content": LONG}])
    assert answer.status == 400 and "payment card" in answer.text


async def test_a_worker_that_dies_is_replaced_and_the_prompts_matched_all_the_same(
    gw: Gateway, engine: MockEngine, offload: Offload, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)
    loop = asyncio.get_running_loop()
    pool = offload.pool()
    with pytest.raises(Exception):  # noqa: B017, PT011 - the pool breaks as the worker dies
        await loop.run_in_executor(pool, os._exit, 1)
    for _ in range(2):  # the broken pool, then none for RETRY_S: the prompt is matched in a thread
        answer = await gw.chat(messages=[{"role": "user", "content": LONG}])
        assert answer.status == 200
        assert engine.seen[-1].body["messages"][0]["content"].endswith("pay with [redacted], re [redacted]")
    with pytest.raises(RuntimeError, match="another is started in"):
        offload.pool()
    monkeypatch.setattr(offload_module, "RETRY_S", 0.0)
    answer = await gw.chat(messages=[{"role": "user", "content": LONG + " again"}])  # a new pool
    assert answer.status == 200 and offload.pool() is not pool
    assert engine.seen[-1].body["messages"][0]["content"].endswith("re [redacted] again")


def guard_rule_refusing_cards() -> object:
    from apps.guardrails.engine import RuleSpec

    return RuleSpec("cards", "no cards", "detector", "refuse", detector="card")


async def test_a_long_streamed_chunk_is_matched_in_a_worker_while_short_requests_are_answered(
    gw: Gateway, engine: MockEngine, web: str, offload: Offload, tmp_path: Path
) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)
    held = HeldWorkers(offload, tmp_path)
    long_chunk = ADVERSARIAL * 1_000 + f"the card is {CARD}."
    assert len(long_chunk) >= ELSEWHERE_CHARS
    try:
        async with aiohttp.ClientSession() as session:
            engine.pieces = ["Sure. ", long_chunk, " Done."]
            answer = asyncio.create_task(chat(session, web, "tell me", stream=True))
            async with asyncio.timeout(WAIT):
                while offload_queued(offload) == 0:  # the chunk's thread waits for a worker
                    await asyncio.sleep(0.01)
            engine.pieces = None
            async with session.get(f"{web}/healthz") as health:
                assert health.status == 200
            status, body = await chat(session, web, "a short question about project falcon")
            assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Hello there"
            assert not answer.done()
            await held.release()
            async with asyncio.timeout(WAIT * 4):
                answer_status, raw = await answer
    finally:
        await held.release()
    assert answer_status == 200
    assert streamed_text(raw) == "Sure. " + ADVERSARIAL * 1_000 + f"the card is {MASK}. Done."


def offload_queued(offload: Offload) -> int:
    """The jobs the workers were given beyond those holding them (what waits for one)."""
    pool = offload.pool()
    return len(pool._pending_work_items) - offload.processes  # type: ignore[attr-defined]
