from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class QuotasConfig(AppConfig):
    name = "apps.quotas"
    label = "quotas"
    verbose_name = _("Quotas and usage")

    def ready(self) -> None:
        from apps.accounts.extensions import EXTENSIONS
        from apps.quotas import people, services

        # A removed branch's limits go with it; the People page's limits and usage tabs are ours.
        EXTENSIONS.add_branch_removal(services.remove_branch_limits)
        EXTENSIONS.add_branch_tab("limits", people.limits_tab)
        EXTENSIONS.add_branch_tab("usage", people.usage_tab)
