from __future__ import annotations

from django.contrib import admin

from apps.accounts.admin import AuditedAdmin
from apps.guardrails.models import Policy, Rule


class RuleInline(admin.TabularInline):
    model = Rule
    extra = 0
    fields = [
        "order",
        "name",
        "kind",
        "action",
        "applies_to",
        "terms",
        "pattern",
        "detector",
        "limit",
        "model_names",
        "enabled",
    ]


@admin.register(Policy)
class PolicyAdmin(AuditedAdmin):
    # Saved rules are checked (Rule.clean: an expression RE2 cannot run is refused, saying why),
    # audited as policy.* and rule.*, and the gateway reloads them.
    list_display = ["name", "enabled", "organization", "team", "project", "model", "updated_at"]
    list_filter = ["enabled"]
    search_fields = ["name", "description"]
    inlines = [RuleInline]


@admin.register(Rule)
class RuleAdmin(AuditedAdmin):
    list_display = ["policy", "order", "name", "kind", "action", "applies_to", "enabled"]
    list_filter = ["kind", "action", "enabled"]
    search_fields = ["name", "policy__name"]
