"""Prometheus figures read from the database at scrape time.

Apps add collectors with `add_collector()` from their AppConfig.ready(); each is asked on
every scrape, so the answer is the same whichever web process serves /metrics. A collector
with a `text()` method writes its part of the page itself, through `Exposition`: one
f-string per series instead of prometheus_client's formatting, for the parts that grow with
the fleet (the nodes' and GPUs' series: 2,000 nodes of 8 cards are some 300,000 lines).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily
from prometheus_client.registry import Collector

import llmgw

__all__ = [
    "Exposition",
    "add_collector",
    "database_metrics",
    "escape_label",
    "label_text",
    "number_text",
    "per_scrape",
    "register_collectors",
]

_factories: list[Callable[[], Any]] = []
_scrape: ContextVar[dict[str, Any] | None] = ContextVar("llmgw_metrics_scrape", default=None)


def per_scrape[T](key: str, build: Callable[[], T]) -> T:
    """What `build()` returns, built once for all the collectors of one scrape (the fleet's nodes
    and their samples, read once instead of once per collector); outside a scrape, built each call."""
    memo = _scrape.get()
    if memo is None:
        return build()
    if key not in memo:
        memo[key] = build()
    return memo[key]  # type: ignore[no-any-return]


def add_collector(factory: Callable[[], Any]) -> None:
    if factory not in _factories:
        _factories.append(factory)


def escape_label(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def number_text(value: float) -> str:
    """A sample's value as the text format writes it (1.0, 12.5, +Inf, NaN)."""
    value = float(value)
    if value != value:
        return "NaN"
    if value in (math.inf, -math.inf):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


def label_text(labels: dict[str, str]) -> str:
    """Labels as the text format writes them inside the braces, by name as prometheus_client
    orders them: `gpu="0",node="a"`."""
    return ",".join(f'{key}="{escape_label(str(labels[key]))}"' for key in sorted(labels))


class Exposition:
    """Families of series in Prometheus's text format, written as they are added and kept together
    by family (the format wants each family's series in one block under its HELP and TYPE)."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[str, str, list[str]]] = {}

    def family(self, name: str, doc: str, kind: str = "gauge") -> list[str]:
        """The list a family's lines go in, for a caller that writes many of them itself:
        `f"{name}{{{labels}}} {number_text(value)}\\n"` (a family left empty is not written)."""
        return self._lines(name, kind, doc)

    def _lines(self, name: str, kind: str, doc: str) -> list[str]:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = (kind, doc, [])
        return family[2]

    def add(self, name: str, doc: str, labels: str, value: float, kind: str = "gauge") -> None:
        """One series: `labels` as label_text() writes them. A counter's series is `name_total`."""
        sample = f"{name}_total" if kind == "counter" else name
        braces = f"{{{labels}}}" if labels else ""
        self._lines(name, kind, doc).append(f"{sample}{braces} {number_text(value)}\n")

    def add_summary(self, name: str, doc: str, labels: str, count: float, total: float) -> None:
        lines = self._lines(name, "summary", doc)
        lines.append(f"{name}_count{{{labels}}} {number_text(count)}\n")
        lines.append(f"{name}_sum{{{labels}}} {number_text(total)}\n")

    def text(self) -> str:
        out = []
        for name, (kind, doc, lines) in self._families.items():
            if not lines:
                continue
            shown = f"{name}_total" if kind == "counter" else name
            help_text = doc.replace("\\", r"\\").replace("\n", r"\n")
            out.append(f"# HELP {shown} {help_text}\n# TYPE {shown} {kind}\n")
            out.extend(lines)
        return "".join(out)


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
    """The collectors prometheus_client formats (those without a `text()` of their own)."""
    registry.register(BuildInfo())
    for factory in _factories:
        collector = factory()
        if not hasattr(collector, "text"):
            registry.register(collector)
    return registry


def database_metrics() -> bytes:
    """Every figure read from the database, as /metrics serves it."""
    token = _scrape.set({})
    # The scrape makes some hundred thousand objects (the samples' decoded documents) that live
    # until it ends: the cyclic collector, run over them again and again as they pile up, would
    # make its cost grow faster than the fleet. It is held off until the scrape is done (freeing
    # by reference counts goes on; a scrape takes well under a second).
    collecting = gc.isenabled()
    gc.disable()
    try:
        body = generate_latest(register_collectors(CollectorRegistry()))
        collectors = (factory() for factory in _factories)
        texts = [collector.text() for collector in collectors if hasattr(collector, "text")]
    finally:
        _scrape.reset(token)
        if collecting:
            gc.enable()
    return body + "".join(texts).encode()
