from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from apps.cluster.models import ControlLock, EnrollmentToken, Gpu, Node, Replica, Shard


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    fields = ["index", "gpu_class", "name", "memory_total_mib", "ecc_fault", "foreign_processes"]
    readonly_fields = fields


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["name", "status", "cordoned", "agent_version", "address", "last_seen_at", "registered_at"]
    list_filter = ["status", "cordoned"]
    search_fields = ["name", "address"]
    readonly_fields = ["credential_hash", "hardware", "sample", "sampled_at", "registered_at", "last_seen_at",
                       "desired_version"]
    inlines = [GpuInline]


@admin.register(Gpu)
class GpuAdmin(admin.ModelAdmin):
    list_display = ["node", "index", "gpu_class", "memory_total_mib", "ecc_fault", "foreign_processes"]
    list_filter = ["gpu_class", "ecc_fault"]
    search_fields = ["node__name", "uuid"]


@admin.register(EnrollmentToken)
class EnrollmentTokenAdmin(admin.ModelAdmin):
    list_display = ["node_name", "created_by", "created_at", "expires_at", "used_at"]
    search_fields = ["node_name"]
    readonly_fields = ["token_hash"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # made by `ctl node add` or the console, which show the token once


class ShardInline(admin.TabularInline):
    model = Shard
    extra = 0
    fields = ["rank", "node", "gpu_indices", "memory_bytes", "cpu_cores", "port", "state", "pid", "exit_code"]
    readonly_fields = fields


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ["__str__", "model", "profile", "state", "failures", "created_at", "ready_at"]
    list_filter = ["state", "model"]
    inlines = [ShardInline]


@admin.register(Shard)
class ShardAdmin(admin.ModelAdmin):
    list_display = ["__str__", "node", "port", "state", "pid", "exit_code", "reported_at"]
    list_filter = ["state", "node"]
    exclude = ["secret"]


@admin.register(ControlLock)
class ControlLockAdmin(admin.ModelAdmin):
    list_display = ["name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
