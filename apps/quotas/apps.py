from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class QuotasConfig(AppConfig):
    name = "apps.quotas"
    label = "quotas"
    verbose_name = _("Quotas and usage")
