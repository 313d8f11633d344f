from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FacilityConfig(AppConfig):
    name = "apps.facility"
    label = "facility"
    verbose_name = _("Facility")

    def ready(self) -> None:
        from apps.cluster import inventory
        from apps.facility import placement, services

        placement.register()
        if services.contribute_snapshots not in inventory.SNAPSHOT_HOOKS:
            inventory.SNAPSHOT_HOOKS.append(services.contribute_snapshots)
