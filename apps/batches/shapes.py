"""Files, batches and result lines in the shapes of the APIs they are read through.

OpenAI: the File object, the Batch object (times as Unix seconds, `request_counts`, `usage`) and
the output/error file lines `{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}`. Anthropic: the MessageBatch (times in RFC 3339, `processing_status`, `request_counts` as
its reference counts them: every request `processing` until the whole batch has ended) and result
lines `{"custom_id", "result": {"type": "succeeded" | "errored" | "canceled" | "expired", ...}}`.

Unknown stays null: a batch's token counts are the sums of the lines that reported theirs, and
`llmgw.lines_without_tokens` says how many did not; cached and reasoning tokens are not counted by
the engines llmgw runs, so they are null. Pure functions over rows already read.
"""

from __future__ import annotations

import hashlib
import json
import math
from datetime import datetime
from typing import Any

from apps.batches.choices import BatchStatus, LineState
from apps.batches.models import Batch, BatchFile, BatchLine

__all__ = [
    "anthropic_batch",
    "anthropic_result",
    "file_object",
    "line_id",
    "openai_batch",
    "openai_output_line",
    "page",
]

#: Why a line that was never run has no answer (OpenAI's codes).
NOT_RUN = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
}


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def _rfc3339(moment: datetime | None) -> str | None:
    return moment.isoformat().replace("+00:00", "Z") if moment is not None else None


def file_object(row: BatchFile) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "file",
        "bytes": row.bytes,
        "created_at": _unix(row.created_at),
        "expires_at": _unix(row.expires_at),
        "filename": row.filename,
        "purpose": row.purpose,
        "status": "processed",
        "status_details": None,
    }


def _usage(batch: Batch, price_factor: float) -> dict[str, Any]:
    total = batch.prompt_tokens + batch.completion_tokens
    return {
        "input_tokens": batch.prompt_tokens,
        "input_tokens_details": {"cached_tokens": None},
        "output_tokens": batch.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": None},
        "total_tokens": total,
    }


def llmgw_figures(batch: Batch, price_factor: float) -> dict[str, Any]:
    """What llmgw adds to both shapes: the lines without token counts, and what the tokens were charged."""
    total = batch.prompt_tokens + batch.completion_tokens
    return {
        "lines_without_tokens": batch.lines_without_tokens,
        "charged_tokens": math.ceil(total * price_factor),
        "price_factor": price_factor,
        "organization_id": batch.organization_id,
        "project_id": batch.project_id,
    }


def openai_batch(batch: Batch, price_factor: float) -> dict[str, Any]:
    errors = {"object": "list", "data": batch.errors} if batch.errors else None
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": errors,
        "input_file_id": batch.input_file_name,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _unix(batch.created_at),
        "in_progress_at": _unix(batch.in_progress_at),
        "expires_at": _unix(batch.expires_at),
        "finalizing_at": _unix(batch.finalizing_at),
        "completed_at": _unix(batch.completed_at),
        "failed_at": _unix(batch.failed_at),
        "expired_at": _unix(batch.expired_at),
        "cancelling_at": _unix(batch.cancelling_at),
        "cancelled_at": _unix(batch.cancelled_at),
        "request_counts": {"total": batch.total, "completed": batch.succeeded, "failed": batch.failed},
        "metadata": batch.metadata,
        "usage": _usage(batch, price_factor),
        "llmgw": llmgw_figures(batch, price_factor),
    }


def _processing_status(status: str) -> str:
    if status == BatchStatus.CANCELLING:
        return "canceling"
    if batch_ended(status):
        return "ended"
    return "in_progress"


def batch_ended(status: str) -> bool:
    return status in (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


def anthropic_batch(batch: Batch, results_url: str | None, price_factor: float) -> dict[str, Any]:
    ended = batch_ended(batch.status)
    run_failed = batch.failed - batch.canceled - batch.expired
    counts = (
        {
            "processing": 0,
            "succeeded": batch.succeeded,
            "errored": run_failed,
            "canceled": batch.canceled,
            "expired": batch.expired,
        }
        if ended
        else {"processing": batch.total, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
    )
    ended_at = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    return {
        "id": batch.id,
        "type": "message_batch",
        "processing_status": _processing_status(batch.status),
        "request_counts": counts,
        "ended_at": _rfc3339(ended_at) if ended else None,
        "created_at": _rfc3339(batch.created_at),
        "expires_at": _rfc3339(batch.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(batch.cancelling_at),
        "results_url": results_url if ended and batch.output_file_id else None,
        "llmgw": llmgw_figures(batch, price_factor),
    }


def line_id(batch_id: str, number: int) -> str:
    """The id of a line's entry in the output files, the same every time they are written."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{number}".encode()).hexdigest()[:32]


def openai_output_line(line: BatchLine) -> dict[str, Any]:
    """The line's entry in the output file (answered 2xx) or the error file (anything else)."""
    entry: dict[str, Any] = {"id": line_id(line.batch_id, line.number), "custom_id": line.custom_id}
    if line.status_code is not None:
        entry["response"] = {"status_code": line.status_code, "request_id": line.request_id, "body": line.response}
        entry["error"] = None
    else:
        error = line.error or {"code": "batch_failed", "message": "This request was not run."}
        entry["response"] = None
        entry["error"] = {"code": error.get("code"), "message": error.get("message")}
    return entry


def anthropic_result(line: BatchLine) -> dict[str, Any]:
    """The line's entry in an Anthropic batch's results."""
    if line.state == LineState.DONE:
        result: dict[str, Any] = {"type": "succeeded", "message": line.response}
    elif line.status_code is None and line.error and line.error.get("code") in ("batch_cancelled", "batch_expired"):
        result = {"type": "canceled" if line.error["code"] == "batch_cancelled" else "expired"}
    else:
        body = line.response if isinstance(line.response, dict) and line.response.get("type") == "error" else None
        if body is None:
            message = (line.error or {}).get("message") or "The request failed."
            body = {"type": "error", "error": {"type": "api_error", "message": message}}
        result = {"type": "errored", "error": body}
    return {"custom_id": line.custom_id, "result": result}


def page(items: list[dict[str, Any]], has_more: bool, *, anthropic: bool = False) -> dict[str, Any]:
    """A list answer: OpenAI's {object: list, data, first_id, last_id, has_more}; Anthropic's without `object`."""
    body: dict[str, Any] = {
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
    if not anthropic:
        body = {"object": "list", **body}
    return body


def jsonl(entry: dict[str, Any]) -> bytes:
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
