"""Each usage record carries how long its request waited for a slot: 0 for a free one, the wait it
said in `x-llmgw-queue-ms` for one that queued, and None for a request refused before it asked."""

from __future__ import annotations

import asyncio

from apps.quotas.limiter import Refusal
from tests.gateway.harness import OTHER_KEY, WAIT, Gateway, entry, until
from tests.gateway.mock_engine import MockEngine


async def test_the_record_says_how_long_each_request_waited_for_its_slot(gw: Gateway, engine: MockEngine) -> None:
    gw.endpoint.capacity = 1
    engine.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat())
    async with asyncio.timeout(WAIT):
        await engine.arrived.wait()
    second = asyncio.create_task(gw.chat())
    await until(lambda: gw.app.admission.queue.waiting("m") == 1)
    engine.gate.set()
    answers = await asyncio.gather(first, second)
    assert [a.status for a in answers] == [200, 200]
    records = {r["request_id"]: r for r in [await gw.usage.wait(1), await gw.usage.wait(2)]}
    took, waited = (records[a.headers["x-llmgw-request-id"]] for a in answers)
    assert took["queue_ms"] == 0.0 and answers[0].headers["x-llmgw-queue-ms"] == "0"
    assert waited["queue_ms"] > 0
    assert round(waited["queue_ms"]) == int(answers[1].headers["x-llmgw-queue-ms"])


async def test_a_request_refused_by_a_limit_never_waited_and_its_wait_is_unknown(gw: Gateway) -> None:
    gw.set_key(OTHER_KEY, entry(2, limits=("key:2",)))
    gw.limiter.refusal = Refusal("requests per minute", "key:2", "key “test”", used=5, allowed=5, retry_after_s=7)
    assert (await gw.chat(key=OTHER_KEY)).status == 429
    record = await gw.usage.wait()
    assert "queue_ms" in record and record["queue_ms"] is None
