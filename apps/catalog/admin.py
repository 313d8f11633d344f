from __future__ import annotations

from django.contrib import admin

from apps.catalog.models import Model, Profile


class ProfileInline(admin.StackedInline):
    model = Profile
    extra = 0


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ["name", "capacity_class", "min_replicas", "max_replicas", "external_url", "held_until",
                    "updated_at"]
    list_filter = ["capacity_class"]
    search_fields = ["name", "source", "external_model"]
    inlines = [ProfileInline]


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    list_display = ["__str__", "priority", "engine", "accelerator", "gpus_per_shard", "nodes_per_replica",
                    "memory_bytes", "cpu_cores"]
    list_filter = ["engine", "accelerator"]
    search_fields = ["model__name", "name"]
