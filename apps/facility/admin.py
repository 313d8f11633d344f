from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import ReadOnlyAdmin
from apps.facility.models import Budget, Hold


@admin.register(Hold)
class HoldAdmin(ReadOnlyAdmin):
    # Made and released with ctl facility hold / release or the API (apps.facility.services), audited.
    list_display = ["level", "name", "reason", "created_at", "created_by", "released_at"]
    list_filter = ["level"]
    search_fields = ["name", "reason"]


@admin.register(Budget)
class BudgetAdmin(ReadOnlyAdmin):
    # From server.yaml's facility.budgets at start, or set with ctl facility budget / the API.
    list_display = ["level", "name", "watts", "redundant", "source", "updated_at"]
    list_filter = ["level", "source"]
    search_fields = ["name"]
