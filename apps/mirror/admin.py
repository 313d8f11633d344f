from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.mirror.models import MirrorFile, MirrorVersion


@admin.register(MirrorVersion)
class MirrorVersionAdmin(ReadOnlyAdmin):
    # Added with the console's Fetch and Explore, `llmgw ctl mirror add` and the API
    # (apps.mirror.services, which checks the source and the disk and audits it).
    list_display = ["repo", "name", "kind", "commit", "created_at"]
    list_filter = ["kind"]
    search_fields = ["repo", "name"]


@admin.register(MirrorFile)
class MirrorFileAdmin(ReadOnlyAdmin):
    # Written by the worker's fetch (apps.mirror.services.fetch_one) as it downloads and verifies.
    list_display = ["version", "path", "size", "state", "bytes_done", "error"]
    list_filter = ["state"]
