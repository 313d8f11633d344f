"""Prometheus figures read from the database at scrape time.

Apps add collectors with `add_collector()` from their AppConfig.ready(); each is asked on
every scrape, so the answer is the same whichever web process serves /metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.registry import Collector

import llmgw

__all__ = ["add_collector", "register_collectors"]

_factories: list[Callable[[], Collector]] = []


def add_collector(factory: Callable[[], Collector]) -> None:
    if factory not in _factories:
        _factories.append(factory)


class BuildInfo(Collector):
    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily("llmgw_build_info", "llmgw version", labels=["version"])
        family.add_metric([llmgw.__version__], 1)
        yield family
        from django.conf import settings

        limit = GaugeMetricFamily(
            "llmgw_gateway_queue_limit",
            "The most requests that wait for a model's replicas at once (LLMGW_GATEWAY_QUEUE_MAX)",
        )
        limit.add_metric([], settings.GATEWAY_QUEUE_MAX)
        yield limit


def register_collectors(registry: CollectorRegistry) -> CollectorRegistry:
    registry.register(BuildInfo())
    for factory in _factories:
        registry.register(factory())
    return registry
