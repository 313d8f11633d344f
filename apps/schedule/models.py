"""Which scheduler acts, and when each periodic task was last sent (apps/schedule/lease.py)."""

from __future__ import annotations

from django.db import models
from django.utils.translation import gettext_lazy as _

__all__ = ["PeriodicRun", "SchedulerLease"]


class SchedulerLease(models.Model):
    """The right to send periodic tasks, held by one scheduler process at a time until it expires.
    Times are the database's own clock, so schedulers on machines whose clocks differ agree."""

    name = models.CharField(_("name"), max_length=32, unique=True)
    holder = models.CharField(_("holder"), max_length=200)
    acquired_at = models.DateTimeField(_("acting since"))
    renewed_at = models.DateTimeField(_("renewed"))
    expires_at = models.DateTimeField(_("expires"))

    class Meta:
        verbose_name = _("scheduler lease")
        verbose_name_plural = _("scheduler leases")

    def __str__(self) -> str:
        return f"{self.name}: {self.holder}"


class PeriodicRun(models.Model):
    """When a periodic task was last sent, and by which scheduler: a task is sent again only once
    its interval has passed, whichever scheduler sends it."""

    task = models.CharField(_("task"), max_length=200, unique=True)
    sent_at = models.DateTimeField(_("sent"))
    sent_by = models.CharField(_("sent by"), max_length=200)

    class Meta:
        verbose_name = _("periodic run")
        verbose_name_plural = _("periodic runs")

    def __str__(self) -> str:
        return f"{self.task} at {self.sent_at:%H:%M:%S}"
