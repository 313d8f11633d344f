from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FacilityConfig(AppConfig):
    name = "apps.facility"
    label = "facility"
    verbose_name = _("Facility")

    def ready(self) -> None:
        from apps.cluster.extensions import EXTENSIONS, Locations
        from apps.facility import locations, placement, services

        placement.register()
        EXTENSIONS.add_snapshot_part(services.contribute_snapshots)
        EXTENSIONS.locations = Locations(
            levels=locations.LEVELS, label_of=locations.label_of, of_node=services.node_location
        )
        EXTENSIONS.drain_holds = services.draining_nodes
