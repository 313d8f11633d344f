"""The OpenAI Files and Batches APIs through the official SDK, as its documentation uses them:
files.create, batches.create / retrieve / list / cancel, files.content."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest

from apps.batches.models import Batch, BatchLine
from tests.batches.harness import WAIT, World, chat_line, db


def jsonl(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.splitlines() if line.strip()]


async def test_a_batch_runs_every_line_once_and_its_output_answers_each_custom_id(world: World) -> None:
    client = world.openai()
    lines = [chat_line(f"request-{i}", f"question {i}") for i in range(1, 21)]
    uploaded = await world.upload(lines)
    assert uploaded.purpose == "batch" and uploaded.bytes > 0 and uploaded.filename == "input.jsonl"
    assert uploaded.id.startswith("file-")

    batch = await client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.id.startswith("batch_") and batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = await world.ended(batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (20, 20, 0)
    assert done.error_file_id is None and done.output_file_id is not None
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.model == "m"
    assert done.usage is not None and done.usage.input_tokens == 20 * 7 and done.usage.output_tokens == 20 * 2

    output = jsonl((await client.files.content(done.output_file_id)).content)
    assert sorted(entry["custom_id"] for entry in output) == sorted(line["custom_id"] for line in lines)
    for entry in output:
        number = entry["custom_id"].split("-")[1]
        assert entry["error"] is None and entry["id"].startswith("batch_req_")
        assert entry["response"]["status_code"] == 200
        assert entry["response"]["body"]["choices"][0]["message"]["content"] == f"echo: question {number}"

    # Every line is one usage record of the batch, each with its own request id, in the batch band.
    records = await world.usage(batch.id, 20)
    assert len(records) == 20 and {r["status"] for r in records} == {200}
    assert {r["request_id"] for r in records} == {e["response"]["request_id"] for e in output}

    listed = [b.id async for b in client.batches.list()]
    assert batch.id in listed
    output_file = await client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"


async def test_the_engine_is_asked_in_the_batch_band_as_the_key(world: World) -> None:
    """Each line reaches the engine as its body asks, and its record says whose it was."""
    batch = await world.openai().batches.create(
        input_file_id=(await world.upload([chat_line("only", "x", max_tokens=5)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    assert (await world.ended(batch.id)).status == "completed"
    [seen] = world.engine.seen
    assert seen.body["messages"] == [{"role": "user", "content": "x"}] and seen.body["max_tokens"] == 5
    [record] = await world.usage(batch.id, 1)
    assert record["api_key_id"] == world.a.key.pk and record["project_id"] == world.a.project.pk
    assert record["endpoint"] == "chat.completions" and record["queue_ms"] is not None


async def test_cancel_answers_the_lines_not_run_and_keeps_those_answered(world: World) -> None:
    client = world.openai()
    world.engine.gate = asyncio.Event()  # the engine holds every request until the test lets it go
    lines = [chat_line(f"c{i}") for i in range(10)]
    batch = await client.batches.create(
        input_file_id=(await world.upload(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    async with asyncio.timeout(WAIT):
        while len(world.engine.seen) < 2:  # both slots hold a line
            await asyncio.sleep(0.01)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    world.engine.gate.set()
    done = await world.ended(batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    counts = done.request_counts
    assert counts.total == 10 and counts.completed + counts.failed == 10 and counts.completed >= 2
    errors = jsonl((await client.files.content(done.error_file_id)).content)
    assert len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and all(e["response"] is None for e in errors)
    output = jsonl((await client.files.content(done.output_file_id)).content)
    assert len(output) == counts.completed
    assert sorted(e["custom_id"] for e in output + errors) == sorted(line["custom_id"] for line in lines)
    # A cancelled batch cannot be cancelled again: it says so.
    with pytest.raises(openai.ConflictError, match="Cannot cancel a batch that is cancelled"):
        await client.batches.cancel(batch.id)


async def test_lines_are_written_in_rows_and_each_is_answered_once(world: World) -> None:
    batch = await world.openai().batches.create(
        input_file_id=(await world.upload([chat_line(f"r{i}") for i in range(6)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    await world.ended(batch.id)
    rows = await db(lambda: list(BatchLine.objects.filter(batch_id=batch.id).values("state", "tries", "request_id")))
    assert [r["state"] for r in rows] == ["done"] * 6 and {r["tries"] for r in rows} == {1}
    stored = await db(lambda: Batch.objects.get(pk=batch.id))
    assert (stored.succeeded, stored.failed, stored.lines_without_tokens) == (6, 0, 0)


async def test_a_batch_past_its_window_expires_and_keeps_what_was_answered(world: World) -> None:
    client = world.openai()
    world.engine.gate = asyncio.Event()
    batch = await client.batches.create(
        input_file_id=(await world.upload([chat_line(f"e{i}") for i in range(5)])).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    async with asyncio.timeout(WAIT):
        while len(world.engine.seen) < 2:
            await asyncio.sleep(0.01)
    # Those waiting are let through; the rest wait for ever: the window runs out first.
    first, world.engine.gate = world.engine.gate, asyncio.Event()
    first.set()
    async with asyncio.timeout(WAIT):
        while (await db(lambda: Batch.objects.get(pk=batch.id))).succeeded < 2:
            await asyncio.sleep(0.01)
    from django.utils import timezone

    await db(lambda: Batch.objects.filter(pk=batch.id).update(expires_at=timezone.now()))
    done = await world.ended(batch.id)
    assert done.status == "expired" and done.expired_at is not None
    counts = done.request_counts
    assert counts.total == 5 and counts.completed >= 2 and counts.completed + counts.failed == 5
    errors = jsonl((await client.files.content(done.error_file_id)).content)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"} and len(errors) == counts.failed
    assert len(jsonl((await client.files.content(done.output_file_id)).content)) == counts.completed
