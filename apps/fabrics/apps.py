from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class FabricsConfig(AppConfig):
    name = "apps.fabrics"
    label = "fabrics"
    verbose_name = _("Fabrics")

    def ready(self) -> None:
        from apps.cluster.extensions import EXTENSIONS
        from apps.fabrics import nvlink, placement, services
        from apps.fabrics.maps import record_map
        from apps.fabrics.metrics import FabricCollector
        from llmgw.metrics import add_collector

        placement.register()
        add_collector(FabricCollector)
        EXTENSIONS.add_request_handler("ibnetdiscover", record_map)
        EXTENSIONS.add_snapshot_part(services.contribute_snapshots)
        EXTENSIONS.add_snapshot_part(nvlink.contribute_snapshots)
        EXTENSIONS.add_shard_env(services.shard_env)
        EXTENSIONS.add_node_report("fabrics", services.record_fabrics)
        EXTENSIONS.add_node_panel("ports", services.node_ports)
        EXTENSIONS.add_node_panel("nvlink", nvlink.node_view)
        EXTENSIONS.add_cluster_panel("fabrics", services.fabrics_overview)
        EXTENSIONS.nvlink_domain = nvlink.registered_domain
