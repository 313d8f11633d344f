from __future__ import annotations

from typing import Any

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ClusterConfig(AppConfig):
    name = "apps.cluster"
    label = "cluster"
    verbose_name = _("Cluster")

    def ready(self) -> None:
        from django.db.models.signals import pre_delete

        from apps.catalog.extensions import EXTENSIONS as CATALOG
        from apps.cluster import placement, reconciler
        from apps.cluster.metrics import NodeCollector
        from apps.cluster.models import Replica, Shard
        from llmgw.metrics import add_collector

        add_collector(NodeCollector)
        # What the catalogue asks of the cluster: a pass after a change, a deleted model's replicas
        # stopped, the profile fields placement's plugins declare, the rows that go with a model.
        CATALOG.reconcile = reconciler.request_reconcile
        CATALOG.stop_replicas = reconciler.stop_model_replicas
        CATALOG.plugin_fields = placement.REGISTRY.profile_fields
        CATALOG.add_owned(Replica)
        CATALOG.add_owned(Shard)
        # A shard's last stretch of held time is counted as it goes (its replica released, a
        # failed replica's claims given back, its model deleted): see apps.cluster.held.
        pre_delete.connect(_count_last_stretch, sender=Shard, dispatch_uid="quotas-held-time-shard-delete")


def _count_last_stretch(sender: Any, instance: Any, **kwargs: Any) -> None:
    from apps.cluster.held import accrue_shards

    accrue_shards([instance.pk])
