from __future__ import annotations

from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "apps.gateway"
    label = "gateway"

    def ready(self) -> None:
        from apps.gateway import services, signals

        signals.connect()
        services.connect()
