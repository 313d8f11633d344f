from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.gateway.models import TableVersion


@admin.register(TableVersion)
class TableVersionAdmin(ReadOnlyAdmin):
    # Bumped by apps.gateway.signals whenever keys, limits, models or replicas change; a version
    # set by hand would make every gateway reload, or miss a reload.
    list_display = ["id", "version"]
