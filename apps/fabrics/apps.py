from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FabricsConfig(AppConfig):
    name = "apps.fabrics"
    label = "fabrics"
    verbose_name = _("Fabrics")

    def ready(self) -> None:
        from apps.cluster import agent_requests, inventory
        from apps.fabrics import nvlink, placement, services
        from apps.fabrics.maps import record_map
        from apps.fabrics.metrics import FabricCollector
        from llmgw.metrics import add_collector

        agent_requests.register_handler("ibnetdiscover", record_map)
        placement.register()
        add_collector(FabricCollector)
        if services.contribute_snapshots not in inventory.SNAPSHOT_HOOKS:
            inventory.SNAPSHOT_HOOKS.append(services.contribute_snapshots)
        if nvlink.contribute_snapshots not in inventory.SNAPSHOT_HOOKS:
            inventory.SNAPSHOT_HOOKS.append(nvlink.contribute_snapshots)
        if services.shard_env not in inventory.SHARD_ENV_HOOKS:
            inventory.SHARD_ENV_HOOKS.append(services.shard_env)
