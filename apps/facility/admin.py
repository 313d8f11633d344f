from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.facility.models import Hold


@admin.register(Hold)
class HoldAdmin(ReadOnlyAdmin):
    # Made and released with ctl facility hold / release or the API (apps.facility.services), audited.
    list_display = ["level", "name", "reason", "created_at", "created_by", "released_at"]
    list_filter = ["level"]
    search_fields = ["name", "reason"]
