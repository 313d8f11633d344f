from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class SimConfig(AppConfig):
    name = "apps.sim"
    label = "sim"
    verbose_name = _("Fleet simulator")
