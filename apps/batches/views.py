"""The console's Batches page: each batch the person may see, its progress (redrawn every two seconds
while any runs), its counts, cancel, and its input, output and error files to download."""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import FileResponse, Http404, HttpResponse
from django.shortcuts import redirect, render
from django.utils.translation import gettext as _

from apps.accounts.access import can_read_everything, requires
from apps.batches import services, storage
from apps.batches.choices import BatchStatus
from apps.batches.models import Batch, BatchFile
from apps.batches.selectors import can_cancel, may_cancel, visible_batches
from llmgw.http import HtmxHttpRequest, is_fragment

__all__ = ["batch_cancel", "batch_detail", "batch_file", "batches"]

SHOWN = 100  # the newest batches listed
SHOWN_PROBLEMS = 500  # a batch's problems listed on its page
POLL_S = 2


def _rows(request: HtmxHttpRequest) -> dict[str, Any]:
    status = request.GET.get("status", "")
    rows = visible_batches(request.user)
    if status in BatchStatus.values:
        rows = rows.filter(status=status)
    else:
        status = ""
    shown = list(rows[:SHOWN])
    return {
        "rows": [{"batch": b, "may_cancel": can_cancel(request.user, b)} for b in shown],
        "status": status,
        "statuses": list(BatchStatus.choices),
        "live": any(not b.ended for b in shown),
        "poll_s": POLL_S,
        "staff": can_read_everything(request.user),
    }


@requires("signed_in", methods=["GET"])
def batches(request: HtmxHttpRequest) -> HttpResponse:
    template = "batches/batches.html"
    if is_fragment(request):
        template += "#batch-table"
    return render(request, template, _rows(request))


def _visible(request: HtmxHttpRequest, pk: str) -> Batch:
    found = visible_batches(request.user).filter(pk=pk).first()
    if found is None:
        raise Http404
    return found


def _detail(request: HtmxHttpRequest, batch: Batch) -> dict[str, Any]:
    ids = {"input": batch.input_file_id, "output": batch.output_file_id, "error": batch.error_file_id}
    stored = BatchFile.objects.in_bulk([file_id for file_id in ids.values() if file_id])
    files = [(which, stored.get(file_id) if file_id else None) for which, file_id in ids.items()]
    problems = list(batch.errors or [])
    metadata = batch.metadata if isinstance(batch.metadata, dict) else {}
    return {
        "batch": batch,
        "may_cancel": can_cancel(request.user, batch),
        # (which, its row; None once deleted or never written)
        "files": files,
        "problems": problems[:SHOWN_PROBLEMS],
        "problems_left": max(len(problems) - SHOWN_PROBLEMS, 0),
        "metadata": sorted(metadata.items()),
        # No line answered yet, or only lines whose engine did not count: the sums are unknown, not zero.
        "tokens_known": batch.done > 0
        and not (batch.lines_without_tokens and not (batch.prompt_tokens or batch.completion_tokens)),
        "live": not batch.ended,
        "poll_s": POLL_S,
    }


@requires("signed_in", methods=["GET"])
def batch_detail(request: HtmxHttpRequest, pk: str) -> HttpResponse:
    """One batch: its counts and progress (redrawn while it runs), tokens, times, files, every problem
    by line, its metadata, and cancel."""
    batch = _visible(request, pk)
    template = "batches/batch_detail.html"
    if is_fragment(request):
        template += "#batch-card"
    return render(request, template, _detail(request, batch))


@requires("signed_in", methods=["POST"])
def batch_cancel(request: HtmxHttpRequest, pk: str) -> HttpResponse:
    batch = _visible(request, pk)
    if not may_cancel(request.user, batch):
        raise PermissionDenied
    try:
        services.cancel_batch(None, batch, actor=request.user)  # type: ignore[arg-type]
    except services.BatchRefused as exc:
        messages.error(request, _("Cannot cancel: %(reason)s") % {"reason": exc.message})
    on_its_page = request.POST.get("from") == "detail"
    if is_fragment(request):
        if on_its_page:
            batch.refresh_from_db()
            return render(request, "batches/batch_detail.html#batch-card", _detail(request, batch))
        return render(request, "batches/batches.html#batch-table", _rows(request))
    if on_its_page:
        return redirect("batches:batch", pk=batch.pk)
    return redirect("batches:batches")


@requires("signed_in", methods=["GET"])
def batch_file(request: HtmxHttpRequest, pk: str, which: str) -> FileResponse:
    """A batch's input, output or error file, as it is stored."""
    batch = _visible(request, pk)
    file_id = {"input": batch.input_file_id, "output": batch.output_file_id, "error": batch.error_file_id}.get(which)
    row = BatchFile.objects.filter(pk=file_id).first() if file_id else None
    if row is None:
        raise Http404
    try:
        handle = storage.file_path(row.id).open("rb")
    except OSError:
        raise Http404 from None
    return FileResponse(handle, as_attachment=True, filename=f"{batch.id}-{which}.jsonl")
