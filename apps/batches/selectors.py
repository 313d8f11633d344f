"""Which batches a person sees in the console: staff every one; anyone else those made with their own
keys and those of the projects their memberships reach (as the keys of those projects see them)."""

from __future__ import annotations

from typing import Any

from django.db.models import Q, QuerySet

from apps.accounts.access import can_change_cluster, can_read_everything, is_signed_in
from apps.accounts.selectors import projects_for_user
from apps.batches.choices import BatchStatus
from apps.batches.models import Batch

__all__ = ["can_cancel", "may_cancel", "visible_batches"]


def _own(user: Any) -> Q:
    """The batches of a person's own keys and of the projects their memberships reach."""
    return Q(user_id=user.pk) | Q(project__in=projects_for_user(user))


def visible_batches(user: Any) -> QuerySet[Batch]:
    rows = Batch.objects.select_related("organization", "project__team", "user").order_by("-created_at", "-id")
    if can_read_everything(user):
        return rows
    if not is_signed_in(user):
        return rows.none()
    return rows.filter(_own(user))


def may_cancel(user: Any, batch: Batch) -> bool:
    """Whether the person may cancel this batch, whatever its status: administrators and operators
    any batch; anyone else (staff who only read, too) those of their own keys and projects."""
    if not is_signed_in(user):
        return False
    return can_change_cluster(user) or Batch.objects.filter(_own(user), pk=batch.pk).exists()


def can_cancel(user: Any, batch: Batch) -> bool:
    """Whether to offer cancel: the person may, and the batch runs (one cancelling already is not
    offered again)."""
    return not batch.ended and batch.status != BatchStatus.CANCELLING and may_cancel(user, batch)
