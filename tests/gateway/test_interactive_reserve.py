"""The interactive reserve: while interactive requests have been seen for a model lately, batch
requests leave them as many slots as were in flight at once, so an interactive request never waits
behind a batch answer it cannot cut off. Through the gateway (in one process, or shared through
Redis when the suite has it), and with two processes sharing a model's slots through Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from prometheus_client import REGISTRY

from apps.gateway.fairness import BATCH, INTERACTIVE
from apps.gateway.slots import Reserved
from tests.gateway.harness import WAIT, Answer, Gateway, held, until
from tests.gateway.mock_engine import MockEngine
from tests.gateway.test_shared_slots import REDIS_URL, Process, processes, upstream

__all__ = ["processes"]  # the fixture, used by the shared tests below

WINDOW_PASSED = 31.0  # seconds: past the reserve's 30-second window


class Clock:
    """Wall time that a test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def said(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def batch(gw: Gateway, text: str) -> Answer:
    return await gw.post(
        "/v1/chat/completions",
        {"model": "m", "messages": said(text), "max_tokens": 8},
        headers={"x-llmgw-priority": "batch"},
    )


def at_engine(engine: MockEngine) -> list[str]:
    return [str(seen.body["messages"][0]["content"]) for seen in engine.seen]


@pytest.fixture
def clock(gw: Gateway) -> Clock:
    moved = Clock()
    gw.app.keeper.clock = moved
    return moved


async def test_batch_requests_leave_a_slot_to_the_interactive_one_seen_lately(
    gw: Gateway, engine: MockEngine, clock: Clock
) -> None:
    assert gw.endpoint.capacity == 2
    assert (await gw.chat(messages=said("I0"))).status == 200  # one interactive request in flight at once
    engine.gate = asyncio.Event()
    flood = [asyncio.create_task(batch(gw, f"B{i}")) for i in range(5)]
    await until(lambda: gw.app.admission.queue.waiting("m") == 4)
    await until(lambda: len(engine.seen) == 2)
    assert held(gw.endpoint) == 1  # one of the two slots is kept for interactive requests
    assert REGISTRY.get_sample_value("llmgw_interactive_reserve", {"model": "m"}) == 1

    interactive = asyncio.create_task(gw.chat(messages=said("I1")))
    await until(lambda: len(engine.seen) == 3)
    assert at_engine(engine)[2] == "I1"  # past the four batch requests waiting
    assert gw.app.admission.queue.waiting("m") == 4
    engine.gate.set()
    answer = await interactive
    assert answer.status == 200 and answer.headers["x-llmgw-queue-ms"] == "0"
    assert [a.status for a in await asyncio.gather(*flood)] == [200] * 5


async def test_with_no_interactive_request_for_the_window_batch_takes_every_slot(
    gw: Gateway, engine: MockEngine, clock: Clock
) -> None:
    assert (await gw.chat(messages=said("I0"))).status == 200
    clock.now += WINDOW_PASSED
    engine.gate = asyncio.Event()
    flood = [asyncio.create_task(batch(gw, f"B{i}")) for i in range(5)]
    await until(lambda: gw.app.admission.queue.waiting("m") == 3)
    await until(lambda: len(engine.seen) == 3)
    assert held(gw.endpoint) == 2
    engine.gate.set()
    assert [a.status for a in await asyncio.gather(*flood)] == [200] * 5


async def test_a_batch_request_held_back_by_the_reserve_is_told_so_with_the_numbers(
    gw: Gateway, engine: MockEngine, clock: Clock
) -> None:
    assert (await gw.chat(messages=said("I0"))).status == 200
    gw.app.admission.timeouts = (gw.app.admission.timeouts[0], 0.3)
    engine.gate = asyncio.Event()
    first = asyncio.create_task(batch(gw, "B0"))
    await until(lambda: len(engine.seen) == 2)
    async with asyncio.timeout(WAIT):  # (without the reserve it would take the other slot and hang at the engine)
        refused = await batch(gw, "B1")
    assert refused.status == 503
    message = refused.json["error"]["message"]
    assert "1 of the 2 slots of “m” are kept for interactive requests (peak 1 in the last 30 s)" in message
    assert "waiting in the batch band" in message
    engine.gate.set()
    assert (await first).status == 200


async def test_two_interactive_requests_at_once_keep_two_slots_but_never_the_last_one(
    gw: Gateway, engine: MockEngine, clock: Clock
) -> None:
    gw.endpoint.capacity = 3
    engine.gate = asyncio.Event()
    both = [asyncio.create_task(gw.chat(messages=said(f"I{i}"))) for i in range(2)]
    await until(lambda: len(engine.seen) == 2)
    engine.gate.set()
    assert [a.status for a in await asyncio.gather(*both)] == [200, 200]
    engine.gate = asyncio.Event()
    flood = [asyncio.create_task(batch(gw, f"B{i}")) for i in range(4)]
    await until(lambda: gw.app.admission.queue.waiting("m") == 3)
    await until(lambda: len(engine.seen) == 3)
    assert held(gw.endpoint) == 1  # peak 2 of 3 slots: two kept, one for batch

    gw.endpoint.capacity = 2  # peak 2 of 2 slots: the reserve is at most one, batch keeps the other
    engine.gate.set()
    assert [a.status for a in await asyncio.gather(*flood)] == [200] * 4


# Two processes sharing the slots through Redis ----------------------------------------------------------

shared = pytest.mark.skipif(not REDIS_URL, reason="shared slots are counted in Redis; this run has none")


@pytest.fixture
async def pair(processes: Callable[..., Process]) -> AsyncIterator[tuple[Process, Process, Clock]]:
    a, b = processes(), processes()
    moved = Clock()
    a.keeper.clock = b.keeper.clock = moved
    yield a, b, moved


@shared
async def test_every_process_keeps_the_reserve_of_interactive_requests_seen_in_another(
    pair: tuple[Process, Process, Clock],
) -> None:
    web, worker, clock = pair
    target = [upstream(capacity=2)]
    seen = await web.keeper.acquire(target, None, queue="m", band=INTERACTIVE)
    assert seen is not None
    await web.keeper.give_back(seen)

    first = await worker.keeper.acquire(target, None, queue="m", band=BATCH)
    assert first is not None
    with pytest.raises(Reserved) as kept:
        await worker.keeper.acquire(target, None, queue="m", band=BATCH)
    assert str(kept.value) == "1 of 2 slots kept for interactive requests (peak 1 in the last 30 s)"
    waiting = await worker.enter(9, band=BATCH)
    with pytest.raises(Reserved):
        await worker.keeper.acquire(target, None, queue="m", ticket=waiting, band=BATCH)

    # An interactive request passes the batch request the reserve holds back, at once.
    interactive = await web.keeper.acquire(target, None, queue="m", band=INTERACTIVE)
    assert interactive is not None
    await web.keeper.give_back(interactive)

    clock.now += WINDOW_PASSED  # no interactive request since: the batch request takes the slot
    second = await worker.keeper.acquire(target, None, queue="m", ticket=waiting, band=BATCH)
    assert second is not None
    for lease in (first, second):
        await worker.keeper.give_back(lease)


@shared
async def test_a_batch_turn_held_back_by_the_reserve_goes_to_the_interactive_ticket_behind_it(
    pair: tuple[Process, Process, Clock],
) -> None:
    web, worker, _clock = pair
    target = [upstream(capacity=3)]
    seen = await web.keeper.acquire(target, None, queue="m", band=INTERACTIVE)
    assert seen is not None
    await web.keeper.give_back(seen)
    batches = [await worker.keeper.acquire(target, None, queue="m", band=BATCH) for _ in range(2)]
    waiting = await worker.enter(9, band=BATCH, most=10)
    first = await web.enter(1, most=10)
    taken = await web.keeper.acquire(target, None, queue="m", ticket=first, band=INTERACTIVE, batch_every=2)
    assert taken is not None  # an interactive grant while a batch request waited: the next turn is batch's
    second = await web.enter(1, most=10)
    await web.keeper.give_back(taken)
    # The batch request may not take the free slot (the reserve keeps it), so it is not its turn.
    with pytest.raises(Reserved):
        await worker.keeper.acquire(target, None, queue="m", ticket=waiting, band=BATCH, batch_every=2)
    lease = await web.keeper.acquire(target, None, queue="m", ticket=second, band=INTERACTIVE, batch_every=2)
    assert lease is not None
    await web.keeper.give_back(lease)
    for held_lease in batches:
        assert held_lease is not None
        await worker.keeper.give_back(held_lease)
    await worker.shared.leave("m", waiting, 9, 100.0)
