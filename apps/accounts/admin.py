from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.core.exceptions import ValidationError
from django.http import HttpRequest
from django.utils.translation import gettext_lazy as _

from apps.accounts import services
from apps.accounts.models import ApiKey, AuditEvent, Membership, Organization, Project, Team, User


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "name", "staff_role", "is_active", "is_superuser", "date_joined", "last_login"]
    list_filter = ["staff_role", "is_active", "is_superuser"]
    search_fields = ["email", "name"]
    fieldsets = (
        (None, {"fields": ("email", "password")}),
        (_("Person"), {"fields": ("name",)}),
        (_("Access"), {"fields": ("staff_role", "is_active", "is_staff", "is_superuser", "groups")}),
        (_("Dates"), {"fields": ("last_login", "date_joined")}),
    )
    add_fieldsets = ((None, {"classes": ("wide",), "fields": ("email", "password1", "password2")}),)
    filter_horizontal = ["groups"]
    # Django admin access follows the staff role (accounts.services.set_staff_role).
    readonly_fields = ["is_staff", "is_superuser"]

    def save_model(self, request: HttpRequest, obj: User, form: Any, change: bool) -> None:
        role = obj.staff_role
        if change and "staff_role" in form.changed_data:
            obj.staff_role = form.initial.get("staff_role", "")
        super().save_model(request, obj, form, change)
        try:  # a no-op when the role and the flags already agree
            services.set_staff_role(obj, role, actor=request.user,  # type: ignore[arg-type]
                                    address=request.META.get("REMOTE_ADDR"))
        except ValidationError as exc:
            self.message_user(request, " ".join(exc.messages), level=messages.ERROR)


class TeamInline(admin.TabularInline):
    model = Team
    extra = 0
    fields = ["name", "slug"]


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["name", "slug", "created_at"]
    search_fields = ["name", "slug"]
    inlines = [TeamInline]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "organization", "slug", "created_at"]
    list_filter = ["organization"]
    search_fields = ["name", "slug"]


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "team", "slug", "created_at"]
    list_filter = ["team__organization"]
    search_fields = ["name", "slug"]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "organization", "team", "project", "role", "created_at"]
    list_filter = ["role", "organization"]
    search_fields = ["user__email"]
    raw_id_fields = ["user"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["name", "prefix", "user", "project", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["revoked_at", "is_session_key"]
    search_fields = ["name", "prefix", "user__email"]
    readonly_fields = ["prefix", "key_hash", "created_at", "last_used_at"]
    raw_id_fields = ["user"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Keys are made through the console or the API, which show the secret once.
        return False


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "actor_label", "action", "target_type", "target_label", "address"]
    list_filter = ["action", "target_type"]
    search_fields = ["actor_label", "action", "target_label"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
