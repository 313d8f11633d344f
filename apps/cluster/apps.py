from __future__ import annotations

from django.apps import AppConfig


class ClusterConfig(AppConfig):
    name = "apps.cluster"
    label = "cluster"

    def ready(self) -> None:
        from apps.cluster.metrics import NodeCollector
        from llmgw.metrics import add_collector

        add_collector(NodeCollector)
