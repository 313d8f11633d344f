"""A batch runs from idle capacity: its lines never hold a model's slots while an interactive request
waits for one. The batch's lines here never end on their own (the engine holds each until its client
leaves), so an interactive request could only be answered if the runner gives its slot up.

The interactive request's time to first token alone and beside the batch are printed (what
bench/batches.py measures on real engines); nothing is asserted about times."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from apps.batches.choices import LineState
from apps.batches.models import Batch, BatchLine
from apps.gateway.fairness import BATCH
from apps.gateway.slots import RESERVE_WINDOW_S
from apps.quotas.models import UsageRecord
from tests.batches.harness import WAIT, World, chat_line, db


async def first_token_s(world: World, session: aiohttp.ClientSession) -> float:
    """An interactive streamed chat: seconds until its first chunk came."""
    body = {"model": "m", "messages": [{"role": "user", "content": "quick"}], "stream": True}
    headers = {"Authorization": f"Bearer {world.a.secret}"}
    started = time.perf_counter()
    async with session.post(f"{world.url}/v1/chat/completions", json=body, headers=headers) as answer:
        assert answer.status == 200, await answer.text()
        await answer.content.readany()
        first = time.perf_counter() - started
        await answer.read()
    return first


async def test_an_interactive_request_takes_a_slot_the_batch_holds_and_the_batch_goes_on(world: World) -> None:
    world.engine.replies.clear()  # each request answers as its "mock" field says: the batch's lines hang
    async with aiohttp.ClientSession() as session:
        alone = await first_token_s(world, session)
        # That request was more than the interactive reserve's window ago: no slot is kept for
        # interactive requests, and the batch's lines take both.
        world.app.keeper.clock = lambda: time.time() + RESERVE_WINDOW_S + 1
        lines = [chat_line(f"hold-{i}", mock="hang") for i in range(4)]
        batch = await world.openai().batches.create(
            input_file_id=(await world.upload(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with asyncio.timeout(WAIT):
            while world.engine.active < 2:  # both slots of the model hold a batch line
                await asyncio.sleep(0.01)
        world.engine.closed.clear()
        beside = await asyncio.wait_for(first_token_s(world, session), WAIT)
        world.app.keeper.clock = lambda: time.time() + 2 * (RESERVE_WINDOW_S + 1)  # and so is this one
    print(f"\ninteractive time to first token: alone {alone * 1000:.1f} ms, beside the batch {beside * 1000:.1f} ms")
    assert world.engine.closed.is_set()  # a batch line's request to the engine was cut off for it
    assert world.runner.yielded >= 1

    # The batch goes on: its slots are taken again, and the line that gave way is pending or running
    # again, not failed; its cut try is recorded as any cancelled request (499) under its own id.
    async with asyncio.timeout(WAIT):
        while world.engine.active < 2:
            await asyncio.sleep(0.01)

    # How a try ended is written behind, a batch of outcomes at a time (apps/batches/runner.py): the
    # slot can be taken again before the cut try is on its row, so its row is waited for.
    def lines() -> list[dict[str, int]]:
        return list(BatchLine.objects.filter(batch_id=batch.id).values("state", "tries", "failures"))

    async with asyncio.timeout(WAIT):
        rows = await db(lines)
        while sum(r["tries"] for r in rows) < 1:
            await asyncio.sleep(0.05)
            rows = await db(lines)
    stored = await db(lambda: Batch.objects.get(pk=batch.id))
    assert stored.status == "in_progress" and stored.failed == 0
    assert {r["state"] for r in rows} <= {LineState.PENDING, LineState.RUNNING}
    assert {r["failures"] for r in rows} == {0}
    async with asyncio.timeout(WAIT):
        while not await db(lambda: UsageRecord.objects.filter(batch=batch.id, status=499).exists()):
            await asyncio.sleep(0.1)


async def test_a_batch_leaves_a_slot_to_the_interactive_requests_seen_lately(world: World) -> None:
    """An interactive request came a moment ago: the batch's lines take one slot of two, and the
    next interactive request takes the other at once, with no line cut off for it."""
    world.engine.replies.clear()
    async with aiohttp.ClientSession() as session:
        await first_token_s(world, session)
        lines = [chat_line(f"hold-{i}", mock="hang") for i in range(4)]
        await world.openai().batches.create(
            input_file_id=(await world.upload(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        async with asyncio.timeout(WAIT):
            # A line waits, held back by the reserve, and the line that took the other slot has
            # reached the engine (its slot is taken before its request is sent).
            while world.app.admission.queue.waiting("m", BATCH) < 1 or world.engine.active < 1:
                await asyncio.sleep(0.01)
        assert world.engine.active == 1
        await asyncio.wait_for(first_token_s(world, session), WAIT)
    assert world.runner.yielded == 0 and not world.engine.closed.is_set()


async def test_no_line_starts_while_an_interactive_request_waits(world: World) -> None:
    """With the model's slots all taken by interactive requests and another waiting, a batch's lines
    wait too: the interactive one is served first."""
    world.engine.gate = asyncio.Event()
    headers = {"Authorization": f"Bearer {world.a.secret}"}
    body = {"model": "m", "messages": [{"role": "user", "content": "interactive"}]}
    async with aiohttp.ClientSession() as session:

        async def ask() -> int:
            async with session.post(f"{world.url}/v1/chat/completions", json=body, headers=headers) as answer:
                return answer.status

        asking = [asyncio.create_task(ask()) for _ in range(3)]  # two take the slots, one waits
        async with asyncio.timeout(WAIT):
            while world.app.admission.queue.waiting("m") < 1:
                await asyncio.sleep(0.01)
        batch = await world.openai().batches.create(
            input_file_id=(await world.upload([chat_line("later")])).id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        world.engine.gate.set()
        assert await asyncio.gather(*asking) == [200, 200, 200]
    assert (await world.ended(batch.id)).status == "completed"
    contents = [s.body["messages"][0]["content"] for s in world.engine.seen]
    assert contents.index("hello") == 3  # the batch's line reached the engine after all three
