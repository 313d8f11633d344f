from __future__ import annotations

from django.contrib import admin

from apps.gateway.models import TableVersion


@admin.register(TableVersion)
class TableVersionAdmin(admin.ModelAdmin):
    list_display = ["id", "version"]
    readonly_fields = ["version"]
