"""Usage records: the batching writer, rollups, percentiles and unknown token counts."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from django.db import OperationalError, connection
from django.test.utils import CaptureQueriesContext

from apps.accounts.models import ApiKey
from apps.quotas import histograms, selectors
from apps.quotas.models import UsageRecord, UsageRollup
from apps.quotas.usage import USAGE_DROPPED, UsageWriter, write_records_sync
from tests.quotas.conftest import make_key, recent_minute, record


def summary(user: Any, group_by: str = "model", **kwargs: Any) -> list[selectors.UsageRow]:
    until = kwargs.pop("until", datetime.now(UTC))
    since = kwargs.pop("since", until - timedelta(hours=1))
    return selectors.usage_summary(user, group_by=group_by, since=since, until=until, **kwargs)


def dropped(reason: str) -> float:
    return USAGE_DROPPED.labels(reason)._value.get()


class SpyWrite:
    """Writes like the real writer and notes each batch and its INSERTs into the record table."""

    def __init__(self, fail_times: int = 0, error: Exception | None = None) -> None:
        self.batches: list[int] = []
        self.inserts: list[int] = []
        self.fail_times = fail_times
        self.error = error or OperationalError("the database went away")

    def __call__(self, batch: list[dict[str, Any]], *, touched: Any = None) -> int:
        self.batches.append(len(batch))
        if self.fail_times:
            self.fail_times -= 1
            raise self.error
        with CaptureQueriesContext(connection) as queries:
            written = write_records_sync(batch, touched=touched)
        self.inserts.append(sum('INSERT INTO "quotas_usagerecord"' in q["sql"] for q in queries.captured_queries))
        return written


# Writing records and rollups ----------------------------------------------------------------


@pytest.mark.django_db
def test_records_are_stored_with_minute_and_hour_rollups(alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    assert write_records_sync([record(key), record(key, status=503, error="upstream timed out", total_ms=None)]) == 2
    stored = UsageRecord.objects.get(request_id__isnull=False, status=503)
    assert (stored.api_key_id, stored.team_id, stored.organization_id) == (key.pk, tree.team.pk, tree.org.pk)
    rollups = {r.period: r for r in UsageRollup.objects.all()}
    assert set(rollups) == {"minute", "hour"}
    minute = rollups["minute"]
    assert minute.bucket_start == recent_minute()
    assert rollups["hour"].bucket_start == recent_minute().replace(minute=0)
    assert (minute.requests, minute.errors, minute.refusals) == (2, 1, 0)
    assert (minute.prompt_tokens, minute.completion_tokens) == (20, 40)
    assert (minute.api_key_id, minute.user_id, minute.project_id) == (key.pk, bob.pk, tree.project.pk)
    assert histograms.count(minute.latency_hist) == 1  # the failed request was never timed
    assert histograms.count(minute.first_token_hist) == 2
    assert minute.client_errors == 0


@pytest.mark.django_db
def test_rollups_add_up_across_batches(bob, tree) -> None:
    key = make_key(bob, tree.project)
    write_records_sync([record(key, total_ms=5.0), record(key, total_ms=15.0)])
    write_records_sync(
        [record(key, total_ms=30.0), record(key, status=429, total_ms=1.0, prompt_tokens=0, completion_tokens=0)]
    )
    minute = UsageRollup.objects.get(period="minute")
    assert (minute.requests, minute.refusals, minute.errors) == (4, 1, 0)
    assert (minute.prompt_tokens, minute.completion_tokens) == (30, 60)
    assert histograms.count(minute.latency_hist) == 3  # the 429 is not timed
    assert UsageRollup.objects.get(period="hour").requests == 4


@pytest.mark.django_db
def test_percentiles_from_rollups_are_the_nearest_rank_ones_within_one_percent(alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    # Two batches and two minutes, so the sketches are merged on write and on read.
    write_records_sync([record(key, total_ms=5.0), record(key, total_ms=15.0)])
    write_records_sync(
        [
            record(key, total_ms=30.0, created_at=recent_minute(3)),
            record(key, total_ms=200.0, created_at=recent_minute(3)),
        ]
    )
    (row,) = summary(alice)
    # Nearest-rank of four: p50 is the 2nd, p95 and p99 the 4th.
    assert row.latency_ms_p50 == pytest.approx(15.0, rel=0.01)
    assert row.latency_ms_p95 == pytest.approx(200.0, rel=0.01)
    assert row.latency_ms_p99 == pytest.approx(200.0, rel=0.01)
    assert row.first_token_ms_p50 == pytest.approx(40.0, rel=0.01)  # four values at 40 ms
    hour = summary(alice, since=datetime.now(UTC) - timedelta(hours=12))
    assert hour[0].latency_ms_p95 == row.latency_ms_p95  # the hour rollups say the same


@pytest.mark.django_db
def test_client_errors_server_errors_and_refusals_are_counted_apart(alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    statuses = [
        (200, ""),
        (200, "the engine closed the stream"),
        (500, "boom"),
        (502, "unreachable"),
        (503, "busy"),
        (400, "bad body"),
        (403, "not this model"),
        (404, "no such model"),
        (413, "too big"),
        (499, "the client went away"),
        (429, "over its limit"),
    ]
    write_records_sync([record(key, status=status, error=error) for status, error in statuses])
    minute = UsageRollup.objects.get(period="minute")
    assert (minute.requests, minute.errors, minute.client_errors, minute.refusals) == (11, 4, 5, 1)
    (row,) = summary(alice)
    assert (row.requests, row.server_errors, row.errors, row.client_errors, row.refusals) == (11, 4, 4, 5, 1)


@pytest.mark.django_db
def test_unknown_token_counts_stay_unknown(alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    write_records_sync(
        [
            record(key, model="a", prompt_tokens=None, completion_tokens=None),
            record(key, model="b", prompt_tokens=None, completion_tokens=None),
            record(key, model="b", prompt_tokens=7, completion_tokens=3),
        ]
    )
    stored = UsageRecord.objects.filter(model="a").get()
    assert stored.prompt_tokens is None and stored.completion_tokens is None
    rows = {row.group: row for row in summary(alice)}
    assert (rows["a"].prompt_tokens, rows["a"].completion_tokens, rows["a"].requests_without_tokens) == (None, None, 1)
    assert (rows["b"].prompt_tokens, rows["b"].completion_tokens, rows["b"].requests_without_tokens) == (7, 3, 1)


@pytest.mark.django_db
def test_a_group_with_nothing_timed_has_no_percentiles(alice, bob, tree) -> None:
    key = make_key(bob, tree.project)
    write_records_sync([record(key, status=429, first_token_ms=None, total_ms=None)])
    (row,) = summary(alice)
    assert row.refusals == 1
    assert row.latency_ms_p50 is None and row.first_token_ms_p99 is None


@pytest.mark.django_db
def test_a_retried_batch_is_not_counted_twice(bob, tree) -> None:
    key = make_key(bob, tree.project)
    batch = [record(key), record(key)]
    assert write_records_sync(batch) == 2
    assert write_records_sync([*batch, record(key)]) == 1
    assert UsageRecord.objects.count() == 3
    assert UsageRollup.objects.get(period="minute").requests == 3


@pytest.mark.django_db
def test_a_deleted_key_is_left_out_rather_than_failing_the_batch(bob, tree) -> None:
    key = make_key(bob, tree.project)
    gone = make_key(bob, tree.project, name="gone")
    rec = record(gone)
    ApiKey.objects.filter(pk=gone.pk).delete()
    assert write_records_sync([record(key), rec]) == 2
    assert UsageRecord.objects.get(request_id=rec["request_id"]).api_key_id is None


@pytest.mark.django_db
def test_last_used_moves_forward_at_most_once_a_minute_per_key(bob, tree) -> None:
    key = make_key(bob, tree.project)
    start = recent_minute(10)
    touched: dict[int, datetime] = {}
    write_records_sync([record(key, created_at=start)], touched=touched)
    key.refresh_from_db(fields=["last_used_at"])
    assert key.last_used_at == start
    with CaptureQueriesContext(connection) as queries:
        write_records_sync([record(key, created_at=start + timedelta(seconds=30))], touched=touched)
    assert not any('UPDATE "accounts_apikey"' in q["sql"] for q in queries.captured_queries)
    write_records_sync([record(key, created_at=start + timedelta(seconds=61))], touched=touched)
    key.refresh_from_db(fields=["last_used_at"])
    expected = start + timedelta(seconds=61)
    assert key.last_used_at == expected


@pytest.mark.django_db
def test_odd_values_are_stored_as_unknown_rather_than_failing_the_batch(bob, tree) -> None:
    key = make_key(bob, tree.project)
    odd = record(
        key,
        model="m" * 500,
        prompt_tokens="12",
        completion_tokens=-3,
        total_ms=float("nan"),
        first_token_ms="soon",
        replica=None,
        created_at=1_790_000_000.0,
        unknown_field=1,
    )
    assert write_records_sync([odd]) == 1
    stored = UsageRecord.objects.get()
    assert len(stored.model) == 200 and stored.replica == ""
    assert (stored.prompt_tokens, stored.completion_tokens) == (12, None)
    assert stored.total_ms is None and stored.first_token_ms is None
    assert stored.created_at == datetime.fromtimestamp(1_790_000_000, UTC)


def test_a_nul_in_a_text_field_is_kept_as_a_replacement_character_rather_than_failing_the_batch(bob, tree) -> None:
    key = make_key(bob, tree.project)
    odd = record(
        key,
        model="q\x00",
        error="The model “q\x00” does not exist.",
        guardrail=[{"policy": "p\x00", "action": "block"}],
    )
    plain = record(key)
    assert write_records_sync([odd, plain]) == 2  # PostgreSQL refused the whole batch for one NUL
    stored = UsageRecord.objects.get(request_id=odd["request_id"])
    assert stored.model == "q\ufffd" and stored.error == "The model “q\ufffd” does not exist."
    assert stored.guardrail == [{"policy": "p\ufffd", "action": "block"}]


# The writer ---------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_writer_writes_many_emits_in_one_bulk_insert(bob, tree) -> None:
    key = make_key(bob, tree.project)
    spy = SpyWrite()
    writer = UsageWriter(write=spy, interval=0.05)

    async def scenario() -> None:
        await writer.start()
        for _ in range(120):
            writer.emit(record(key))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not writer.pending and spy.batches:
                break
        await writer.stop()

    asyncio.run(scenario())
    assert spy.batches == [120]
    assert spy.inserts == [1]
    assert UsageRecord.objects.count() == 120
    assert UsageRollup.objects.get(period="minute").requests == 120


@pytest.mark.django_db(transaction=True)
def test_a_full_batch_is_written_before_the_interval(bob, tree) -> None:
    key = make_key(bob, tree.project)
    spy = SpyWrite()
    writer = UsageWriter(write=spy, interval=60, batch_size=10)

    async def scenario() -> None:
        await writer.start()
        for _ in range(10):
            writer.emit(record(key))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if spy.batches:
                break
        await writer.stop()

    asyncio.run(scenario())
    assert spy.batches == [10]


@pytest.mark.django_db(transaction=True)
def test_stop_writes_what_is_still_queued(bob, tree) -> None:
    key = make_key(bob, tree.project)
    writer = UsageWriter(interval=60)

    async def scenario() -> None:
        await writer.start()
        for _ in range(1201):
            writer.emit(record(key))
        await writer.stop()

    asyncio.run(scenario())
    assert UsageRecord.objects.count() == 1201
    assert writer.pending == 0


@pytest.mark.django_db(transaction=True)
def test_a_failed_batch_is_retried_on_the_next_flush(bob, tree, caplog) -> None:
    key = make_key(bob, tree.project)
    spy = SpyWrite(fail_times=1)
    writer = UsageWriter(write=spy)
    for _ in range(3):
        writer.emit(record(key))

    async def scenario() -> tuple[bool, bool]:
        first = await writer.flush()
        second = await writer.flush()
        await writer.stop()
        return first, second

    with caplog.at_level(logging.WARNING, logger="apps.quotas.usage"):
        assert asyncio.run(scenario()) == (False, True)
    assert spy.batches == [3, 3]
    assert UsageRecord.objects.count() == 3
    assert UsageRollup.objects.get(period="minute").requests == 3
    assert "will retry" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_batch_failing_for_good_loses_only_its_bad_records(bob, tree) -> None:
    key = make_key(bob, tree.project)
    before = dropped("write_failed")
    good, bad = record(key), record(key)

    def write(batch: list[dict[str, Any]], *, touched: Any = None) -> int:
        if any(r["request_id"] == bad["request_id"] for r in batch):
            raise ValueError("a record the database refuses")
        return write_records_sync(batch, touched=touched)

    writer = UsageWriter(write=write, max_attempts=2)
    writer.emit(good)
    writer.emit(bad)

    async def scenario() -> None:
        assert await writer.flush() is False
        assert await writer.flush() is True  # second and last try: one by one
        await writer.stop()

    asyncio.run(scenario())
    assert list(UsageRecord.objects.values_list("request_id", flat=True)) == [good["request_id"]]
    assert dropped("write_failed") == before + 1


def test_emit_never_blocks_and_counts_what_it_drops(caplog) -> None:
    before = dropped("queue_full")
    writer = UsageWriter(max_queue=3)
    with caplog.at_level(logging.WARNING, logger="apps.quotas.usage"):
        for index in range(5):
            writer.emit({"request_id": f"r{index}"})
    assert writer.pending == 3
    assert writer.dropped == 2
    assert dropped("queue_full") == before + 2
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1  # logged once, not per record


@pytest.mark.django_db(transaction=True)
def test_writers_in_several_processes_add_into_the_same_rollups(bob, tree) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers need a database that takes concurrent writes")
    import threading

    from django.db import connections

    key = make_key(bob, tree.project)
    barrier = threading.Barrier(8)
    failures: list[BaseException] = []

    def writer() -> None:
        try:
            batch = [record(key) for _ in range(5)]
            barrier.wait()
            write_records_sync(batch)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert UsageRecord.objects.count() == 40
    assert list(UsageRollup.objects.values_list("period", "requests").order_by("period")) == [
        ("hour", 40),
        ("minute", 40),
    ]


@pytest.mark.django_db(transaction=True)
def test_batches_a_broker_lost_are_written_by_the_web_process_once_found_missing(bob, tree, caplog) -> None:
    key = make_key(bob, tree.project)
    handed: list[int] = []

    def broker_that_comes_back_empty(batch: list[dict[str, Any]], *, touched: Any = None) -> int:
        handed.append(len(batch))  # taken by the broker ... which restarts and never delivers it
        return len(batch)

    writer = UsageWriter(write=broker_that_comes_back_empty, interval=60, confirm_after=0, confirm_every=0)

    def written_now() -> bool:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(UsageRecord.objects.exists).result()

    async def scenario() -> None:
        await writer.start()
        for _ in range(30):
            writer.emit(record(key))
        await writer.flush()
        assert handed == [30] and not written_now()  # nothing written yet: the worker was to do it
        assert await writer.confirm() == 30
        await writer.stop()

    asyncio.run(scenario())
    assert handed == [30]
    assert UsageRecord.objects.count() == 30
    assert "had not written 30 record(s)" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_batches_the_worker_wrote_are_not_written_again(bob, tree) -> None:
    key = make_key(bob, tree.project)

    def worker_that_writes(batch: list[dict[str, Any]], *, touched: Any = None) -> int:
        return write_records_sync(batch, touched=touched)

    writer = UsageWriter(write=worker_that_writes, interval=60, confirm_after=0, confirm_every=0)

    async def scenario() -> None:
        await writer.start()
        for _ in range(12):
            writer.emit(record(key))
        await writer.flush()
        assert await writer.confirm() == 0
        await writer.stop()

    asyncio.run(scenario())
    assert UsageRecord.objects.count() == 12
    assert UsageRollup.objects.get(period="minute").requests == 12


@pytest.mark.django_db(transaction=True)
def test_the_worker_task_tries_a_batch_again_when_the_database_went_away(bob, tree, monkeypatch) -> None:
    from apps.quotas import tasks, usage

    key = make_key(bob, tree.project)
    spy = SpyWrite(fail_times=2)
    monkeypatch.setattr(usage, "write_records_sync", spy)
    outcome = tasks.write_usage.apply(args=([record(key), record(key)],), retries=0, throw=False)
    assert outcome.successful(), outcome.traceback
    assert spy.batches == [2, 2, 2] and UsageRecord.objects.count() == 2


@pytest.mark.django_db(transaction=True)
def test_a_database_away_for_longer_than_every_try_loses_nothing(bob, tree) -> None:
    """Twelve failed flushes with the database away, more than max_attempts: the batch is kept."""
    key = make_key(bob, tree.project)
    before = dropped("write_failed")
    spy = SpyWrite(fail_times=12)
    writer = UsageWriter(write=spy, max_attempts=3)
    for _ in range(4):
        writer.emit(record(key))

    async def scenario() -> list[bool]:
        results = [await writer.flush() for _ in range(13)]
        await writer.stop()
        return results

    assert asyncio.run(scenario()) == [False] * 12 + [True]
    assert spy.batches == [4] * 13
    assert UsageRecord.objects.count() == 4 and dropped("write_failed") == before
