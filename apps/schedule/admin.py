from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.schedule.models import PeriodicRun, SchedulerLease


@admin.register(SchedulerLease)
class SchedulerLeaseAdmin(ReadOnlyAdmin):
    # Held and renewed by the acting beat (apps.schedule.lease.hold); it expires by itself.
    list_display = ["name", "holder", "acquired_at", "renewed_at", "expires_at"]


@admin.register(PeriodicRun)
class PeriodicRunAdmin(ReadOnlyAdmin):
    # Moved by the beat that sends each periodic task (apps.schedule.lease.claim_run).
    list_display = ["task", "sent_at", "sent_by"]
    search_fields = ["task"]
