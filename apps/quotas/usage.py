"""Usage records: queued by the gateway, written in batches with their minute and hour rollups.

The gateway calls `writer.emit(record)` once per request, after the answer is sent. It
never blocks and never raises: the record goes into a bounded in-memory queue, and a
background task writes the queue in batches (every 0.5 s, or sooner once 500 records
wait) in a worker thread of its own, so the event loop never waits on the database.

A record is a dict with UsageRecord's fields and ids rather than objects (declared once, key by
key, as apps.quotas.records.UsageRecordDict):

    {"request_id": "req_…", "created_at": datetime | epoch seconds, "user_id": 3, "api_key_id": 12,
     "organization_id": 1, "team_id": 3, "project_id": 7, "model": "llama-3-8b",
     "endpoint": "chat.completions", "replica": "r42", "hardware": "H100", "stream": True,
     "prompt_tokens": 12, "completion_tokens": None, "tokens_estimated": False,
     "first_token_ms": 85.0, "total_ms": 950.0, "queue_ms": 0.0, "status": 200, "error": "",
     "batch": ""}

Unknown keys are ignored; missing ones take the model's defaults (tokens and times
unknown). `queue_ms` is how long the request waited for a slot: 0 when it took a free one, None
when unknown (refused before it asked for one). `batch` is the id of the batch (apps.batches) the
request was a line of, "" for any other. Writing a batch is one transaction (`write_records_sync`):

1. drop records whose request_id is already stored (a batch retried after its commit
   was lost is not counted twice) or repeated in the batch;
2. clear references to rows deleted meanwhile (a key revoked and deleted a second ago);
3. bulk-insert the records;
4. add them into the minute and hour rollups: read the affected rows under a row lock
   (SELECT … FOR UPDATE, so writers in several gateway processes never lose each
   other's sums), add, bulk-update, and bulk-create the new ones; when another process
   created the same new row first, the transaction is run again at once (up to 3 times);
5. move ApiKey.last_used_at forward, one UPDATE per key and at most once a minute per key.

With the worker writing (`write_via_worker`), a batch handed to the broker is kept in the web
process until the worker is seen to have written it: every `confirm_every` seconds the
writer reads which request ids of the batches handed over more than `confirm_after` seconds
ago are stored, and writes the missing ones itself (a broker that restarted empty, or a worker
that died with the batch, loses nothing). Writing is idempotent by request id, so a worker that
was merely slow counts nothing twice. At most `max_handed` records wait to be confirmed; past
that the oldest are checked at once. What `kill -9` of a web process loses is what it held in
memory: records not yet handed over (at most `interval` seconds of them) and handed records
not yet confirmed whose broker message was lost as well.

A batch that fails is kept and retried first on the next flush, with the flush interval
doubling up to 30 s while the database is failing. While the database is away (a connection
refused or reset: OperationalError, InterfaceError) the batch is kept however long that lasts;
a batch the database refuses for its content is, after `max_attempts` tries, written record by
record so one bad record loses only itself, and what still fails is dropped and counted in
llmgw_usage_dropped_total. While a batch waits, new records queue up to `max_queue`; past
that, emit drops them (counted and logged, never blocking).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol, TypedDict

from prometheus_client import Counter

from apps.quotas import histograms
from apps.quotas.journal import Journal, settle_orphans
from apps.quotas.records import UsageRecordDict

__all__ = ["USAGE_DROPPED", "UsageWriter", "rollup_key", "write_missing", "write_records_sync"]

log = logging.getLogger(__name__)

USAGE_DROPPED = Counter("llmgw_usage_dropped", "Usage records the gateway could not keep, by reason", ["reason"])
USAGE_WRITTEN = Counter("llmgw_usage_written", "Usage records written to the database")

LAST_USED_RESOLUTION = timedelta(seconds=60)

GUARDRAIL_KEYS = ("policy", "rule", "kind", "action", "detector", "where", "error")
Reference = Literal["user_id", "api_key_id", "organization_id", "team_id", "project_id"]
REFERENCES: dict[Reference, tuple[str, str]] = {  # record field -> (app label, model name)
    "user_id": ("accounts", "User"),
    "api_key_id": ("accounts", "ApiKey"),
    "organization_id": ("accounts", "Organization"),
    "team_id": ("accounts", "Team"),
    "project_id": ("accounts", "Project"),
}


# Writing --------------------------------------------------------------------------------


def _moment(value: Any) -> datetime:
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, int | float) and math.isfinite(value):
        return datetime.fromtimestamp(value, UTC)
    return datetime.now(UTC)


def _epoch(value: Any) -> float:
    """A record's moment as epoch seconds, for a broker message: the gateway's are already."""
    if isinstance(value, float) and math.isfinite(value):
        return value  # _moment reads it back the same
    return _moment(value).timestamp()


def _number(value: Any, kind: type[int] | type[float]) -> Any:
    """A non-negative finite number, or None for unknown (or nonsense)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) and number >= 0 else None


def _text(value: Any) -> str:
    """`value` as text a column can keep: PostgreSQL refuses a NUL character in any string, and
    one such record would fail its whole batch. A NUL reads as U+FFFD, the replacement character."""
    return str(value).replace("\x00", "\ufffd")


class StoredRecord(TypedDict):
    """A record as it is written: UsageRecordDict's fields, every one present, cleaned (`_clean`) to
    the types and lengths of UsageRecord's columns; the keyword arguments of a UsageRecord row."""

    request_id: str
    created_at: datetime
    user_id: int | None
    api_key_id: int | None
    organization_id: int | None
    team_id: int | None
    project_id: int | None
    model: str
    endpoint: str
    replica: str
    hardware: str
    stream: bool
    prompt_tokens: int | None
    completion_tokens: int | None
    tokens_estimated: bool
    first_token_ms: float | None
    total_ms: float | None
    queue_ms: float | None
    status: int
    error: str
    guardrail: list[dict[str, str]] | None
    batch: str


def _column(value: object, name: str) -> str:
    """Text cut to the length of UsageRecord's column `name`; "" for None."""
    from apps.quotas.models import UsageRecord

    text = "" if value is None else _text(value)
    return text[: UsageRecord._meta.get_field(name).max_length]  # type: ignore[union-attr]


def _id(value: object) -> int | None:
    return _number(value, int) or None


def _tokens(value: object) -> int | None:
    tokens = _number(value, int)
    return min(tokens, 2**31 - 1) if tokens is not None else None


def _clean(record: UsageRecordDict) -> StoredRecord:
    """The record's known fields, typed, with strings cut to their columns' lengths.

    Done before writing so one odd record cannot make its whole batch fail.
    """
    found = record.get("guardrail")
    verdict = [
        {key: _text(item[key])[:100] for key in GUARDRAIL_KEYS if item.get(key) is not None}
        for item in (found if isinstance(found, list) else [])[:50]
        if isinstance(item, dict)
    ]
    error = record.get("error")
    return {
        "request_id": _text(record.get("request_id") or "")[:40],
        "created_at": _moment(record.get("created_at")),
        "user_id": _id(record.get("user_id")),
        "api_key_id": _id(record.get("api_key_id")),
        "organization_id": _id(record.get("organization_id")),
        "team_id": _id(record.get("team_id")),
        "project_id": _id(record.get("project_id")),
        "model": _column(record.get("model"), "model"),
        "endpoint": _column(record.get("endpoint"), "endpoint"),
        "replica": _column(record.get("replica"), "replica"),
        "hardware": _column(record.get("hardware"), "hardware"),
        "stream": bool(record.get("stream")),
        "prompt_tokens": _tokens(record.get("prompt_tokens")),
        "completion_tokens": _tokens(record.get("completion_tokens")),
        "tokens_estimated": bool(record.get("tokens_estimated")),
        "first_token_ms": _number(record.get("first_token_ms"), float),
        "total_ms": _number(record.get("total_ms"), float),
        "queue_ms": _number(record.get("queue_ms"), float),
        "status": min(_number(record.get("status"), int) or 0, 32767),
        "error": "" if error is None else _text(error),
        "guardrail": verdict or None,
        "batch": _column(record.get("batch"), "batch"),
    }


def _existing_ids(records: list[StoredRecord]) -> dict[Reference, set[int]]:
    from django.apps import apps

    found: dict[Reference, set[int]] = {}
    for field, (app_label, model_name) in REFERENCES.items():
        wanted = {r[field] for r in records if r.get(field)}
        model = apps.get_model(app_label, model_name)
        found[field] = (
            set(model._default_manager.filter(pk__in=wanted).values_list("pk", flat=True)) if wanted else set()
        )
    return found


def rollup_key(period: str, bucket_start: datetime, record: StoredRecord) -> tuple[Any, ...]:
    """The unique key of the rollup row a record adds into (0 for "none")."""
    return (
        period,
        bucket_start,
        record.get("organization_id") or 0,
        record.get("team_id") or 0,
        record.get("project_id") or 0,
        record.get("api_key_id") or 0,
        record.get("user_id") or 0,
        record.get("model") or "",
    )


ROLLUP_KEY_FIELDS = (
    "period",
    "bucket_start",
    "organization_id",
    "team_id",
    "project_id",
    "api_key_id",
    "user_id",
    "model",
)
ROLLUP_SUMS = (
    "requests",
    "errors",
    "client_errors",
    "refusals",
    "prompt_tokens",
    "completion_tokens",
    "requests_without_tokens",
)


ROLLUP_SKETCHES = ("first_token_hist", "latency_hist", "queue_hist")


def _buckets(moment: datetime) -> list[tuple[str, datetime]]:
    moment = moment.astimezone(UTC)
    minute = moment.replace(second=0, microsecond=0)
    return [("minute", minute), ("hour", minute.replace(minute=0))]


def is_error(status: int, error: str) -> bool:
    """A server-side failure: status 500 and above, or an answer that broke after it began."""
    return status >= 500 or (status < 400 and bool(error))


def is_client_error(status: int) -> bool:
    """A failure on the client's side: status 400 to 499 other than 429 (a limit's refusal).

    A model that does not exist (404), a body the gateway cannot take (400, 413), a key that may
    not use the model (403), and a client that went away before its answer ended (499).
    """
    return 400 <= status < 500 and status != 429


def _add_record(sums: dict[str, Any], record: StoredRecord) -> None:
    status = record["status"]
    sums["requests"] += 1
    sums["refusals"] += status == 429
    sums["errors"] += is_error(status, record.get("error") or "")
    sums["client_errors"] += is_client_error(status)
    prompt, completion = record.get("prompt_tokens"), record.get("completion_tokens")
    # Unknown is not zero: only known counts are summed, and the rest are counted apart.
    sums["prompt_tokens"] += prompt or 0
    sums["completion_tokens"] += completion or 0
    sums["requests_without_tokens"] += prompt is None or completion is None
    if status != 429:  # a refusal takes no time worth a percentile
        histograms.observe(sums["first_token_hist"], record.get("first_token_ms"))
        histograms.observe(sums["latency_hist"], record.get("total_ms"))
    # Known only for the requests that asked for a slot: 0 for one taken at once is counted, unknown is not.
    histograms.observe(sums["queue_hist"], record.get("queue_ms"))


def _new_sums() -> dict[str, Any]:
    sums: dict[str, Any] = dict.fromkeys(ROLLUP_SUMS, 0)
    sums["first_token_hist"] = histograms.empty()
    sums["latency_hist"] = histograms.empty()
    sums["queue_hist"] = histograms.empty()
    return sums


def _write_rollups(records: list[StoredRecord]) -> None:
    from django.db.models import Q

    from apps.quotas.models import UsageRollup

    added: dict[tuple[Any, ...], dict[str, Any]] = {}
    for record in records:
        for period, start in _buckets(record["created_at"]):
            _add_record(added.setdefault(rollup_key(period, start, record), _new_sums()), record)
    wanted = Q(pk__in=[])
    for period in ("minute", "hour"):
        starts = {key[1] for key in added if key[0] == period}
        if starts:
            wanted |= Q(period=period, bucket_start__in=starts)
    keys = {key[5] for key in added}
    existing = {
        tuple(getattr(row, name) for name in ROLLUP_KEY_FIELDS): row
        for row in UsageRollup.objects.filter(wanted, api_key_id__in=keys).order_by("pk").select_for_update()
    }
    changed, created = [], []
    for key, sums in added.items():
        row = existing.get(key)
        if row is None:
            created.append(UsageRollup(**dict(zip(ROLLUP_KEY_FIELDS, key, strict=True)), **sums))
            continue
        for name in ROLLUP_SUMS:
            stored = getattr(row, name)
            # None: a row begun before this sum was kept (client errors); it stays unknown, not partly counted.
            setattr(row, name, None if stored is None else stored + sums[name])
        row.first_token_hist = histograms.merge(row.first_token_hist, sums["first_token_hist"])
        row.latency_hist = histograms.merge(row.latency_hist, sums["latency_hist"])
        row.queue_hist = histograms.merge(row.queue_hist, sums["queue_hist"])
        changed.append(row)
    if changed:
        UsageRollup.objects.bulk_update(changed, [*ROLLUP_SUMS, *ROLLUP_SKETCHES], batch_size=500)
    if created:
        UsageRollup.objects.bulk_create(created, batch_size=500)


def _touch_keys(records: list[StoredRecord], touched: dict[int, datetime] | None) -> dict[int, datetime]:
    from django.db.models import Q

    from apps.accounts.models import ApiKey

    latest: dict[int, datetime] = {}
    for record in records:
        key_id = record.get("api_key_id")
        if key_id and (key_id not in latest or record["created_at"] > latest[key_id]):
            latest[key_id] = record["created_at"]
    written = {}
    for key_id, moment in sorted(latest.items()):
        if touched is not None and key_id in touched and moment - touched[key_id] < LAST_USED_RESOLUTION:
            continue
        ApiKey.objects.filter(pk=key_id).filter(
            Q(last_used_at__isnull=True) | Q(last_used_at__lte=moment - LAST_USED_RESOLUTION)
        ).update(last_used_at=moment)
        written[key_id] = moment
    return written


def write_records_sync(records: Iterable[UsageRecordDict], *, touched: dict[int, datetime] | None = None) -> int:
    """Write usage records, their rollups and their keys' last use in one transaction.

    Returns how many records were new. `touched` (key id -> last_used_at written) lets a
    long-lived writer skip keys it moved forward less than a minute ago; it is updated
    only once the transaction committed. When another process created the same new
    rollup row first, the transaction is tried again at once (it then adds to that row).
    """
    from django.db import IntegrityError

    batch: dict[str, StoredRecord] = {}
    for record in records:
        clean = _clean(record)
        if clean["request_id"]:
            batch.setdefault(clean["request_id"], clean)
    if not batch:
        return 0
    for attempt in range(3):
        try:
            count, written = _write_batch(batch, touched)
            break
        except IntegrityError:
            if attempt == 2:
                raise
    if touched is not None:
        touched.update(written)
    return count


def _write_batch(
    batch: dict[str, StoredRecord], touched: dict[int, datetime] | None = None
) -> tuple[int, dict[int, datetime]]:
    from django.db import transaction

    from apps.quotas.models import UsageRecord

    with transaction.atomic():
        stored = set(UsageRecord.objects.filter(request_id__in=list(batch)).values_list("request_id", flat=True))
        fresh = [record.copy() for request_id, record in batch.items() if request_id not in stored]
        if not fresh:
            return 0, {}
        existing = _existing_ids(fresh)
        for record in fresh:
            for field in REFERENCES:
                if record.get(field) and record[field] not in existing[field]:
                    record[field] = None
        UsageRecord.objects.bulk_create([UsageRecord(**record) for record in fresh], batch_size=500)
        _write_rollups(fresh)
        return len(fresh), _touch_keys(fresh, touched)


# The writer -------------------------------------------------------------------------------


class BatchWriter(Protocol):
    """Writes one batch of records (write_records_sync, write_via_worker); how many were new or handed over."""

    def __call__(self, records: list[UsageRecordDict], *, touched: dict[int, datetime] | None = ...) -> int: ...


class UsageWriter:
    """Queues usage records from the gateway and writes them in batches. See the module docstring.

    `write` is the function that writes one batch in the worker thread (tests swap it).
    """

    def __init__(
        self,
        *,
        max_queue: int = 100_000,
        batch_size: int = 500,
        interval: float = 0.5,
        max_interval: float = 30.0,
        max_attempts: int = 10,
        write: BatchWriter | None = None,
        confirm_after: float | None = None,
        confirm_every: float = 30.0,
        max_handed: int = 200_000,
        journal: Journal | None = None,
        settle_after: float = 120.0,
    ) -> None:
        self.max_queue = max_queue
        self.batch_size = batch_size
        self.interval = interval
        self.max_interval = max_interval
        self.max_attempts = max_attempts
        self._write = write or write_records_sync
        self._queue: deque[UsageRecordDict] = deque()
        self._failed: list[UsageRecordDict] = []  # the batch that failed, tried first next time
        self._attempts = 0
        self._touched: dict[int, datetime] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._backing_off = False
        self._flushing = asyncio.Lock()
        self._in_flight = 0
        self._executor: ThreadPoolExecutor | None = None
        self._dropped_logged_at = -math.inf
        self.dropped = 0
        # Batches handed to the worker, not yet seen written: (when, records).
        self.confirm_after = confirm_after
        self.confirm_every = confirm_every
        self.max_handed = max_handed
        self._handed: deque[tuple[float, list[UsageRecordDict]]] = deque()
        self._handed_count = 0
        self._confirmed_at = time.monotonic()
        # Every record is on local disk first (apps/quotas/journal.py); a closed segment is settled
        # once its records had `settle_after` seconds to be written the usual way.
        self.journal = journal
        self._orphans_settled = False
        self.settle_after = max(settle_after, (confirm_after or 0) + 30)

    # Request path -------------------------------------------------------------------------

    def emit(self, record: UsageRecordDict) -> None:
        """Append one record to the journal and queue it. Never blocks, never raises; drops from the
        queue (counted; the journal still has it) when the queue is full."""
        try:
            if self.journal is not None:
                self.journal.append(record)
            if len(self._queue) >= self.max_queue:
                self._drop(1, "queue_full")
                return
            self._queue.append(record)
            if len(self._queue) >= self.batch_size and self._wake is not None and not self._backing_off:
                self._wake.set()
        except Exception:  # the request path must not fail because of bookkeeping
            log.exception("usage: could not queue a record")

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._failed) + self._in_flight

    def _drop(self, count: int, reason: str) -> None:
        self.dropped += count
        USAGE_DROPPED.labels(reason).inc(count)
        moment = time.monotonic()
        if moment - self._dropped_logged_at >= 60:
            self._dropped_logged_at = moment
            log.warning(
                "usage: dropped %d record(s) (%s); %d dropped since start, %d waiting",
                count,
                reason,
                self.dropped,
                self.pending,
            )

    # Lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background task in the running event loop."""
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        # One thread of its own: one database connection, and the loop's default
        # executor stays free for everything else.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-usage")
        if self.journal is not None:
            try:
                self.journal.open()
            except OSError as exc:
                where = self.journal.folder
                log.warning("usage journal: cannot open %s: %s; records are kept in memory only", where, exc)
                self.journal = None
        self._task = asyncio.create_task(self._run(), name="llmgw-usage-writer")

    async def stop(self, timeout: float = 30.0) -> None:
        """Stop the background task and write everything still queued (one try per batch).

        A write in progress is let finish (up to `timeout`) rather than cancelled.
        """
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            if self._wake is not None:
                self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=timeout)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.flush(final=True)
        if self._handed:  # what the worker has not written yet is not left to chance at a clean stop
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.confirm(force=True), timeout=timeout)
        if self.journal is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._settle(everything=True), timeout=timeout)
            self.journal.close()
        if self._executor is not None:
            await self._in_thread(_close_connections)  # in the worker thread: its own connection
            self._executor.shutdown(wait=True)
            self._executor = None
        self._stopping = False

    async def _run(self) -> None:
        assert self._wake is not None
        delay = self.interval
        while not self._stopping:
            with contextlib.suppress(TimeoutError):  # every interval, or once a whole batch waits
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            self._wake.clear()
            if self._stopping:
                break
            try:
                ok = await self.flush()
                await self.confirm()
                await self._settle()
            except Exception:  # never let the task die; flush keeps what failed
                log.exception("usage: flush failed")
                ok = False
            # While the database fails, back off however much queues up (emit does not wake us).
            delay = self.interval if ok else min(self.max_interval, delay * 2)
            self._backing_off = not ok

    # Writing ------------------------------------------------------------------------------

    async def _in_thread(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from asgiref.sync import sync_to_async

        if self._executor is None:
            return await sync_to_async(func, thread_sensitive=False)(*args, **kwargs)
        return await sync_to_async(func, thread_sensitive=False, executor=self._executor)(*args, **kwargs)

    def _write_in_thread(self, batch: list[UsageRecordDict]) -> int:
        from django.db import close_old_connections

        # A connection the database dropped (restart, idle timeout) is replaced, not reused.
        close_old_connections()
        return self._write(batch, touched=self._touched)

    async def flush(self, *, final: bool = False) -> bool:
        """Write everything queued now, batch by batch. False when a batch failed and is kept for later.

        With `final` (on stop) every batch gets one try, then one try record by record.
        """
        async with self._flushing:
            return await self._flush(final)

    async def _flush(self, final: bool) -> bool:
        # What was queued when the flush began; records queued while it writes wait for the next
        # one (but on stop). Chasing them wrote a batch of one or two records after another for as
        # long as requests kept coming, each a broker message and its thread's hold on the GIL,
        # which every request then waited on.
        left = len(self._queue)
        while self._failed or (self._queue and (left > 0 or final)):
            if self._failed:
                batch = self._failed
            else:
                size = min(self.batch_size, len(self._queue) if final else min(left, len(self._queue)))
                batch = [self._queue.popleft() for _ in range(size)]
                left -= size
            self._failed, self._in_flight = [], len(batch)
            try:
                written = await self._in_thread(self._write_in_thread, batch)
            except asyncio.CancelledError:
                # Stopped mid-write: keep the batch. If the thread still commits it, the
                # final flush finds its request ids stored and skips them.
                self._failed, self._in_flight = batch, 0
                raise
            except Exception as exc:
                # A database that is away is waited for however long it takes (what queues up
                # meanwhile is bounded by max_queue); only a batch the database refuses uses up tries.
                if not _is_outage(exc):
                    self._attempts += 1
                self._in_flight = 0
                if self._attempts < self.max_attempts and not final:
                    self._failed = batch
                    log.warning(
                        "usage: writing %d record(s) failed (try %d of %d), will retry: %s",
                        len(batch),
                        self._attempts,
                        self.max_attempts,
                        exc,
                    )
                    return False
                log.error(
                    "usage: writing %d record(s) failed %d time(s): %s; writing them one by one",
                    len(batch),
                    self._attempts,
                    exc,
                )
                self._attempts = 0
                outage = await self._write_one_by_one(batch)
                if outage and final and self._queue:
                    self._drop(len(self._queue), "write_failed")
                    self._queue.clear()
                continue
            self._attempts = self._in_flight = 0
            if self.confirm_after is not None:
                self._handed.append((time.monotonic(), batch))
                self._handed_count += len(batch)
            else:
                USAGE_WRITTEN.inc(written)
        return True

    async def _settle(self, *, everything: bool = False) -> int:
        """Settle the journal's closed segments (and, at first, those of processes that died), in
        the writer's thread; the open segment is synced to disk at each flush."""
        journal = self.journal
        if journal is None:
            return 0

        def work() -> int:
            from django.db import close_old_connections

            close_old_connections()
            journal.sync()
            written = 0
            if not self._orphans_settled:
                written += settle_orphans(journal.folder, self._write_missing)
                self._orphans_settled = True
            return written + journal.settle(self._write_missing, older_than_s=self.settle_after, everything=everything)

        written = int(await self._in_thread(work))
        if written:
            USAGE_WRITTEN.inc(written)
        return written

    def _write_missing(self, records: list[UsageRecordDict]) -> int:
        return write_missing(records, touched=self._touched)

    async def confirm(self, *, force: bool = False) -> int:
        """Write here the handed-over records the worker has not written; how many that was."""
        if not self._handed:
            return 0
        moment = time.monotonic()
        if not force and moment - self._confirmed_at < self.confirm_every and self._handed_count <= self.max_handed:
            return 0
        self._confirmed_at = moment
        due: list[UsageRecordDict] = []
        while self._handed and (
            force or moment - self._handed[0][0] >= (self.confirm_after or 0) or self._handed_count > self.max_handed
        ):
            _when, batch = self._handed.popleft()
            self._handed_count -= len(batch)
            due.extend(batch)
        if not due:
            return 0
        try:
            written: int = await self._in_thread(write_missing, due, touched=self._touched)
        except Exception as exc:
            log.warning(
                "usage: could not check %d record(s) handed to the worker: %s; checking again later", len(due), exc
            )
            self._handed.appendleft((moment, due))
            self._handed_count += len(due)
            return 0
        if written:
            log.warning(
                "usage: the worker had not written %d record(s) after %.0f s (a broker that lost them, "
                "or a worker that is down); written here",
                written,
                self.confirm_after or 0,
            )
            USAGE_WRITTEN.inc(written)
        return written

    async def _write_one_by_one(self, batch: list[UsageRecordDict]) -> bool:
        """Write each record on its own; True when the database itself is away."""
        lost = 0
        outage = False
        for index, record in enumerate(batch):
            try:
                await self._in_thread(self._write_in_thread, [record])
            except Exception as exc:
                if _is_outage(exc):
                    # The database is away, not the data bad: do not try the rest one by one.
                    lost, outage = lost + len(batch) - index, True
                    break
                lost += 1
        if lost:
            self._drop(lost, "write_failed")
        return outage


def _close_connections() -> None:
    from django.db import connections

    connections.close_all()


def _is_outage(exc: BaseException) -> bool:
    from django.db import InterfaceError, OperationalError

    return isinstance(exc, OperationalError | InterfaceError)


def write_missing(records: list[UsageRecordDict], *, touched: dict[int, datetime] | None = None) -> int:
    """Write those of the records that are not stored yet (the rest the worker wrote)."""
    from apps.quotas.models import UsageRecord

    ids = [str(r.get("request_id") or "")[:40] for r in records]
    stored: set[str] = set()
    for start in range(0, len(ids), 1000):
        stored.update(
            UsageRecord.objects.filter(request_id__in=ids[start : start + 1000]).values_list("request_id", flat=True)
        )
    missing = [r for r, request_id in zip(records, ids, strict=True) if request_id and request_id not in stored]
    return write_records_sync(missing, touched=touched) if missing else 0


def write_via_worker(records: list[UsageRecordDict], *, touched: dict[int, datetime] | None = None) -> int:
    """Hand a batch to a Celery worker, so the web process spends no time in the ORM.

    The batch is one broker message; the worker writes it with write_records_sync (which skips
    request ids already stored, so a redelivered message counts nothing twice). When the broker
    cannot take it, the batch is written here instead: usage is never lost for a broker outage.
    """
    from apps.quotas.tasks import write_usage

    batch = [{**record, "created_at": _epoch(record.get("created_at"))} for record in records]
    try:
        # argsrepr: what logs and monitors show of the task's arguments; Celery's own is a repr of
        # the whole batch, built in the web process for every batch.
        write_usage.apply_async(args=[batch], retry=False, argsrepr=f"[<{len(batch)} usage records>]")
    except Exception:
        log.warning("the broker did not take a usage batch; writing it in this process", exc_info=True)
        return write_records_sync(records, touched=touched)
    return len(batch)
