"""Every line answered exactly once, and every try's usage recorded once, whatever fails on the way:
a replica that dies mid-answer (the line is tried again, on another replica), one that keeps failing
(bounded tries, then an error line saying why), and a process that died after a try was answered but
before its answer was written (the line is run again by another process under the same request id:
its usage is not counted twice). The process's death is played here (its lease runs out, its rows
stay as it left them); no process is killed for real."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from apps.batches import services
from apps.batches.models import BatchLine
from apps.batches.runner import _Capture, _receive, _scope
from tests.batches.harness import WAIT, World, chat_line, db, make_batch
from tests.gateway.harness import endpoint
from tests.gateway.mock_engine import MockEngine


async def create(world: World, lines: list[dict[str, Any]]) -> Any:
    return await world.openai().batches.create(
        input_file_id=(await world.upload(lines)).id, endpoint="/v1/chat/completions", completion_window="24h"
    )


async def output_of(world: World, file_id: str) -> list[dict[str, Any]]:
    content = (await world.openai().files.content(file_id)).content
    return [json.loads(line) for line in content.splitlines()]


async def test_a_line_whose_replica_died_mid_answer_is_tried_again_elsewhere(world: World) -> None:
    dying = world.engine
    dying.replies.clear()
    dying.mode = "die"  # it sends a few bytes, then its connection drops
    other = await MockEngine().start()
    other.replies["m"] = lambda body: "from the other replica"
    try:
        batch = await create(world, [chat_line("only")])
        async with asyncio.timeout(WAIT):
            while not dying.seen:
                await asyncio.sleep(0.01)
        await dying.stop()  # the replica is gone; another one serves the model
        world.model.upstreams.append(endpoint(other.url, "2"))
        done = await world.ended(batch.id)
    finally:
        await other.stop()
    assert done.status == "completed" and done.request_counts.completed == 1
    [entry] = await output_of(world, done.output_file_id)
    assert entry["response"]["body"]["choices"][0]["message"]["content"] == "from the other replica"
    line = await db(lambda: BatchLine.objects.get(batch_id=batch.id))
    assert (line.tries, line.failures) == (2, 1)
    records = await world.usage(batch.id, 2)
    assert sorted(r["status"] for r in records) == [200, 502]
    assert len({r["request_id"] for r in records}) == 2  # each try is its own request
    assert entry["response"]["request_id"] in {r["request_id"] for r in records if r["status"] == 200}


async def test_a_line_that_keeps_failing_is_an_error_line_saying_why(world: World) -> None:
    world.engine.replies.clear()
    world.engine.mode = "error"
    world.engine.error_status = 500
    world.engine.error_message = "the engine fell over"
    batch = await create(world, [chat_line("doomed"), chat_line("also")])
    done = await world.ended(batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (0, 2)
    entries = await output_of(world, done.error_file_id)
    attempts = settings.BATCH_LINE_ATTEMPTS
    for entry in entries:
        assert entry["response"]["status_code"] == 500
        message = entry["response"]["body"]["error"]["message"]
        assert message.endswith(f"(tried {attempts} times, each failed)") and "the engine fell over" in message
    assert len(world.engine.seen) == 2 * attempts
    assert len(await world.usage(batch.id, 2 * attempts)) == 2 * attempts


async def test_a_try_run_again_after_its_process_died_is_recorded_once(world: World) -> None:
    """A process ran a line and its answer came, then the process died before writing it: the line's
    lease runs out, another process runs it again with the same request id, and the usage writer
    keeps one record of it."""
    await world.runner.stop()  # the test plays the process that dies
    batch = await create(world, [chat_line("first"), chat_line("second")])
    await db(services.validate_batch, batch.id, "test")
    dead = await db(services.claim_lines, "dead-process", {"m": 10})
    assert [line.number for line in dead] == [1, 2]
    capture = _Capture(2**20)
    await world.app(_scope(dead[0]), _receive(dead[0], asyncio.Event()), capture.send)
    assert capture.status == 200  # answered, and recorded; never written to the line's row
    await world.usage(batch.id, 1)
    await db(lambda: BatchLine.objects.filter(batch_id=batch.id).update(lease_until=timezone.now()))

    world.runner.start()  # another process
    done = await world.ended(batch.id)
    assert done.status == "completed" and done.request_counts.completed == 2
    entries = await output_of(world, done.output_file_id)
    assert sorted(e["custom_id"] for e in entries) == ["first", "second"]
    assert entries[0]["response"]["request_id"] == dead[0].request_id  # the same try, the same id
    await asyncio.sleep(1.0)  # the writer's interval, twice: a second record would be written by now
    records = await world.usage(batch.id, 2)
    assert len(records) == 2 and len({r["request_id"] for r in records}) == 2
    assert len(world.engine.seen) == 3  # the first line was run twice, counted once


@pytest.mark.django_db(transaction=True)
def test_an_answer_from_a_process_that_lost_its_lease_is_not_written() -> None:
    """A process stalled past its lease: the line was taken over, and the stalled one's late answer
    changes nothing (the line and the batch's counts are the new holder's)."""
    from tests.batches.harness import make_tenant

    batch = make_batch(make_tenant("stella"), "batch_stall", total=1, succeeded=0, failed=0)
    BatchLine.objects.create(batch=batch, number=1, custom_id="a", model="m", body={"model": "m"})
    [slow] = services.claim_lines("slow", {"m": 1})
    BatchLine.objects.filter(pk=slow.id).update(lease_until=timezone.now())
    [fast] = services.claim_lines("fast", {"m": 1})
    ok = services.Outcome(fast, status_code=200, response={"choices": []}, prompt_tokens=1, completion_tokens=1)
    assert services.finish_lines("fast", [ok])["succeeded"] == 1
    late = services.Outcome(slow, status_code=500, response={"error": {"message": "late"}})
    assert services.finish_lines("slow", [late]) == {}
    batch.refresh_from_db()
    assert (batch.succeeded, batch.failed, batch.prompt_tokens) == (1, 0, 1)
    assert BatchLine.objects.get(batch=batch).status_code == 200


@pytest.mark.django_db(transaction=True)
def test_the_tries_tally_on_metrics_counts_what_every_process_wrote_once() -> None:
    """llmgw_batch_lines_total is read from the database: the tries a worker wrote show on any web
    process's /metrics, a try whose writer lost its lease counts nowhere, and a status no try ended
    with is absent rather than 0."""
    from llmgw.metrics import database_metrics
    from tests.batches.harness import make_tenant

    def tally() -> dict[str, float]:
        found = re.findall(r'^llmgw_batch_lines_total\{status="(\w+)"\} (\S+)$', database_metrics().decode(), re.M)
        return {status: float(count) for status, count in found}

    batch = make_batch(make_tenant("tess"), "batch_tally", total=3, succeeded=0, failed=0)
    for number in (1, 2, 3):
        BatchLine.objects.create(batch=batch, number=number, custom_id=f"c{number}", model="m", body={"model": "m"})
    assert tally() == {}
    first, second, third = services.claim_lines("worker:1", {"m": 3})
    services.finish_lines(
        "worker:1",
        [
            services.Outcome(first, status_code=200, response={"choices": []}, prompt_tokens=1, completion_tokens=1),
            services.Outcome(second, status_code=400, response={"error": {"message": "bad"}}),
            services.Outcome(third, retry=True, yielded=True),
        ],
    )
    assert tally() == {"succeeded": 1.0, "failed": 1.0, "retried": 1.0, "yielded": 1.0}
    [again] = services.claim_lines("worker:2", {"m": 1})
    ok = services.Outcome(again, status_code=200, response={"choices": []}, prompt_tokens=1, completion_tokens=1)
    assert services.finish_lines("worker:1", [ok]) == {}  # not its lease any more: nothing written
    services.finish_lines("worker:2", [ok])
    assert tally() == {"succeeded": 2.0, "failed": 1.0, "retried": 1.0, "yielded": 1.0}
