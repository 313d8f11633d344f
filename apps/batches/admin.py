from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.batches.models import Batch, BatchFile, BatchLine, LineTally


@admin.register(BatchFile)
class BatchFileAdmin(ReadOnlyAdmin):
    # Uploaded through /v1/files or written when a batch ends; removed at expiry or on request.
    list_display = ["id", "purpose", "filename", "bytes", "organization", "user", "created_at", "expires_at"]
    list_filter = ["purpose"]
    search_fields = ["id", "filename"]


@admin.register(Batch)
class BatchAdmin(ReadOnlyAdmin):
    # Made through /v1/batches and /v1/messages/batches, run by the web processes' runners,
    # cancelled from the Batches page, the API or `llmgw ctl batch cancel`.
    list_display = ["id", "kind", "status", "model", "organization", "user", "total", "succeeded", "failed"]
    list_filter = ["status", "kind"]
    search_fields = ["id", "model"]


@admin.register(BatchLine)
class BatchLineAdmin(ReadOnlyAdmin):
    # A person's prompt and its answer are not shown here: the batch's owner reads them through the API.
    exclude = ["body", "response"]
    list_display = ["batch", "number", "custom_id", "state", "status_code", "tries", "finished_at"]
    list_filter = ["state"]
    search_fields = ["batch__id", "custom_id"]


@admin.register(LineTally)
class LineTallyAdmin(ReadOnlyAdmin):
    # Counted as lines' tries are written, by whichever process ran them; shown on /metrics.
    list_display = ["status", "count"]
