from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class GuardrailsConfig(AppConfig):
    name = "apps.guardrails"
    label = "guardrails"
    verbose_name = _("Guardrails")

    def ready(self) -> None:
        from apps.accounts.extensions import EXTENSIONS
        from apps.guardrails.selectors import policies_for

        # A person's account page lists the policies their requests meet. (The gateway reloads its
        # tables when a policy or rule changes: apps.gateway.signals listens for that itself.)
        EXTENSIONS.add_account_panel("policies", policies_for)
