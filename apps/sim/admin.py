from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.sim.models import SimRun


@admin.register(SimRun)
class SimRunAdmin(ReadOnlyAdmin):
    # Asked from /sim/ and POST /api/v1/sim (apps.sim.runs), run by the worker, swept after a day.
    list_display = ["pk", "owner", "state", "title", "created_at", "finished_at"]
    list_filter = ["state"]
