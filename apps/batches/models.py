"""Files and batches: what a key's organisation and project uploaded and asked to be run from idle
capacity, and every line's state and answer.

The database is the source of truth for a batch: each line is a row (pending, running, done, error)
with the answer it got, so the output files are written from the rows, once, when nothing is left to
run, and a line is in them exactly once however often its process died. A file's bytes are on disk
under LLMGW_BATCH_STORAGE_DIR; its row says whose it is and how big.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import ApiKey, Organization, Project, Team
from apps.batches.choices import ENDED, BatchStatus, FilePurpose, Kind, LineState

__all__ = ["Batch", "BatchFile", "BatchLine"]


class BatchFile(models.Model):
    """A file uploaded through /v1/files, or a batch's output or error file.

    Owned by the organisation and project of the key that uploaded it (a key without a project:
    by its owner alone). `line_count` is known for JSONL files (input and output), null otherwise.
    """

    id = models.CharField(_("id"), max_length=40, primary_key=True)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, null=True, blank=True, related_name="+", verbose_name=_("organisation")
    )
    project = models.ForeignKey(
        Project, on_delete=models.CASCADE, null=True, blank=True, related_name="+", verbose_name=_("project")
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", verbose_name=_("owner")
    )
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("API key")
    )
    purpose = models.CharField(_("purpose"), max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(_("file name"), max_length=255)
    bytes = models.BigIntegerField(_("size (bytes)"))
    line_count = models.PositiveIntegerField(_("lines"), null=True, blank=True)
    created_at = models.DateTimeField(_("created"), default=timezone.now, db_index=True)
    expires_at = models.DateTimeField(_("expires"), null=True, blank=True, db_index=True)

    class Meta:
        verbose_name = _("batch file")
        verbose_name_plural = _("batch files")
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class Batch(models.Model):
    """One batch: its lines run through the gateway in the batch band with the key's identity.

    `status` follows OpenAI's names for both kinds (an Anthropic batch shows in_progress, canceling
    or ended). The counters move in the same transaction as the line that moves them, so they are
    the lines' own count at every moment.
    """

    id = models.CharField(_("id"), max_length=40, primary_key=True)
    kind = models.CharField(_("API"), max_length=16, choices=Kind.choices, default=Kind.OPENAI)
    organization = models.ForeignKey(
        Organization, on_delete=models.CASCADE, null=True, blank=True, related_name="+", verbose_name=_("organisation")
    )
    team = models.ForeignKey(
        Team, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("team")
    )
    project = models.ForeignKey(
        Project, on_delete=models.CASCADE, null=True, blank=True, related_name="+", verbose_name=_("project")
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+", verbose_name=_("owner")
    )
    # The key its lines run as; the batch stops (its lines fail, saying why) once the key is gone.
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("API key")
    )
    endpoint = models.CharField(_("endpoint"), max_length=64)
    model = models.CharField(_("model"), max_length=200, blank=True)
    status = models.CharField(
        _("status"), max_length=16, choices=BatchStatus.choices, default=BatchStatus.VALIDATING, db_index=True
    )
    input_file = models.ForeignKey(
        BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("input file")
    )
    # Kept when the file itself is deleted, as the API shows it.
    input_file_name = models.CharField(_("input file id"), max_length=40, blank=True)
    output_file = models.ForeignKey(
        BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("output file")
    )
    error_file = models.ForeignKey(
        BatchFile, on_delete=models.SET_NULL, null=True, blank=True, related_name="+", verbose_name=_("error file")
    )
    completion_window = models.CharField(_("completion window"), max_length=8, default="24h")
    metadata = models.JSONField(_("metadata"), null=True, blank=True)
    # [{"code", "message", "line", "param"}]: why it failed, or which lines failed alone and why.
    errors = models.JSONField(_("errors"), default=list, blank=True)
    total = models.PositiveIntegerField(_("requests"), default=0)
    succeeded = models.PositiveIntegerField(_("succeeded"), default=0)
    failed = models.PositiveIntegerField(_("failed"), default=0)
    # Of the failed: not run at all, because the batch was cancelled or expired first.
    canceled = models.PositiveIntegerField(_("cancelled"), default=0)
    expired = models.PositiveIntegerField(_("expired"), default=0)
    # Known token counts of the lines that reported them; lines that did not are counted apart.
    prompt_tokens = models.PositiveBigIntegerField(_("prompt tokens"), default=0)
    completion_tokens = models.PositiveBigIntegerField(_("completion tokens"), default=0)
    lines_without_tokens = models.PositiveIntegerField(_("lines without token counts"), default=0)
    created_at = models.DateTimeField(_("created"), default=timezone.now, db_index=True)
    in_progress_at = models.DateTimeField(_("started"), null=True, blank=True)
    expires_at = models.DateTimeField(_("expires"), db_index=True)
    finalizing_at = models.DateTimeField(_("finalizing since"), null=True, blank=True)
    completed_at = models.DateTimeField(_("completed"), null=True, blank=True)
    failed_at = models.DateTimeField(_("failed"), null=True, blank=True)
    expired_at = models.DateTimeField(_("expired"), null=True, blank=True)
    cancelling_at = models.DateTimeField(_("cancelling since"), null=True, blank=True)
    cancelled_at = models.DateTimeField(_("cancelled"), null=True, blank=True)
    # Which web process validates or finalizes it now, and until when (a process that died lets go).
    lease_owner = models.CharField(_("held by"), max_length=100, blank=True)
    lease_until = models.DateTimeField(_("held until"), null=True, blank=True)

    class Meta:
        verbose_name = _("batch")
        verbose_name_plural = _("batches")
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @property
    def done(self) -> int:
        """Requests answered either way."""
        return self.succeeded + self.failed

    @property
    def percent(self) -> int:
        return int(100 * self.done / self.total) if self.total else (100 if self.ended else 0)


class BatchLine(models.Model):
    """One request of a batch: its body, its state and the answer it got.

    `tries` counts the tries whose end was seen (an answer that was retried, a line let go for an
    interactive request); the request id of a try is made of the batch, the line and this number, so
    a try run again after its process died carries the same id and its usage is never counted twice.
    """

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines", verbose_name=_("batch"))
    number = models.PositiveIntegerField(_("line"))
    custom_id = models.CharField(_("custom id"), max_length=512)
    model = models.CharField(_("model"), max_length=200, blank=True)
    body = models.JSONField(_("request body"), null=True, blank=True)
    state = models.CharField(_("state"), max_length=8, choices=LineState.choices, default=LineState.PENDING)
    # A refusal found when the batch was read (stream: true, a model the key may not use): the line is
    # answered with it without being sent.
    refusal = models.JSONField(_("refusal"), null=True, blank=True)
    tries = models.PositiveSmallIntegerField(_("tries"), default=0)
    failures = models.PositiveSmallIntegerField(_("failed tries"), default=0)
    lease_owner = models.CharField(_("held by"), max_length=100, blank=True)
    lease_until = models.DateTimeField(_("held until"), null=True, blank=True)
    status_code = models.PositiveSmallIntegerField(_("HTTP status"), null=True, blank=True)
    request_id = models.CharField(_("request id"), max_length=40, blank=True)
    response = models.JSONField(_("response body"), null=True, blank=True)
    # Why it was not run: {"code": "batch_expired" | "batch_cancelled", "message": ...}.
    error = models.JSONField(_("error"), null=True, blank=True)
    prompt_tokens = models.PositiveIntegerField(_("prompt tokens"), null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(_("completion tokens"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)

    class Meta:
        verbose_name = _("batch line")
        verbose_name_plural = _("batch lines")
        ordering = ["batch", "number"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "number"], name="%(app_label)s_%(class)s_unique_batch_number"),
        ]
        indexes = [
            models.Index(fields=["batch", "state"], name="batches_line_batch_state_idx"),
            models.Index(
                fields=["state", "lease_until"],
                name="batches_line_open_idx",
                condition=Q(state__in=["pending", "running"]),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.batch_id} line {self.number}"


class LineTally(models.Model):
    """How batch lines' tries have ended, counted in the same transaction that writes each line, so
    that /metrics on any web process shows the tries of every process that runs lines (Celery
    workers, other web processes, other hosts) and a restart loses none."""

    status = models.CharField(_("how the try ended"), max_length=16, primary_key=True)
    count = models.BigIntegerField(_("tries"), default=0)

    class Meta:
        verbose_name = _("batch line tally")
        verbose_name_plural = _("batch line tallies")

    def __str__(self) -> str:
        return f"{self.status}: {self.count}"
