"""Exactly one scheduler acts, however many run.

Several `llmgw beat` processes may run for availability (and a worker's embedded beat, as under
`llmgw up`). Every `renew_every()` seconds each asks to hold the one lease: its holder renews it,
any other takes it once it has expired (its holder was killed, or lost the database for
`settings.BEAT_LEASE_SECONDS`), and a holder that cannot renew (the database is away) stops acting
at once. Times are the database's clock, so machines whose clocks differ agree.

Only the holder sends periodic tasks. A second guard holds even if two ever believed they held the
lease: a task is sent only when its `PeriodicRun` row says its interval has passed, and the row
moves in the same statement (a conditional UPDATE), so no task is sent twice within one interval,
across a failover or not. (A slack of a tenth of the interval, at most a second, absorbs the
scheduler's own timing.)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from apps.schedule.models import PeriodicRun, SchedulerLease

__all__ = ["LEASE", "Acting", "acting", "claim_run", "hold", "release", "renew_every"]

LEASE = "beat"


def renew_every() -> float:
    """How often a scheduler asks for the lease: four times per lease, so a holder's renewal can
    be late three times before another takes over."""
    return float(settings.BEAT_LEASE_SECONDS) / 4


def hold(holder: str) -> bool:
    """Renew the lease when `holder` has it, take it when it is free or expired; whether `holder`
    holds it now. Database errors are passed on (the caller then does not act)."""
    until = Now() + timedelta(seconds=float(settings.BEAT_LEASE_SECONDS))
    with transaction.atomic():
        mine = SchedulerLease.objects.filter(name=LEASE, holder=holder)
        if mine.update(renewed_at=Now(), expires_at=until):
            return True
        expired = SchedulerLease.objects.filter(name=LEASE, expires_at__lt=Now())
        if expired.update(holder=holder, acquired_at=Now(), renewed_at=Now(), expires_at=until):
            return True
    try:
        with transaction.atomic():
            SchedulerLease.objects.create(
                name=LEASE, holder=holder, acquired_at=Now(), renewed_at=Now(), expires_at=until
            )
    except IntegrityError:
        return False  # another scheduler holds it
    return True


def release(holder: str) -> None:
    """Give the lease up (a scheduler stopping cleanly), so another takes it at its next ask."""
    SchedulerLease.objects.filter(name=LEASE, holder=holder).delete()


def claim_run(task: str, interval_s: float | None, holder: str) -> bool:
    """Whether `task` may be sent now: its interval has passed since any scheduler last sent it
    (or it has none that can be told). When it may, it is marked sent, in the same statement."""
    slack = min(1.0, (interval_s or 0) / 10)
    due = PeriodicRun.objects.filter(task=task)
    if interval_s:
        due = due.filter(sent_at__lte=Now() - timedelta(seconds=interval_s - slack))
    if due.update(sent_at=Now(), sent_by=holder):
        return True
    try:
        with transaction.atomic():
            PeriodicRun.objects.create(task=task, sent_at=Now(), sent_by=holder)
    except IntegrityError:
        return False  # sent within its interval by this or another scheduler
    return True


@dataclass(frozen=True)
class Acting:
    """The scheduler that acts: `holder` is host:pid:token."""

    holder: str
    since: datetime
    renewed_at: datetime
    expires_at: datetime

    @property
    def host(self) -> str:
        return self.holder.split(":", 1)[0]

    @property
    def pid(self) -> str:
        parts = self.holder.split(":")
        return parts[1] if len(parts) > 1 else ""


def acting() -> Acting | None:
    """The scheduler holding an unexpired lease; None when none acts."""
    row = SchedulerLease.objects.filter(name=LEASE, expires_at__gt=Now()).first()
    if row is None:
        return None
    return Acting(row.holder, row.acquired_at, row.renewed_at, row.expires_at)
