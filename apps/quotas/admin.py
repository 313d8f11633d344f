"""The Django admin for rate limits, capacity quotas and usage.

Limits and quotas are made, changed and deleted through apps.quotas.services, which audit
each as the console and the API do. Usage is written by the gateway alone.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest

from apps.accounts.admin import ReadOnlyAdmin, actor_of, adopt
from apps.quotas import services
from apps.quotas.models import LIMIT_FIELDS, CapacityQuota, HeldTime, RateLimit, UsageRecord, UsageRollup
from llmgw.http import client_address


class LimitAdmin(admin.ModelAdmin):
    """Made, changed and deleted through quotas.services. The owner is chosen when one is made
    and read-only after (the services change limits only, never whose they are)."""

    owner_fields: tuple[str, ...] = ()
    limit_fields: tuple[str, ...] = ()
    create_service: Any = None
    update_service: Any = None
    delete_service: Any = None

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = list(super().get_readonly_fields(request, obj))
        return [*fields, *self.owner_fields] if obj is not None else fields

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        actor, address = actor_of(request), client_address(request)
        if change:
            changes = {name: getattr(obj, name) for name in self.limit_fields if name in form.changed_data}
            if changes:
                self.update_service(type(obj)._default_manager.get(pk=obj.pk), actor=actor, address=address, **changes)
            return
        values = {
            name: getattr(obj, name)
            for name in (*self.owner_fields, *self.limit_fields)
            if getattr(obj, name) is not None
        }
        adopt(obj, self.create_service(actor=actor, address=address, **values))

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        self.delete_service(obj, actor=actor_of(request), address=client_address(request))

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        with transaction.atomic():
            for obj in queryset:
                self.delete_model(request, obj)


@admin.register(CapacityQuota)
class CapacityQuotaAdmin(LimitAdmin):
    list_display = ["__str__", "gpus", "cpu_cores", "memory_bytes", "replicas"]
    owner_fields = services.QUOTA_OWNER_FIELDS
    limit_fields = services.QUOTA_FIELDS
    create_service = staticmethod(services.create_capacity_quota)
    update_service = staticmethod(services.update_capacity_quota)
    delete_service = staticmethod(services.delete_capacity_quota)


@admin.register(RateLimit)
class RateLimitAdmin(LimitAdmin):
    list_display = ["__str__", "requests_per_minute", "tokens_per_minute", "tokens_per_day", "monthly_token_budget"]
    raw_id_fields = ["api_key"]
    readonly_fields = ["updated_at"]  # written by the service with each change
    owner_fields = services.OWNER_FIELDS
    limit_fields = LIMIT_FIELDS
    create_service = staticmethod(services.create_rate_limit)
    update_service = staticmethod(services.update_rate_limit)
    delete_service = staticmethod(services.delete_rate_limit)


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    # Usage is history, written by the gateway only: the admin reads it.
    list_display = [
        "request_id",
        "created_at",
        "user",
        "model",
        "endpoint",
        "status",
        "prompt_tokens",
        "completion_tokens",
        "first_token_ms",
        "total_ms",
        "hardware",
    ]
    list_filter = ["status", "endpoint", "model", "hardware"]
    search_fields = ["request_id", "model", "user__email"]
    date_hierarchy = "created_at"


@admin.register(UsageRollup)
class UsageRollupAdmin(ReadOnlyAdmin):
    # As usage records: summed by the gateway's usage writer only.
    list_display = [
        "period",
        "bucket_start",
        "model",
        "requests",
        "errors",
        "client_errors",
        "refusals",
        "prompt_tokens",
        "completion_tokens",
    ]
    list_filter = ["period", "model"]


@admin.register(HeldTime)
class HeldTimeAdmin(ReadOnlyAdmin):
    # Counted by apps.cluster.held only (every minute, and as a shard goes).
    list_display = ["bucket_start", "model", "gpu_class", "gpu_seconds", "core_seconds", "organization_id", "team_id"]
    list_filter = ["gpu_class"]
    search_fields = ["model"]
