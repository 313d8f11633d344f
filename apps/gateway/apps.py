from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class GatewayConfig(AppConfig):
    name = "apps.gateway"
    label = "gateway"
    verbose_name = _("Gateway")

    def ready(self) -> None:
        from apps.gateway import services, signals

        signals.connect()
        services.connect()
