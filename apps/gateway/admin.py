from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.gateway.models import StoredResponse, TableVersion


@admin.register(TableVersion)
class TableVersionAdmin(ReadOnlyAdmin):
    # Bumped by apps.gateway.signals whenever keys, limits, models or replicas change; a version
    # set by hand would make every gateway reload, or miss a reload.
    list_display = ["id", "version"]


@admin.register(StoredResponse)
class StoredResponseAdmin(ReadOnlyAdmin):
    # Kept by the gateway for the Responses API until they expire. What was asked and answered is
    # not shown here: the key that stored a response reads it through the API.
    exclude = ["input_items", "response"]
    list_display = ["id", "model", "status", "organization", "user", "depth", "size_bytes", "created_at", "expires_at"]
    search_fields = ["id", "thread", "model"]
