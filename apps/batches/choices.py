from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["BatchStatus", "FilePurpose", "Kind", "LineState"]


class Kind(models.TextChoices):
    """Which API a batch was made through: its shape, its ids and its result lines follow that API."""

    OPENAI = "openai", _("OpenAI Batches")
    ANTHROPIC = "anthropic", _("Anthropic Message Batches")


class BatchStatus(models.TextChoices):
    """A batch's life, as OpenAI names it (an Anthropic batch's processing_status is read from it)."""

    VALIDATING = "validating", _("Validating")
    FAILED = "failed", _("Failed")
    IN_PROGRESS = "in_progress", _("In progress")
    FINALIZING = "finalizing", _("Finalizing")
    COMPLETED = "completed", _("Completed")
    EXPIRED = "expired", _("Expired")
    CANCELLING = "cancelling", _("Cancelling")
    CANCELLED = "cancelled", _("Cancelled")


#: Statuses a batch never leaves.
ENDED = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED})


class LineState(models.TextChoices):
    """One request of a batch: waiting, being run by a web process, answered 2xx, or not."""

    PENDING = "pending", _("Pending")
    RUNNING = "running", _("Running")
    DONE = "done", _("Succeeded")
    ERROR = "error", _("Failed")


class FilePurpose(models.TextChoices):
    """What a stored file is for."""

    BATCH = "batch", _("Batch input")
    BATCH_OUTPUT = "batch_output", _("Batch output")
    USER_DATA = "user_data", _("User data")
