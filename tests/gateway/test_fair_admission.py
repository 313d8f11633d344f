"""The fair queue through the gateway (a real ASGI app, clients over HTTP, a mock engine that holds
each request until told): whose request takes a slot that frees, in which band, and what the
answers say about it."""

from __future__ import annotations

import asyncio

from tests.gateway.harness import OTHER_KEY, Gateway, entry, until
from tests.gateway.mock_engine import MockEngine


def said(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def fill(gw: Gateway, engine: MockEngine, flood: int) -> tuple[asyncio.Event, list[asyncio.Task]]:
    """One slot, held by the first of `flood` requests of the default key; the rest wait."""
    gw.endpoint.capacity = 1
    gate = engine.gate = asyncio.Event()
    tasks = [asyncio.create_task(gw.chat(messages=said(f"A{i}"), max_tokens=50)) for i in range(flood)]
    await until(lambda: gw.app.admission.queue.waiting("m") == flood - 1)
    return gate, tasks


async def next_at_engine(gw: Gateway, engine: MockEngine, gate: asyncio.Event) -> str:
    """Let the request at the engine finish; what the next one to reach it said."""
    seen = len(engine.seen)
    engine.gate = asyncio.Event()
    gate.set()
    await until(lambda: len(engine.seen) > seen)
    return str(engine.seen[seen].body["messages"][0]["content"])


async def test_a_light_keys_request_takes_the_next_free_slot_ahead_of_a_flood(gw: Gateway, engine: MockEngine) -> None:
    gw.set_key(OTHER_KEY, entry(2, team_id=31, project_id=21))
    gate, flood = await fill(gw, engine, 6)
    light = asyncio.create_task(gw.chat(key=OTHER_KEY, messages=said("B"), max_tokens=4))
    await until(lambda: gw.app.admission.queue.waiting("m") == 6)
    assert await next_at_engine(gw, engine, gate) == "B"
    engine.gate.set()
    answers = await asyncio.gather(light, *flood)
    assert all(a.status == 200 for a in answers)
    assert int(answers[0].headers["x-llmgw-queue-ms"]) >= 0 and answers[0].headers["x-llmgw-priority"] == "interactive"
    assert gw.app.admission.queue.waiting("m") == 0


async def test_a_batch_request_waits_behind_interactive_ones_but_not_for_ever(gw: Gateway, engine: MockEngine) -> None:
    gw.set_key(OTHER_KEY, entry(2, team_id=31, project_id=21))
    gate, flood = await fill(gw, engine, 12)
    batch = asyncio.create_task(
        gw.post(
            "/v1/chat/completions",
            {"model": "m", "messages": said("B")},
            key=OTHER_KEY,
            headers={"x-llmgw-priority": "batch"},
        )
    )
    await until(lambda: gw.app.admission.queue.waiting("m") == 12)
    order = []
    for _ in range(10):
        order.append(await next_at_engine(gw, engine, gate))
        gate = engine.gate
    assert "B" in order and order.index("B") <= 9  # one grant in ten goes to the batch band
    engine.gate.set()
    answers = await asyncio.gather(batch, *flood)
    assert answers[0].headers["x-llmgw-priority"] == "batch"


async def test_a_key_limited_to_batch_asking_interactive_is_served_in_batch_and_told(gw: Gateway) -> None:
    gw.set_key(OTHER_KEY, entry(2, ceiling=1))
    answer = await gw.chat(key=OTHER_KEY)
    assert answer.status == 200
    assert answer.headers["x-llmgw-priority"] == "batch; asked interactive, the most this key may use is batch"


async def test_a_band_that_does_not_exist_is_refused_naming_the_bands(gw: Gateway) -> None:
    answer = await gw.post(
        "/v1/chat/completions",
        {"model": "m", "messages": said("hi")},
        headers={"x-llmgw-priority": "urgent"},
    )
    assert answer.status == 400
    assert answer.json["error"]["code"] == "invalid_priority"
    assert "the bands are interactive and batch" in answer.json["error"]["message"]
    flex = await gw.chat(service_tier="flex")
    assert flex.status == 200 and flex.headers["x-llmgw-priority"] == "batch"
