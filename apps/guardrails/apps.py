from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class GuardrailsConfig(AppConfig):
    name = "apps.guardrails"
    label = "guardrails"
    verbose_name = _("Guardrails")

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from apps.accounts.extensions import EXTENSIONS
        from apps.gateway.signals import _changed
        from apps.guardrails.models import Policy, Rule
        from apps.guardrails.selectors import policies_for

        # A person's account page lists the policies their requests meet.
        EXTENSIONS.add_account_panel("policies", policies_for)

        # A policy or rule changed: the gateway's tables (which carry the compiled rules) reload.
        for sender in (Policy, Rule):
            post_save.connect(_changed, sender=sender, dispatch_uid=f"gateway-{sender.__name__}-save")
            post_delete.connect(_changed, sender=sender, dispatch_uid=f"gateway-{sender.__name__}-delete")
