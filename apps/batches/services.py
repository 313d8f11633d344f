"""Files and batches: every write, from an upload to a batch's last output file.

Who owns what: a file or batch belongs to the organisation and project of the key that made it (a
key without a project: to its owner alone), and only keys of that project see it; anyone else is
told it does not exist (404). Staff read and cancel every batch through /api/v1, the console and ctl.

A batch's life (OpenAI's statuses; an Anthropic batch's processing_status is read from them):

1. `validating`: a web process takes the batch (a lease on its row) and reads its input file line
   by line into BatchLine rows, in chunks (a process that dies midway leaves the batch validating,
   and the next one starts again from nothing). A problem OpenAI fails a batch for fails it here
   (`failed`, with each line's problem in `errors`); a line that fails alone is answered at once.
2. `in_progress`: web processes take pending lines (a lease per line) and run them through the
   gateway (apps.batches.runner); each answer is written to its line's row with the batch's counters
   in one transaction, only by the process that still holds the line.
3. When every line is answered: `finalizing`, the output and error files are written from the rows
   (in line order, each line once, whatever happened on the way), then `completed`.
4. `cancelling`: no line is started any more; those not started are answered `batch_cancelled`, and
   once those running are done the files are written and it is `cancelled`.
5. Past its 24 h window: the lines not answered are answered `batch_expired`, the files written,
   and it is `expired`.

Steps 1 and 3 to 5 are taken by `advance()`, which every web process runs every few seconds (and the
worker's beat every minute for expiry); each step is guarded by the batch's status and lease, so two
processes running it at once change nothing twice.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import secrets
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q, QuerySet, Sum
from django.utils import timezone

from apps.accounts import audit
from apps.accounts.models import ApiKey, User
from apps.batches import storage
from apps.batches.choices import BatchStatus, FilePurpose, Kind, LineState
from apps.batches.models import Batch, BatchFile, BatchLine, LineTally
from apps.batches.shapes import anthropic_result, jsonl, openai_output_line
from apps.batches.validation import Checked, Problem, Reading, check_anthropic_request, check_openai_line
from apps.gateway.errors import error_body
from llmgw.errors import ServiceError

__all__ = [
    "BatchRefused",
    "LineWork",
    "Outcome",
    "Owner",
    "advance",
    "batches_for",
    "cancel_batch",
    "claim_lines",
    "create_anthropic_batch",
    "create_file",
    "create_openai_batch",
    "delete_batch",
    "delete_file",
    "files_for",
    "finish_lines",
    "get_batch",
    "get_file",
    "release_lines",
    "renew_leases",
    "request_id",
    "sweep",
    "upload_bound",
    "validate_batch",
]

log = logging.getLogger("llmgw.batches")

WINDOW = timedelta(hours=24)
CHUNK = 500  # lines written per transaction
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


class BatchRefused(ServiceError):
    """A request about files or batches refused: the status, why (with the numbers), and the error's
    type, code and param as the APIs name them (the code only where those APIs give one)."""

    code = None

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", code: str | None = None,
        param: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message, status=status, code=code)
        self.kind, self.param = kind, param


@dataclass(frozen=True)
class Owner:
    """Who asks: a key's ids (from the gateway's key table), or a person with no key (staff)."""

    user_id: int
    key_id: int | None = None
    org_id: int | None = None
    team_id: int | None = None
    project_id: int | None = None

    def scope(self) -> Q:
        """The files and batches this key may see: its project's, or (without a project) its owner's own."""
        if self.project_id is not None:
            return Q(project_id=self.project_id)
        return Q(project__isnull=True, user_id=self.user_id)

    def storage_scope(self) -> Q:
        """Whose files count against the same storage limit: the organisation's, else the person's."""
        if self.org_id is not None:
            return Q(organization_id=self.org_id)
        return Q(organization__isnull=True, user_id=self.user_id)


def _new_id(prefix: str, hex_chars: int = 24) -> str:
    return prefix + secrets.token_hex(hex_chars // 2)


def request_id(batch_id: str, number: int, tries: int) -> str:
    """The request id of a line's try: the same whenever the same try is run again (its process died
    before its answer was written), another for the next try (the first one's usage is recorded)."""
    return "req_" + hashlib.sha256(f"{batch_id}:{number}:{tries}".encode()).hexdigest()[:32]


def _derived_file_id(batch_id: str, which: str) -> str:
    return "file-" + hashlib.sha256(f"{batch_id}:{which}".encode()).hexdigest()[:24]


def _window_end() -> Any:
    return timezone.now() + timedelta(days=settings.BATCH_FILE_DAYS)


# Files -------------------------------------------------------------------------------------------


def files_for(owner: Owner) -> QuerySet[BatchFile]:
    return BatchFile.objects.filter(owner.scope())


def get_file(owner: Owner, file_id: str) -> BatchFile:
    found = files_for(owner).filter(pk=file_id).first()
    if found is None:
        raise BatchRefused(404, f"No such File object: {file_id[:100]}", kind="not_found_error", param="file_id")
    return found


def _stored(owner: Owner) -> int:
    return int(BatchFile.objects.filter(owner.storage_scope()).aggregate(total=Sum("bytes"))["total"] or 0)


def upload_bound(owner: Owner) -> int:
    """The most bytes the next file may have: a file's bound, or what the organisation's storage
    limit leaves; refused with the numbers when it leaves nothing."""
    limit = settings.BATCH_ORG_STORAGE_BYTES
    used = _stored(owner)
    if used >= limit:
        raise BatchRefused(
            413,
            f"This organisation's files hold {used} bytes, and it may hold {limit} (LLMGW_BATCH_ORG_STORAGE_BYTES); "
            "delete files to make room.",
            code="storage_limit_exceeded",
        )
    return min(settings.BATCH_MAX_FILE_BYTES, limit - used)


def create_file(owner: Owner, sink: storage.Sink, *, purpose: str, filename: str) -> BatchFile:
    """Keep an uploaded file whole (its bytes written by `sink`) as the owner's."""
    limit = settings.BATCH_ORG_STORAGE_BYTES
    used = _stored(owner)
    if used + sink.size > limit:  # another upload took the room meanwhile
        sink.discard()
        raise BatchRefused(
            413,
            f"This file has {sink.size} bytes; this organisation's files hold {used} bytes already and it may "
            f"hold {limit} (LLMGW_BATCH_ORG_STORAGE_BYTES).",
            code="storage_limit_exceeded",
        )
    file_id = _new_id("file-")
    sink.commit(file_id)
    try:
        with transaction.atomic():
            row = BatchFile.objects.create(
                id=file_id,
                organization_id=owner.org_id,
                project_id=owner.project_id,
                user_id=owner.user_id,
                api_key_id=owner.key_id,
                purpose=purpose,
                filename=filename[:255] or "file",
                bytes=sink.size,
                line_count=sink.line_count,
                expires_at=_window_end() if purpose == FilePurpose.BATCH else None,
            )
            audit.record(_user(owner), "batch_file.create", row, purpose=purpose, bytes=sink.size, key=owner.key_id)
    except BaseException:
        storage.remove(file_id)
        raise
    return row


def _user(owner: Owner) -> User | None:
    return User.objects.filter(pk=owner.user_id).first()


def delete_file(owner: Owner, file_id: str, *, actor: User | None = None) -> None:
    row = get_file(owner, file_id)
    with transaction.atomic():
        audit.record(actor or _user(owner), "batch_file.delete", row, key=owner.key_id)
        row.delete()
    storage.remove(file_id)


# Batches: made and cancelled ---------------------------------------------------------------------------


def batches_for(owner: Owner, kind: str) -> QuerySet[Batch]:
    return Batch.objects.filter(owner.scope(), kind=kind)


def get_batch(owner: Owner, batch_id: str, kind: str) -> Batch:
    found = batches_for(owner, kind).filter(pk=batch_id).first()
    if found is None:
        what = "Message Batch" if kind == Kind.ANTHROPIC else "Batch"
        raise BatchRefused(404, f"No such {what}: {batch_id[:100]}", kind="not_found_error")
    return found


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_KEYS:
        raise BatchRefused(400, f"'metadata' must be an object of at most {METADATA_KEYS} keys.", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > METADATA_VALUE_CHARS:
            raise BatchRefused(
                400,
                f"'metadata': keys are at most {METADATA_KEY_CHARS} characters and values strings of at most "
                f"{METADATA_VALUE_CHARS}.",
                param="metadata",
            )
    return metadata


def _output_expiry(value: Any) -> None:
    if value is None:
        return
    seconds = value.get("seconds") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("anchor") != "created_at" or not isinstance(seconds, int):
        raise BatchRefused(
            400, "'output_expires_after' must be {anchor: created_at, seconds}.", param="output_expires_after"
        )
    if not 3600 <= seconds <= 2_592_000:
        raise BatchRefused(
            400, f"'output_expires_after.seconds' must be 3600 to 2592000, got {seconds}.", param="output_expires_after"
        )


def create_openai_batch(owner: Owner, body: dict[str, Any], endpoints: Iterable[str]) -> Batch:
    """A batch of an uploaded input file, validating until a web process has read it."""
    from apps.batches.validation import OPENAI_ENDPOINTS

    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(body.get(name), str):
            raise BatchRefused(
                400, f"Missing required parameter: '{name}'.", code="missing_required_parameter", param=name
            )
    endpoint = body["endpoint"]
    if endpoint not in OPENAI_ENDPOINTS or endpoint not in endpoints:
        raise BatchRefused(
            400,
            f"The endpoint “{endpoint[:100]}” is not supported for batches here; the endpoints are "
            f"{', '.join(e for e in OPENAI_ENDPOINTS if e in endpoints)}.",
            code="invalid_value",
            param="endpoint",
        )
    if body["completion_window"] != "24h":
        raise BatchRefused(400, "'completion_window' must be 24h.", code="invalid_value", param="completion_window")
    metadata = _check_metadata(body.get("metadata"))
    _output_expiry(body.get("output_expires_after"))
    source = get_file(owner, body["input_file_id"])
    if source.purpose != FilePurpose.BATCH:
        raise BatchRefused(
            400, f"The file {source.id} was uploaded with purpose {source.purpose}, not batch.", param="input_file_id"
        )
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.create(
            id=_new_id("batch_", 32),
            kind=Kind.OPENAI,
            organization_id=owner.org_id,
            team_id=owner.team_id,
            project_id=owner.project_id,
            user_id=owner.user_id,
            api_key_id=owner.key_id,
            endpoint=endpoint,
            input_file=source,
            input_file_name=source.id,
            metadata=metadata,
            created_at=now,
            expires_at=now + WINDOW,
        )
        audit.record(_user(owner), "batch.create", batch, endpoint=endpoint, key=owner.key_id)
    return batch


def _allowed_models(key_id: int | None) -> frozenset[str] | None:
    if key_id is None:
        return None
    allowed = ApiKey.objects.filter(pk=key_id).values_list("allowed_models", flat=True).first()
    return frozenset(allowed) if allowed else None


def create_anthropic_batch(owner: Owner, requests: Iterator[Any]) -> Batch:
    """A Message Batch of the requests read from the create call's body, one by one. A problem that
    Anthropic refuses the whole call for refuses it here (nothing is kept)."""
    now = timezone.now()
    reading = Reading(endpoint="/v1/messages", allowed_models=_allowed_models(owner.key_id), same_model=False)
    with transaction.atomic():
        batch = Batch.objects.create(
            id="msgbatch_" + secrets.token_hex(12),
            kind=Kind.ANTHROPIC,
            organization_id=owner.org_id,
            team_id=owner.team_id,
            project_id=owner.project_id,
            user_id=owner.user_id,
            api_key_id=owner.key_id,
            endpoint="/v1/messages",
            status=BatchStatus.IN_PROGRESS,
            created_at=now,
            in_progress_at=now,
            expires_at=now + WINDOW,
        )
        total, refused = _write_lines(
            batch, _anthropic_checked(reading, requests), reading, settings.MESSAGE_BATCH_MAX_REQUESTS
        )
        problem = next((p for p in reading.problems if p.fatal), None)
        if problem is not None or total == 0:
            message = problem.message if problem else "requests: at least one request is needed."
            raise BatchRefused(400, message, param="requests")
        Batch.objects.filter(pk=batch.pk).update(total=total, failed=refused, errors=reading.errors())
        audit.record(_user(owner), "batch.create", batch, endpoint="/v1/messages", key=owner.key_id)
    batch.refresh_from_db()
    return batch


def _anthropic_checked(reading: Reading, requests: Iterator[Any]) -> Iterator[Checked | Problem]:
    for number, value in enumerate(requests, start=1):
        if number > settings.MESSAGE_BATCH_MAX_REQUESTS:
            most = settings.MESSAGE_BATCH_MAX_REQUESTS
            message = f"requests: more than {most} requests (LLMGW_MESSAGE_BATCH_MAX_REQUESTS)."
            yield Problem("too_many_requests", message)
            return
        checked = check_anthropic_request(reading, number, value)
        if checked is not None:
            yield checked
        elif reading.fatal:
            return


def cancel_batch(owner: Owner | None, batch: Batch, *, actor: User | None) -> Batch:
    """Stop a batch: nothing more is started; it is `cancelled` once what runs has ended. A batch
    that has ended is left as it is (and said so)."""
    now = timezone.now()
    with transaction.atomic():
        moved = Batch.objects.filter(
            pk=batch.pk, status__in=[BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING]
        ).update(status=BatchStatus.CANCELLING, cancelling_at=now)
        batch.refresh_from_db()
        if not moved and batch.status != BatchStatus.CANCELLING:
            raise BatchRefused(409, f"Cannot cancel a batch that is {batch.status}.", code="batch_ended")
        if moved:
            audit.record(actor, "batch.cancel", batch, key=owner.key_id if owner else None)
    return batch


def delete_batch(owner: Owner, batch: Batch, *, actor: User | None) -> None:
    """Remove an ended Message Batch, its lines and its results."""
    if not batch.ended:
        raise BatchRefused(
            400, f"Message Batch {batch.id} is still {batch.status}; cancel it first, or wait until it has ended."
        )
    files = [f for f in (batch.output_file_id, batch.error_file_id) if f]
    with transaction.atomic():
        audit.record(actor, "batch.delete", batch, key=owner.key_id)
        BatchFile.objects.filter(pk__in=files).delete()
        batch.delete()
    for file_id in files:
        storage.remove(file_id)


# Validation --------------------------------------------------------------------------------------


def _take_batch(batch_id: str, holder: str, statuses: list[str]) -> bool:
    now = timezone.now()
    hold = timedelta(seconds=settings.BATCH_LEASE_SECONDS * 2)
    return bool(
        Batch.objects.filter(pk=batch_id, status__in=statuses)
        .filter(Q(lease_until__isnull=True) | Q(lease_until__lt=now) | Q(lease_owner=holder))
        .update(lease_owner=holder, lease_until=now + hold)
    )


def _line_row(batch: Batch, checked: Checked) -> BatchLine:
    row = BatchLine(batch=batch, number=checked.number, custom_id=checked.custom_id, model=checked.model)
    row.body = checked.body
    refusal = checked.refusal
    if refusal is not None:  # answered now, never sent
        protocol = "anthropic" if batch.kind == Kind.ANTHROPIC else "openai"
        row.state = LineState.ERROR
        row.status_code = refusal["status"]
        row.response = error_body(
            protocol, refusal["status"], refusal["message"], refusal["type"], refusal["code"], refusal["param"]
        )
        row.body = None
        row.finished_at = timezone.now()
    return row


def _write_lines(
    batch: Batch,
    found: Iterable[Checked | Problem],
    reading: Reading,
    most: int,
    renew: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Write the lines found (CHUNK at a time) until a fatal problem; (lines kept, lines refused)."""
    rows: list[BatchLine] = []
    total = refused = 0
    for item in found:
        if isinstance(item, Problem):
            reading.note(item)
            break
        total += 1
        if total > most:
            reading.note(
                Problem(
                    "too_many_tasks", f"The file has more than {most} requests (the most one batch takes).", item.number
                )
            )
            break
        if reading.fatal:
            continue  # keep reading for the problems of the rest, writing nothing more
        row = _line_row(batch, item)
        refused += row.state == LineState.ERROR
        rows.append(row)
        if len(rows) >= CHUNK:
            BatchLine.objects.bulk_create(rows)
            rows = []
            if renew is not None:
                renew()
    if rows and not reading.fatal:
        BatchLine.objects.bulk_create(rows)
    return total, refused


def _openai_checked(reading: Reading, lines: Iterable[tuple[int, bytes]]) -> Iterator[Checked]:
    for number, raw in lines:
        checked = check_openai_line(reading, number, raw)
        if checked is not None:
            yield checked


def validate_batch(batch_id: str, holder: str) -> str | None:
    """Read a validating batch's input file into its lines; the status it then has (None when another
    process holds it)."""
    if not _take_batch(batch_id, holder, [BatchStatus.VALIDATING]):
        return None
    batch = Batch.objects.select_related("input_file").get(pk=batch_id)
    BatchLine.objects.filter(batch=batch).delete()  # what a validation cut short wrote
    reading = Reading(endpoint=batch.endpoint, allowed_models=_allowed_models(batch.api_key_id))

    def renew() -> None:
        _take_batch(batch_id, holder, [BatchStatus.VALIDATING, BatchStatus.CANCELLING])

    total = refused = 0
    if batch.input_file is None or not storage.file_path(batch.input_file.id).exists():
        reading.note(Problem("file_not_found", f"The input file {batch.input_file_name} was deleted."))
    else:
        lines = storage.read_lines(batch.input_file.id)
        total, refused = _write_lines(batch, _openai_checked(reading, lines), reading, settings.BATCH_MAX_LINES, renew)
        if total == 0 and not reading.problems:
            reading.note(Problem("empty_file", "The input file holds no requests."))
    return _validated(batch, reading, total, refused, holder)


def _validated(batch: Batch, reading: Reading, total: int, refused: int, holder: str) -> str:
    now = timezone.now()
    with transaction.atomic():
        if reading.fatal:
            BatchLine.objects.filter(batch=batch).delete()
            moved = Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
                status=BatchStatus.FAILED, failed_at=now, errors=reading.errors(), lease_owner="", lease_until=None
            )
            return BatchStatus.FAILED if moved else Batch.objects.get(pk=batch.pk).status
        figures = {"total": total, "failed": refused, "errors": reading.errors(), "model": reading.model or ""}
        moved = Batch.objects.filter(pk=batch.pk, status=BatchStatus.VALIDATING).update(
            status=BatchStatus.IN_PROGRESS, in_progress_at=now, lease_owner="", lease_until=None, **figures
        )
        if not moved:  # cancelled while it was read: its lines are cancelled by advance()
            Batch.objects.filter(pk=batch.pk).update(in_progress_at=now, lease_owner="", lease_until=None, **figures)
    return Batch.objects.get(pk=batch.pk).status


# Running lines -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LineWork:
    """A line a web process took: what to send, as whom, and which try it is."""

    id: int
    batch_id: str
    number: int
    endpoint: str
    model: str
    body: dict[str, Any]
    key_hash: str
    tries: int
    failures: int
    kind: str

    @property
    def request_id(self) -> str:
        return request_id(self.batch_id, self.number, self.tries)


@dataclass
class Outcome:
    """How a try of a line ended. `retry`: it goes back to pending (after `backoff_s`), counting a failed
    try when `failed`; otherwise its answer (`status_code`, `response`) is the line's."""

    line: LineWork
    status_code: int | None = None
    response: Any = None
    retry: bool = False
    failed: bool = False
    backoff_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None
    yielded: bool = False  # cut off for an interactive request (then `retry` too)


def _open_lines(now: Any) -> Q:
    """Lines a process may take: pending ones past their backoff, and running ones whose holder let go."""
    return Q(state=LineState.PENDING, lease_until__isnull=True) | Q(
        state__in=[LineState.PENDING, LineState.RUNNING], lease_until__lt=now
    )


def claim_lines(holder: str, wanted: dict[str, int], *, others: int = 1) -> list[LineWork]:
    """Take up to `wanted[model]` lines of each model (`others` of a model not named) from the batches
    in progress, a fair part from each batch, oldest batch first. Each taken line is leased to `holder`."""
    now = timezone.now()
    active = list(
        Batch.objects.filter(status=BatchStatus.IN_PROGRESS, expires_at__gt=now, api_key__isnull=False)
        .order_by("created_at")
        .values_list("pk", flat=True)[:200]
    )
    if not active:
        return []
    models = set(
        BatchLine.objects.filter(_open_lines(now), batch_id__in=active).values_list("model", flat=True).distinct()
    )
    ids: list[int] = []
    for model in sorted(models):
        want = wanted.get(model, others)
        if want <= 0:
            continue
        per_batch = max(1, math.ceil(want / len(active)))
        for batch_id in active:
            if want <= 0:
                break
            found = list(
                BatchLine.objects.filter(_open_lines(now), batch_id=batch_id, model=model)
                .order_by("number")
                .values_list("pk", flat=True)[: min(per_batch, want)]
            )
            ids += found
            want -= len(found)
    if not ids:
        return []
    hold = now + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
    BatchLine.objects.filter(_open_lines(now), pk__in=ids).update(
        state=LineState.RUNNING, lease_owner=holder, lease_until=hold
    )
    rows = (
        BatchLine.objects.filter(pk__in=ids, state=LineState.RUNNING, lease_owner=holder)
        .select_related("batch__api_key")
        .order_by("batch__created_at", "number")
    )
    return [
        LineWork(
            id=row.pk,
            batch_id=row.batch_id,
            number=row.number,
            endpoint=row.batch.endpoint,
            model=row.model,
            body=row.body or {},
            key_hash=row.batch.api_key.key_hash if row.batch.api_key else "",
            tries=row.tries,
            failures=row.failures,
            kind=row.batch.kind,
        )
        for row in rows
    ]


def renew_leases(holder: str, line_ids: list[int]) -> int:
    """Hold the lines this process runs or will run a while longer; how many it still holds."""
    hold = timezone.now() + timedelta(seconds=settings.BATCH_LEASE_SECONDS)
    held = 0
    for start in range(0, len(line_ids), 1000):
        held += BatchLine.objects.filter(
            pk__in=line_ids[start : start + 1000], state=LineState.RUNNING, lease_owner=holder
        ).update(lease_until=hold)
    return held


def release_lines(holder: str, line_ids: list[int]) -> int:
    """Give back lines taken but never sent (this process is stopping)."""
    return BatchLine.objects.filter(pk__in=line_ids, state=LineState.RUNNING, lease_owner=holder).update(
        state=LineState.PENDING, lease_owner="", lease_until=None
    )


@dataclass
class _Sums:
    succeeded: int = 0
    failed: int = 0
    prompt: int = 0
    completion: int = 0
    unknown: int = 0
    counts: Counter[str] = field(default_factory=Counter)


@transaction.atomic
def finish_lines(holder: str, outcomes: list[Outcome]) -> Counter[str]:
    """Write how each try ended, only for the lines `holder` still holds, with their batches'
    counters in the same transaction; what was written, by outcome (succeeded, failed, retried)."""
    now = timezone.now()
    sums: dict[str, _Sums] = {}
    written: Counter[str] = Counter()
    for outcome in outcomes:
        line = outcome.line
        mine = BatchLine.objects.filter(pk=line.id, state=LineState.RUNNING, lease_owner=holder)
        if outcome.retry:
            later = now + timedelta(seconds=outcome.backoff_s) if outcome.backoff_s > 0 else None
            if mine.update(
                state=LineState.PENDING,
                tries=F("tries") + 1,
                failures=F("failures") + int(outcome.failed),
                lease_owner="",
                lease_until=later,
            ):
                written["retried"] += 1
                written["yielded"] += outcome.yielded
            continue
        ok = outcome.status_code is not None and 200 <= outcome.status_code < 300
        if not mine.update(
            state=LineState.DONE if ok else LineState.ERROR,
            status_code=outcome.status_code,
            response=outcome.response,
            error=outcome.error,
            request_id=line.request_id if outcome.status_code is not None else "",
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            tries=F("tries") + 1,
            failures=F("failures") + int(outcome.failed),
            finished_at=now,
            lease_owner="",
            lease_until=None,
            body=None if ok else F("body"),
        ):
            continue
        sums_of = sums.setdefault(line.batch_id, _Sums())
        sums_of.succeeded += ok
        sums_of.failed += not ok
        if outcome.prompt_tokens is None or outcome.completion_tokens is None:
            sums_of.unknown += outcome.status_code is not None
        sums_of.prompt += outcome.prompt_tokens or 0
        sums_of.completion += outcome.completion_tokens or 0
        written["succeeded" if ok else "failed"] += 1
    for batch_id, s in sums.items():
        Batch.objects.filter(pk=batch_id).update(
            succeeded=F("succeeded") + s.succeeded,
            failed=F("failed") + s.failed,
            prompt_tokens=F("prompt_tokens") + s.prompt,
            completion_tokens=F("completion_tokens") + s.completion,
            lines_without_tokens=F("lines_without_tokens") + s.unknown,
        )
    tally(written)
    return written


def tally(counts: Mapping[str, int]) -> None:
    """Add to the tries' tally (llmgw_batch_lines_total), in the caller's transaction."""
    for status, count in counts.items():
        if count and not LineTally.objects.filter(status=status).update(count=F("count") + count):
            LineTally.objects.bulk_create([LineTally(status=status)], ignore_conflicts=True)
            LineTally.objects.filter(status=status).update(count=F("count") + count)


# Ending batches -------------------------------------------------------------------------------------------


NOT_RUN_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
}


@transaction.atomic
def _answer_unrun(batch_id: str, code: str, *, running_too: bool) -> int:
    """Answer the lines not started (and, with `running_too`, those started) with why they were not run."""
    now = timezone.now()
    lines = BatchLine.objects.filter(batch_id=batch_id)
    lines = (
        lines.filter(state__in=[LineState.PENDING, LineState.RUNNING])
        if running_too
        else lines.filter(_open_lines(now) | Q(state=LineState.PENDING))
    )
    count = lines.update(
        state=LineState.ERROR,
        error={"code": code, "message": NOT_RUN_MESSAGES[code]},
        finished_at=now,
        lease_owner="",
        lease_until=None,
    )
    if count:
        which = "expired" if code == "batch_expired" else "canceled"
        Batch.objects.filter(pk=batch_id).update(failed=F("failed") + count, **{which: F(which) + count})
        tally({"expired" if code == "batch_expired" else "cancelled": count})
    return count


def _write_outputs(batch: Batch) -> tuple[BatchFile | None, BatchFile | None]:
    """Write the batch's output files from its rows, in line order; (output file, error file)."""
    anthropic = batch.kind == Kind.ANTHROPIC
    sinks = {
        "output": storage.Sink(max_bytes=2**62),
        "error": storage.Sink(max_bytes=2**62),
    }
    counts = Counter[str]()
    try:
        for line in BatchLine.objects.filter(batch=batch).order_by("number").iterator(chunk_size=1000):
            if anthropic:
                which, entry = "output", anthropic_result(line)
            else:
                which = "output" if line.state == LineState.DONE else "error"
                entry = openai_output_line(line)
            sinks[which].write(jsonl(entry))
            counts[which] += 1
        files: dict[str, BatchFile | None] = {}
        for which, sink in sinks.items():
            if not counts[which]:
                sink.discard()
                files[which] = None
                continue
            file_id = _derived_file_id(batch.id, which)
            sink.commit(file_id)
            name = "results.jsonl" if anthropic else f"batch_{batch.id}_{which}.jsonl"
            files[which] = BatchFile(
                id=file_id,
                organization_id=batch.organization_id,
                project_id=batch.project_id,
                user_id=batch.user_id,
                api_key_id=batch.api_key_id,
                purpose=FilePurpose.BATCH_OUTPUT,
                filename=name,
                bytes=sink.size,
                line_count=counts[which],
                expires_at=_window_end(),
            )
    finally:
        for sink in sinks.values():
            sink.discard()
    return files["output"], files["error"]


def _finalize(batch_id: str, holder: str, status: str, ending: str) -> bool:
    """Write the files of a batch whose lines are all answered, and give it its last status."""
    if not _take_batch(batch_id, holder, [status]):
        return False
    batch = Batch.objects.get(pk=batch_id)
    output, errors = _write_outputs(batch)
    now = timezone.now()
    stamp = {
        BatchStatus.COMPLETED: "completed_at",
        BatchStatus.CANCELLED: "cancelled_at",
        BatchStatus.EXPIRED: "expired_at",
    }[ending]  # type: ignore[index]
    with transaction.atomic():
        for row in (output, errors):
            if row is not None:
                BatchFile.objects.update_or_create(
                    id=row.id, defaults={f.attname: getattr(row, f.attname) for f in BatchFile._meta.concrete_fields}
                )
        moved = Batch.objects.filter(pk=batch_id, status=status, lease_owner=holder).update(
            status=ending,
            output_file=output,
            error_file=errors,
            lease_owner="",
            lease_until=None,
            **{stamp: now},
        )
    return bool(moved)


def _open_count(batch_id: str, live_only: bool) -> int:
    lines = BatchLine.objects.filter(batch_id=batch_id, state__in=[LineState.PENDING, LineState.RUNNING])
    if live_only:
        lines = lines.filter(state=LineState.RUNNING, lease_until__gte=timezone.now())
    return lines.count()


def _expire(holder: str, now: Any) -> None:
    for batch_id in Batch.objects.filter(
        status__in=[BatchStatus.IN_PROGRESS, BatchStatus.VALIDATING], expires_at__lte=now
    ).values_list("pk", flat=True)[:20]:
        Batch.objects.filter(pk=batch_id, status=BatchStatus.VALIDATING).update(
            status=BatchStatus.IN_PROGRESS, in_progress_at=now
        )
        _answer_unrun(batch_id, "batch_expired", running_too=True)
        _finalize(batch_id, holder, BatchStatus.IN_PROGRESS, BatchStatus.EXPIRED)


def _cancel(holder: str) -> None:
    for batch_id in Batch.objects.filter(status=BatchStatus.CANCELLING).values_list("pk", flat=True)[:20]:
        batch = Batch.objects.get(pk=batch_id)
        if batch.in_progress_at is None:  # never read: nothing ran, nothing to write
            Batch.objects.filter(pk=batch_id, status=BatchStatus.CANCELLING, in_progress_at__isnull=True).update(
                status=BatchStatus.CANCELLED, cancelled_at=timezone.now()
            )
            continue
        _answer_unrun(batch_id, "batch_cancelled", running_too=False)
        if not _open_count(batch_id, live_only=False):
            _finalize(batch_id, holder, BatchStatus.CANCELLING, BatchStatus.CANCELLED)


def _complete(holder: str, now: Any) -> None:
    answered = Batch.objects.filter(
        status=BatchStatus.IN_PROGRESS, expires_at__gt=now, total=F("succeeded") + F("failed")
    )
    for batch_id in answered.values_list("pk", flat=True)[:20]:
        Batch.objects.filter(pk=batch_id, status=BatchStatus.IN_PROGRESS).update(
            status=BatchStatus.FINALIZING, finalizing_at=now
        )
    for batch_id in Batch.objects.filter(status=BatchStatus.FINALIZING).values_list("pk", flat=True)[:20]:
        _finalize(batch_id, holder, BatchStatus.FINALIZING, BatchStatus.COMPLETED)


def advance(holder: str, *, validate: bool = True) -> None:
    """Take every batch one step on where one is due (see the module's docstring); safe to run in
    several processes at once. `validate`: read batches waiting to be validated too (heavier)."""
    now = timezone.now()
    _expire(holder, now)
    _cancel(holder)
    _complete(holder, now)
    if validate:
        waiting = Batch.objects.filter(status=BatchStatus.VALIDATING).filter(
            Q(lease_until__isnull=True) | Q(lease_until__lt=now)
        )
        for batch_id in waiting.order_by("created_at").values_list("pk", flat=True)[:5]:
            validate_batch(batch_id, holder)


def sweep(holder: str) -> dict[str, int]:
    """The beat's part (every minute): batches past their window expire even with no web process
    running lines; files past their expiry are removed, and temporary files left by dead processes."""
    now = timezone.now()
    _expire(holder, now)
    removed = 0
    for row in BatchFile.objects.filter(expires_at__lt=now)[:500]:
        with contextlib.suppress(Exception):
            with transaction.atomic():
                Batch.objects.filter(output_file=row).update(output_file=None)
                Batch.objects.filter(error_file=row).update(error_file=None)
                row.delete()
            storage.remove(row.id)
            removed += 1
    return {"files_removed": removed, "temporary_removed": storage.sweep_temporary()}
