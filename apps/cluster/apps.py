from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ClusterConfig(AppConfig):
    name = "apps.cluster"
    label = "cluster"
    verbose_name = _("Cluster")

    def ready(self) -> None:
        from apps.cluster.metrics import NodeCollector
        from llmgw.metrics import add_collector

        add_collector(NodeCollector)
