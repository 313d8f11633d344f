from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class GatewayConfig(AppConfig):
    name = "apps.gateway"
    label = "gateway"
    verbose_name = _("Gateway")

    def ready(self) -> None:
        from apps.catalog import cards
        from apps.cluster.extensions import EXTENSIONS
        from apps.gateway import contention, depths, services, signals

        signals.connect()
        services.connect()
        cards.register(contention.card_part)  # who holds and waits for a model's slots, on its card
        EXTENSIONS.queue_depths = depths.queue_depths  # for the nodes' history points
