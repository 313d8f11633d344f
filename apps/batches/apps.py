from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class BatchesConfig(AppConfig):
    name = "apps.batches"
    label = "batches"
    verbose_name = _("Batches")

    def ready(self) -> None:
        from apps.batches.host import connect_worker_signals
        from apps.batches.metrics import BatchCollector
        from llmgw.metrics import add_collector

        add_collector(BatchCollector)
        connect_worker_signals()
