from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from apps.quotas.models import CapacityQuota, RateLimit, UsageRecord, UsageRollup


@admin.register(CapacityQuota)
class CapacityQuotaAdmin(admin.ModelAdmin):
    list_display = ["__str__", "gpus", "cpu_cores", "memory_bytes", "replicas"]


@admin.register(RateLimit)
class RateLimitAdmin(admin.ModelAdmin):
    list_display = ["__str__", "requests_per_minute", "tokens_per_minute", "tokens_per_day", "monthly_token_budget"]
    raw_id_fields = ["api_key"]


class ReadOnly(admin.ModelAdmin):
    """Usage is written by the gateway only; the admin reads it."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnly):
    list_display = ["request_id", "created_at", "user", "model", "endpoint", "status", "prompt_tokens",
                    "completion_tokens", "first_token_ms", "total_ms", "hardware"]
    list_filter = ["status", "endpoint", "model", "hardware"]
    search_fields = ["request_id", "model", "user__email"]
    date_hierarchy = "created_at"


@admin.register(UsageRollup)
class UsageRollupAdmin(ReadOnly):
    list_display = ["period", "bucket_start", "model", "requests", "errors", "refusals", "prompt_tokens",
                    "completion_tokens"]
    list_filter = ["period", "model"]
