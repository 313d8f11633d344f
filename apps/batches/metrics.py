"""The batches' Prometheus figures.

- llmgw_batch_lines_total{status}: how lines' tries ended, in every process that runs them:
  succeeded, failed (a final answer that is not 2xx), retried (to be tried again), yielded (cut off
  for an interactive request, and retried), and the lines answered without being run (expired,
  cancelled). Tallied in the database in the transaction that writes each line (LineTally) and read
  at scrape time, so a web process's /metrics shows the lines the workers ran; a status no try has
  ended with is absent, not 0;
- llmgw_batch_lines_in_flight{model}: lines being run now (summed over web processes);
- llmgw_batches{status}: batches by status, read from the database at scrape time (a status no
  batch has is absent, not 0);
- llmgw_batch_lines_held{model}: lines some process holds a live lease on now, read from the database
  at scrape time, so it is right whichever processes run lines (the worker's, whose own counters
  above a web process's /metrics does not see, or the web's). A model with none is absent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["BatchCollector", "in_flight"]

IN_FLIGHT = Gauge(
    "llmgw_batch_lines_in_flight", "Batch lines being run now, by model", ["model"], multiprocess_mode="livesum"
)


def in_flight(model: str, delta: int) -> None:
    IN_FLIGHT.labels(model).inc(delta)


class BatchCollector:
    """llmgw_batch_lines_total{status}, llmgw_batches{status} and llmgw_batch_lines_held{model}, from
    the database."""

    def collect(self) -> Iterable[Any]:
        from django.db.models import Count
        from django.utils import timezone

        from apps.batches.choices import LineState
        from apps.batches.models import Batch, BatchLine, LineTally

        tries = CounterMetricFamily("llmgw_batch_lines", "Batch lines' tries, by how they ended", labels=["status"])
        for status, count in LineTally.objects.order_by("status").values_list("status", "count"):
            tries.add_metric([status], count)
        yield tries
        family = GaugeMetricFamily("llmgw_batches", "Batches, by status", labels=["status"])
        for row in Batch.objects.values("status").annotate(n=Count("pk")).order_by("status"):
            family.add_metric([row["status"]], row["n"])
        yield family
        held = GaugeMetricFamily(
            "llmgw_batch_lines_held", "Batch lines a process holds a live lease on, by model", labels=["model"]
        )
        live = BatchLine.objects.filter(state=LineState.RUNNING, lease_until__gt=timezone.now())
        for model, count in live.values_list("model").annotate(n=Count("pk")).order_by("model"):
            held.add_metric([model], count)
        yield held
