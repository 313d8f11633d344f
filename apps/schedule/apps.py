from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ScheduleConfig(AppConfig):
    name = "apps.schedule"
    label = "schedule"
    verbose_name = _("Scheduler")
