"""The Django admin for models and their profiles.

Changes go through apps.catalog.services, which audit them as the console, the API and
`llmgw ctl apply` do; what the control plane writes is read-only here.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db import transaction
from django.http import HttpRequest

from apps.accounts.admin import actor_of
from apps.catalog import profile_fields, services
from apps.catalog.extensions import EXTENSIONS
from apps.catalog.models import Model, Profile
from llmgw.http import client_address


def save_profile(request: HttpRequest, profile: Profile, changed: list[str]) -> None:
    """The fields a form changed, written by services.update_profile (one check, one event)."""
    changes = {name: getattr(profile, name) for name in changed if name in profile_fields.field_names()}
    if set(changed) - set(changes):  # a field nobody decided about: refuse rather than write it unaudited
        raise TypeError(f"profile fields without a service: {sorted(set(changed) - set(changes))}")
    if changes:
        services.update_profile(
            Profile.objects.select_related("model").get(pk=profile.pk),
            actor=actor_of(request),
            address=client_address(request),
            **changes,
        )


def declared_formfield(db_field: Any, formfield: Any) -> Any:
    """A profile column's form field as its declaration says: its help, and a list to pick from
    where it takes one of a few values (facility's levels)."""
    try:
        declared = profile_fields.declared(db_field.name)
    except KeyError:
        return formfield
    if declared.choices:
        choices = [("", "-"), *((choice, choice) for choice in declared.choices)]
        formfield = forms.TypedChoiceField(choices=choices, required=False, label=db_field.verbose_name)
    if formfield is not None and declared.help:
        formfield.help_text = profile_fields.help_text(declared)
    return formfield


class ProfileInline(admin.StackedInline):
    # A model's list of profiles is part of its declaration (services.apply_models checks, for
    # one, that a model on the cluster keeps one): profiles are neither added nor removed here.
    # A profile's fields change through services.update_profile; its name, which specs match
    # profiles by, is read-only.
    model = Profile
    extra = 0
    can_delete = False
    readonly_fields = ["name"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("name", *profile_fields.field_names())

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        return declared_formfield(db_field, super().formfield_for_dbfield(db_field, request, **kwargs))

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    # Models are declared through the console, the API or server.yaml (services.apply_models,
    # which checks the whole declaration): no adding here. The declared fields change through
    # services.update_model (model.update, as an apply). The API name is read-only (routes, specs
    # and usage name a model by it), and so is what the control plane writes: deleted_at, holds,
    # demand, load scaling, when it was made and updated. Deleting goes through
    # services.delete_model: the model stops being served at once, its replicas stop, and the
    # reconciler removes the row (with its profiles and replicas) once they have.
    list_display = [
        "name",
        "capacity_class",
        "min_replicas",
        "max_replicas",
        "external_url",
        "held_until",
        "deleted_at",
        "updated_at",
    ]
    list_filter = ["capacity_class"]
    search_fields = ["name", "source", "external_model"]
    readonly_fields = [
        "name",
        "deleted_at",
        "held_until",
        "held_for",
        "demand_until",
        "busy_at",
        "load_replicas",
        "scaled_at",
        "created_at",
        "updated_at",
    ]
    inlines = [ProfileInline]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Model, form: Any, change: bool) -> None:
        attnames = [getattr(Model._meta.get_field(name), "attname", name) for name in form.changed_data]
        changes = {attname: getattr(obj, attname) for attname in attnames}
        if changes:
            services.update_model(
                Model.objects.get(pk=obj.pk), actor=actor_of(request), address=client_address(request), **changes
            )

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        changed = []
        for row in formset.initial_forms:
            if row.has_changed():
                save_profile(request, row.instance, row.changed_data)
                changed.append((row.instance, row.changed_data))
        # What the admin's history message reads from a saved formset.
        formset.new_objects, formset.changed_objects, formset.deleted_objects = [], changed, []

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, Any, Any, Any]:
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        # Its profiles and replicas go with it, removed by the reconciler: never deleted on their own.
        rows: list[Any] = [Profile, *EXTENSIONS.owned]  # and the cluster app's replicas and shards
        owned = {str(m._meta.verbose_name) for m in rows}
        return deleted, counts, {name for name in perms_needed if str(name) not in owned}, protected

    def delete_model(self, request: HttpRequest, obj: Model) -> None:
        if obj.deleted_at is None:  # already being deleted otherwise
            services.delete_model(obj, actor=actor_of(request), address=client_address(request))

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        with transaction.atomic():
            for obj in queryset:
                self.delete_model(request, obj)


@admin.register(Profile)
class ProfileAdmin(admin.ModelAdmin):
    # As on the model's page: changed through services.update_profile; its model and name are
    # read-only, and profiles are added and removed with their model's declaration only.
    list_display = [
        "__str__",
        "priority",
        "engine",
        "accelerator",
        "gpus_per_shard",
        "nodes_per_replica",
        "memory_bytes",
        "cpu_cores",
    ]
    list_filter = ["engine", "accelerator"]
    search_fields = ["model__name", "name"]
    readonly_fields = ["model", "name"]

    def get_fields(self, request: HttpRequest, obj: Any = None) -> tuple[str, ...]:
        return ("model", "name", *profile_fields.field_names())

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        return declared_formfield(db_field, super().formfield_for_dbfield(db_field, request, **kwargs))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: Profile, form: Any, change: bool) -> None:
        save_profile(request, obj, form.changed_data)
