from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class MirrorConfig(AppConfig):
    name = "apps.mirror"
    label = "mirror"
    verbose_name = _("Model mirror")
