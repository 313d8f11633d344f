"""The Django admin for people, the organisation tree, API keys and the audit log.

Every change made here is audited like the same change made in the console, the API or
`llmgw ctl`: a change that has a service goes through it (people_services, services), and a
change that has none is audited by AuditedAdmin with the action names the services use
("<kind>.create", "<kind>.update" with [before, after] of each field, "<kind>.delete").
What a service or the control plane owns is read-only here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth.admin import GroupAdmin as BaseGroupAdmin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.contrib.auth.models import Group
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.core.serializers.json import DjangoJSONEncoder
from django.db import models, transaction
from django.http import HttpRequest, HttpResponse
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from apps.accounts import audit, people_services, services
from apps.accounts.models import ApiKey, AuditEvent, Membership, Organization, Project, Team, User
from llmgw.http import client_address

__all__ = ["AuditedAdmin", "ReadOnlyAdmin", "ReadOnlyInline", "actor_of", "adopt"]

# Never written to the audit log, not even as [before, after]: only that they changed.
SECRET_FIELDS = frozenset({"password", "key_hash", "credential_hash", "token_hash", "secret"})


def actor_of(request: HttpRequest) -> User | None:
    """Who makes a change in the admin: always a signed-in administrator."""
    return request.user if isinstance(request.user, User) else None


def adopt(obj: models.Model, made: models.Model) -> None:
    """Let the admin carry on with the row a service created in place of the one its form built."""
    for field in obj._meta.concrete_fields:
        setattr(obj, field.attname, getattr(made, field.attname))
    obj._state.adding, obj._state.db = False, made._state.db


def _fields(obj: models.Model, names: Any) -> list[Any]:
    """The model fields among a form's field names (not a form's own fields such as password2)."""
    found = []
    for name in names:
        try:
            field = obj._meta.get_field(name)
        except FieldDoesNotExist:
            continue
        if name not in SECRET_FIELDS and (field.many_to_many or (field.concrete and not field.primary_key)):
            found.append(field)
    return found


def _snapshot(obj: models.Model, fields: list[Any]) -> dict[str, Any]:
    """The fields' values as the audit log keeps them: related rows by name, the rest as JSON."""
    values: dict[str, Any] = {}
    for field in fields:
        if field.many_to_many:
            values[field.name] = sorted(str(item) for item in getattr(obj, field.name).all()) if obj.pk else []
            continue
        value = getattr(obj, field.name)
        values[field.name] = (
            str(value) if isinstance(value, models.Model) else json.loads(json.dumps(value, cls=DjangoJSONEncoder))
        )
    return values


class AuditedAdmin(admin.ModelAdmin):
    """An admin whose saves and deletes are audited as the services audit theirs.

    A save writes "<prefix>.create", or "<prefix>.update" with [before, after] of each field that
    changed (a save that changed nothing writes nothing); a delete writes "<prefix>.delete" just
    before the row goes. A change writes only the fields its form changed. `audit_exclude` names
    the fields a subclass hands to a service in its own save_model (the service audits them);
    a subclass that makes the whole save through a service does not call this save_model.
    """

    audit_prefix = ""  # "api_key" for ApiKey when empty
    audit_exclude: tuple[str, ...] = ()

    def audit_action(self, verb: str) -> str:
        prefix = self.audit_prefix or re.sub(r"(?<!^)(?=[A-Z])", "_", self.model.__name__).lower()
        return f"{prefix}.{verb}"

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        names = form.changed_data if change else list(form.fields)
        fields = [field for field in _fields(obj, names) if field.name not in self.audit_exclude]
        before: dict[str, Any] = {}
        if change:
            before = _snapshot(type(obj)._default_manager.get(pk=obj.pk), fields)
            columns = [field.name for field in fields if not field.many_to_many]
            if columns:
                obj.save(update_fields=columns)
        else:
            obj.save()
        form.audit_pending = (fields, before)

    def save_related(self, request: HttpRequest, form: Any, formsets: Any, change: bool) -> None:
        super().save_related(request, form, formsets, change)  # many-to-many fields and inlines
        pending = getattr(form, "audit_pending", None)
        if pending is None:  # saved through a service, which audited it
            return
        fields, before = pending
        changes = audit.diff(before, _snapshot(form.instance, fields))
        if change and not changes:
            return
        audit.record(
            actor_of(request),
            self.audit_action("update" if change else "create"),
            form.instance,
            changes=changes,
            address=client_address(request),
        )

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        """Inline rows are audited one by one, under their own model's name."""
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", formset.model.__name__).lower()
        actor, address = actor_of(request), client_address(request)
        deleted = {id(row) for row in formset.deleted_forms}
        edits = [row for row in formset.initial_forms if id(row) not in deleted and row.has_changed()]
        old = formset.model._default_manager.in_bulk([row.instance.pk for row in edits])
        pending = []
        for row in edits:
            fields = _fields(row.instance, row.changed_data)
            pending.append((row.instance, fields, _snapshot(old[row.instance.pk], fields)))
        for row in formset.deleted_forms:
            if row.instance.pk is not None:
                audit.record(actor, f"{prefix}.delete", row.instance, address=address)
        super().save_formset(request, form, formset, change)
        for obj, fields, before in pending:
            changes = audit.diff(before, _snapshot(obj, fields))
            if changes:
                audit.record(actor, f"{prefix}.update", obj, changes=changes, address=address)
        for obj in formset.new_objects:
            changes = audit.diff({}, _snapshot(obj, _fields(obj, formset.form.base_fields)))
            audit.record(actor, f"{prefix}.create", obj, changes=changes, address=address)

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        with transaction.atomic():
            audit.record(actor_of(request), self.audit_action("delete"), obj, address=client_address(request))
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        # One at a time, so each row is audited (or refused) as a delete from its own page is.
        with transaction.atomic():
            for obj in queryset:
                self.delete_model(request, obj)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Shown here, never changed here: another part of llmgw writes these rows."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ReadOnlyInline(admin.TabularInline):
    """Rows shown on their parent's page for orientation; changed on their own page, or not at all."""

    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


# People -------------------------------------------------------------------------------------


@admin.register(User)
class UserAdmin(AuditedAdmin, BaseUserAdmin):
    # The staff role goes through services.set_staff_role, which also sets Django admin access
    # (is_staff, is_superuser: read-only). Suspension (is_active) goes through
    # people_services.suspend_user and reactivate_user. Both keep the last administrator.
    # Sign-in writes last_login and date_joined is history: read-only. Email, name and groups
    # are audited here (user.update), a new password as user.password (never its hash), a
    # person added here as user.create and a deletion as user.delete.
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
    readonly_fields = ["is_staff", "is_superuser", "last_login", "date_joined"]
    audit_exclude = ("staff_role", "is_active")

    def save_model(self, request: HttpRequest, obj: User, form: Any, change: bool) -> None:
        role, active = obj.staff_role, obj.is_active
        if change:  # the services below change these and audit them
            obj.staff_role = form.initial.get("staff_role", "")
            obj.is_active = form.initial.get("is_active", True)
        super().save_model(request, obj, form, change)
        actor, address = actor_of(request), client_address(request)
        try:
            if active and not obj.is_active:
                people_services.reactivate_user(obj, actor=actor, address=address)
            elif obj.is_active and not active:
                people_services.suspend_user(obj, actor=actor, address=address)
        except ValidationError as exc:
            self.message_user(request, " ".join(exc.messages), level=messages.ERROR)
        try:  # a no-op when the role and the flags already agree
            services.set_staff_role(obj, role, actor=actor, address=address)
        except ValidationError as exc:
            self.message_user(request, " ".join(exc.messages), level=messages.ERROR)

    def user_change_password(self, request: HttpRequest, id: str, form_url: str = "") -> HttpResponse:
        with transaction.atomic():
            response = super().user_change_password(request, id, form_url)
            if request.method == "POST" and response.status_code == 302:  # the form saved the password
                user = User.objects.get(pk=id)
                audit.record(actor_of(request), "user.password", user, address=client_address(request))
        return response


# Django's groups grant Django permissions, which llmgw's own access never reads (staff roles
# decide): kept for completeness and audited here (group.create, group.update, group.delete).
admin.site.unregister(Group)


@admin.register(Group)
class GroupAdmin(AuditedAdmin, BaseGroupAdmin):
    pass


# The organisation tree ----------------------------------------------------------------------


class BranchForm(forms.ModelForm):
    """A branch's name is checked by the rules the console and the API apply (services.check_branch_name)."""

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        parent_field = {Team: "organization", Project: "team"}.get(type(self.instance), "")
        if "name" in data:
            parent = data.get(parent_field) if parent_field else None
            if self.instance.pk is not None and parent_field:  # read-only then
                parent = getattr(self.instance, parent_field)
            try:
                data["name"] = services.check_branch_name(
                    type(self.instance),
                    data["name"],
                    parent=parent,
                    exclude=self.instance if self.instance.pk else None,
                )
            except ValidationError as exc:
                self.add_error(None, exc)
        return data


class BranchAdmin(admin.ModelAdmin):
    """An organisation, team or project, made, renamed and removed through accounts.services.

    Its name (services.rename_*) and its share, a weight and a project's band (set_share, which
    checks and audits them), change on a branch that exists; its slug (which specs and single
    sign-on's mapping name) and its parent (which its memberships name) are read-only, as is
    when it was made. Removal is refused while anything depends on it (services.remove_*),
    with the reason on the confirmation page; its own limits go with it, each audited.
    """

    form = BranchForm
    parent_field = ""
    readonly_fields = ["created_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = list(super().get_readonly_fields(request, obj))
        if obj is not None:
            fields += ["slug", *([self.parent_field] if self.parent_field else [])]
        return fields

    def save_model(self, request: HttpRequest, obj: Any, form: Any, change: bool) -> None:
        actor, address = actor_of(request), client_address(request)
        # Its share (weight, and a project's band) is set as the console and the API set it.
        share = {name: getattr(obj, name) for name in ("weight", "band") if name in form.changed_data}
        if change:
            if "name" in form.changed_data:
                current = type(obj)._default_manager.get(pk=obj.pk)
                adopt(obj, people_services.rename_branch(current, name=obj.name, actor=actor, address=address))
            if share:
                current = type(obj)._default_manager.get(pk=obj.pk)
                adopt(obj, people_services.set_share(current, **share, actor=actor, address=address))
            return
        if isinstance(obj, Organization):
            made: Any = services.create_organization(name=obj.name, slug=obj.slug, actor=actor, address=address)
        elif isinstance(obj, Team):
            made = services.create_team(obj.organization, name=obj.name, slug=obj.slug, actor=actor, address=address)
        else:
            made = services.create_project(obj.team, name=obj.name, slug=obj.slug, actor=actor, address=address)
        if share:
            made = people_services.set_share(made, **share, actor=actor, address=address)
        adopt(obj, made)

    def get_deleted_objects(self, objs: Any, request: HttpRequest) -> tuple[Any, Any, Any, Any]:
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        refusals = [services.removal_refusal(branch) for branch in objs]
        return deleted, counts, perms_needed, [*protected, *filter(None, refusals)]

    def delete_model(self, request: HttpRequest, obj: Any) -> None:
        people_services.remove_branch(obj, actor=actor_of(request), address=client_address(request))

    def delete_queryset(self, request: HttpRequest, queryset: Any) -> None:
        with transaction.atomic():
            for obj in queryset:
                self.delete_model(request, obj)


class TeamInline(ReadOnlyInline):
    model = Team
    fields = readonly_fields = ("name", "slug")


@admin.register(Organization)
class OrganizationAdmin(BranchAdmin):
    list_display = ["name", "slug", "created_at"]
    search_fields = ["name", "slug"]
    inlines = [TeamInline]


@admin.register(Team)
class TeamAdmin(BranchAdmin):
    list_display = ["name", "organization", "slug", "created_at"]
    list_filter = ["organization"]
    search_fields = ["name", "slug"]
    parent_field = "organization"


@admin.register(Project)
class ProjectAdmin(BranchAdmin):
    list_display = ["name", "team", "slug", "created_at"]
    list_filter = ["team__organization"]
    search_fields = ["name", "slug"]
    parent_field = "team"


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    # Adding and removing go through people_services.add_member and remove_member, as on the
    # People page. A membership's person and branch are what it is (to move someone, remove them
    # and add them elsewhere): read-only once it exists. Its role is audited here
    # (membership.update). Single sign-on owns from_sso; when it was made is history.
    list_display = ["user", "organization", "team", "project", "role", "created_at"]
    list_filter = ["role", "organization"]
    search_fields = ["user__email"]
    raw_id_fields = ["user"]
    readonly_fields = ["from_sso", "created_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> list[str]:
        fields = list(super().get_readonly_fields(request, obj))
        return [*fields, "user", "organization", "team", "project"] if obj is not None else fields

    def save_model(self, request: HttpRequest, obj: Membership, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        branch = obj.project or obj.team or obj.organization
        adopt(
            obj,
            people_services.add_member(
                branch, obj.user, obj.role, actor=actor_of(request), address=client_address(request)
            ),
        )

    def delete_model(self, request: HttpRequest, obj: Membership) -> None:
        people_services.remove_member(obj, actor=actor_of(request), address=client_address(request))


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin):
    # Keys are made through the console or the API, which show the secret once: no adding here.
    # Revocation goes through services.revoke_api_key (the action below), so revoked_at is
    # read-only; a revoked key stays revoked. The owner, the project its usage is charged to and
    # whether the console made it are fixed when it is made; prefix, hash and last use are the
    # key's own. Its name, expiry and allowed models are audited here (api_key.update), and a
    # deletion as api_key.delete.
    list_display = ["name", "prefix", "user", "project", "created_at", "expires_at", "revoked_at", "last_used_at"]
    list_filter = ["revoked_at", "is_session_key"]
    search_fields = ["name", "prefix", "user__email"]
    readonly_fields = [
        "prefix",
        "key_hash",
        "user",
        "project",
        "is_session_key",
        "created_at",
        "revoked_at",
        "last_used_at",
    ]
    actions = ["revoke_keys"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    @admin.action(description=_("Revoke the selected API keys"), permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: Any) -> None:
        keys = [key for key in queryset.select_related("user") if key.revoked_at is None]
        for key in keys:
            services.revoke_api_key(key, actor=actor_of(request), address=client_address(request))
        self.message_user(
            request,
            ngettext("%(count)d API key revoked.", "%(count)d API keys revoked.", len(keys)) % {"count": len(keys)},
            level=messages.SUCCESS,
        )


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "actor_label", "action", "target_type", "target_label", "address"]
    list_filter = ["action", "target_type"]
    search_fields = ["actor_label", "action", "target_label"]
    date_hierarchy = "created_at"
