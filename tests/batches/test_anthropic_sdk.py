"""Anthropic Message Batches through the official SDK, as its documentation uses them:
messages.batches.create / retrieve / list / results / cancel / delete."""

from __future__ import annotations

import asyncio

import anthropic
import pytest

from tests.batches.harness import WAIT, World


def request(custom_id: str, text: str = "hello", **params: object) -> dict[str, object]:
    return {
        "custom_id": custom_id,
        "params": {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": text}], **params},
    }


async def test_a_message_batch_answers_each_request_once_in_its_results(world: World) -> None:
    client = world.anthropic()
    batch = await client.messages.batches.create(requests=[request(f"q-{i}", f"question {i}") for i in range(8)])
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 8 and batch.request_counts.succeeded == 0

    ended = await world.message_batch_ended(batch.id)
    assert ended.ended_at is not None and ended.results_url.endswith(f"/v1/messages/batches/{batch.id}/results")
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 8, 0, 0, 0)

    results = [entry async for entry in await client.messages.batches.results(batch.id)]
    assert sorted(r.custom_id for r in results) == sorted(f"q-{i}" for i in range(8))
    for entry in results:
        assert entry.result.type == "succeeded"
        number = entry.custom_id.split("-")[1]
        assert entry.result.message.content[0].text == f"echo: question {number}"
        assert entry.result.message.usage.input_tokens == 7

    listed = [b.id async for b in client.messages.batches.list(limit=10)]
    assert batch.id in listed
    records = await world.usage(batch.id, 8)
    assert {r["endpoint"] for r in records} == {"messages"} and len({r["request_id"] for r in records}) == 8


async def test_cancel_then_delete(world: World) -> None:
    client = world.anthropic()
    world.engine.gate = asyncio.Event()
    batch = await client.messages.batches.create(requests=[request(f"c-{i}") for i in range(6)])
    async with asyncio.timeout(WAIT):
        while len(world.engine.seen) < 2:
            await asyncio.sleep(0.01)
    with pytest.raises(anthropic.BadRequestError, match="still in_progress"):
        await client.messages.batches.delete(batch.id)  # only an ended batch may be deleted
    canceling = await client.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    world.engine.gate.set()
    ended = await world.message_batch_ended(batch.id)
    counts = ended.request_counts
    assert counts.succeeded + counts.canceled == 6 and counts.canceled >= 1 and counts.errored == 0
    results = {r.custom_id: r.result.type async for r in await client.messages.batches.results(batch.id)}
    assert len(results) == 6 and set(results.values()) <= {"succeeded", "canceled"}

    deleted = await client.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.batches.retrieve(batch.id)


async def test_a_request_that_fails_alone_is_errored_and_the_rest_succeed(world: World) -> None:
    client = world.anthropic()
    batch = await client.messages.batches.create(
        requests=[request("good"), request("streams", stream=True), request("other-model", model="not-mine")]
    )
    ended = await world.message_batch_ended(batch.id)
    assert ended.request_counts.succeeded == 1 and ended.request_counts.errored == 2
    results = {r.custom_id: r.result async for r in await client.messages.batches.results(batch.id)}
    assert results["good"].type == "succeeded"
    assert results["streams"].type == "errored" and "stream" in results["streams"].error.error.message
    assert results["other-model"].type == "errored"
    assert results["other-model"].error.error.type == "not_found_error"
    assert "not-mine" in results["other-model"].error.error.message


async def test_duplicate_custom_ids_and_a_malformed_body_refuse_the_call(world: World) -> None:
    client = world.anthropic()
    with pytest.raises(anthropic.BadRequestError, match="used by an earlier request"):
        await client.messages.batches.create(requests=[request("same"), request("same")])
    with pytest.raises(anthropic.BadRequestError, match="letters, digits, hyphens or underscores"):
        await client.messages.batches.create(requests=[request("has space")])
    with pytest.raises(anthropic.BadRequestError, match="at least one request"):
        await client.messages.batches.create(requests=[])
    assert [b async for b in client.messages.batches.list()] == []
