"""What a request costs the process beyond its own work: the usage writer's flushes, the token
charge, the table version poll, the fair queue's figure and the garbage collector."""

from __future__ import annotations

import gc
import os
import re
import time
import warnings
from typing import Any

import pytest

from apps.gateway import admission as admission_module
from apps.gateway.accounting import Accountant
from apps.gateway.intake import CHAT, Call, new_request_id
from apps.quotas.limiter import Headroom, Limit, MemoryLimiter
from apps.quotas.usage import UsageWriter
from tests.gateway.harness import KEY, Gateway, entry


def usage_record(n: int) -> dict[str, Any]:
    return {"request_id": f"req_{n}", "created_at": time.time(), "status": 200}


async def test_a_flush_writes_what_was_queued_when_it_began_not_what_came_while_it_wrote() -> None:
    """Records queued while a batch is written wait for the next flush: the writer does not chase
    them one or two at a time for as long as requests keep coming (each a broker message and its
    thread's hold on the interpreter lock, which every request then waited on)."""
    batches: list[int] = []
    writer: UsageWriter

    def write(batch: list[dict[str, Any]], *, touched: Any = None) -> int:
        batches.append(len(batch))
        writer.emit(usage_record(100 + len(batches)))  # a request ends while the batch is written
        return len(batch)

    writer = UsageWriter(write=write, interval=3600)
    for n in range(5):
        writer.emit(usage_record(n))
    assert await writer.flush()
    assert batches == [5]
    assert writer.pending == 1  # the record that came during the write: the next flush's
    assert await writer.flush()
    assert batches == [5, 1]


async def test_a_flush_on_stop_writes_everything_however_much_comes_meanwhile() -> None:
    batches: list[int] = []
    writer: UsageWriter

    def write(batch: list[dict[str, Any]], *, touched: Any = None) -> int:
        batches.append(len(batch))
        if len(batches) < 3:
            writer.emit(usage_record(100 + len(batches)))
        return len(batch)

    writer = UsageWriter(write=write, interval=3600, batch_size=2)
    for n in range(3):
        writer.emit(usage_record(n))
    assert await writer.flush(final=True)
    assert batches == [2, 2, 1]
    assert writer.pending == 0


async def test_the_tokens_are_charged_before_finish_returns() -> None:
    """The token charge is made in the same turn of the loop as the answer's last byte: a request
    the same key sends next finds the tokens counted, and nothing is left scheduled."""
    limiter = MemoryLimiter()
    limit = Limit(scope="key:1", label="key 1", tokens_per_minute=100)
    key = entry(limits=(limit,))
    usage: list[dict[str, Any]] = []

    class Usage:
        def emit(self, record: dict[str, Any]) -> None:
            usage.append(record)

    async def count(_call: Call) -> int | None:
        return None

    accountant = Accountant(usage=Usage(), limiter=limiter, known_model=lambda _m: True, count_prompt=count)
    call = Call(CHAT)
    call.entry, call.model, call.prompt_tokens, call.completion_tokens = key, "m", 30, 50
    accountant.finish(call)
    answer = await limiter.admit([limit], time.time())
    assert isinstance(answer, Headroom)
    assert answer.tokens is not None and answer.tokens.remaining == 20
    assert len(usage) == 1


async def test_a_request_reckons_its_fair_queue_cost_once(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slot's charge and the fair queue's charge take one figure, reckoned once per request."""
    counted: list[int] = []
    estimate = admission_module.estimate_prompt_tokens

    def counting(body: dict[str, Any]) -> int:
        counted.append(1)
        return estimate(body)

    monkeypatch.setattr(admission_module, "estimate_prompt_tokens", counting)
    answer = await gw.chat(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.status == 200
    assert len(counted) == 1


def test_request_ids_are_random_and_a_forked_child_draws_its_own() -> None:
    """Ids come from random bytes read a few kilobytes at a time; a child made by fork() reads its
    own rather than handing out the ones its parent is about to."""
    ids = [new_request_id() for _ in range(600)]  # past two reads of random bytes
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    assert len(Call(CHAT).request_id) == 36
    reading, writing = os.pipe()
    with warnings.catch_warnings():  # the test process has threads; the child only writes and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        child = os.fork()
    if child == 0:  # pragma: no cover - the child process
        os.write(writing, "".join(new_request_id() for _ in range(4)).encode())
        os._exit(0)
    os.close(writing)
    os.waitpid(child, 0)
    theirs = os.read(reading, 1000).decode()
    os.close(reading)
    ours = "".join(new_request_id() for _ in range(4))
    assert len(theirs) == len(ours) == 4 * 36
    assert set(theirs.split("req_")[1:]).isdisjoint(ours.split("req_")[1:])


async def test_a_keys_fairness_identity_is_made_once_per_entry(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whose request it is (fairness.Who) is made once per key entry, not twice per request; an entry
    the tables replace (its weights changed) gets its own."""
    made: list[Any] = []
    who = admission_module.Who

    def counting(*args: Any, **kwargs: Any) -> Any:
        made.append(args)
        return who(*args, **kwargs)

    monkeypatch.setattr(admission_module, "Who", counting)
    gw.app.admission._whos.clear()
    for _ in range(3):
        assert (await gw.chat(model="m", messages=[{"role": "user", "content": "hi"}])).status == 200
    assert len(made) == 1
    gw.set_key(KEY, entry(weights=(1, 1, 1, 5)))
    assert (await gw.chat(model="m", messages=[{"role": "user", "content": "hi"}])).status == 200
    assert len(made) == 2 and made[-1][-1] == (1, 1, 1, 5)


async def test_what_the_process_held_once_started_is_left_out_of_garbage_collections(gw: Gateway) -> None:
    assert gc.get_freeze_count() > 0


@pytest.mark.django_db
def test_the_table_version_is_read_from_its_row() -> None:
    from apps.gateway.models import TableVersion
    from apps.gateway.tables import current_version

    TableVersion.objects.filter(pk=1).delete()
    assert current_version() == 0
    TableVersion.objects.create(pk=1, version=41)
    assert current_version() == 41
    TableVersion.objects.filter(pk=1).update(version=42)
    assert current_version() == 42
