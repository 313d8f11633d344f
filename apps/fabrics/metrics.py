"""Prometheus figures for the InfiniBand and RoCE ports and the fabrics, read at scrape time.

A port the node's last sample (if fresh) does not list is absent; so is a figure it did not read.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from apps.cluster.metrics import FRESH

__all__ = ["FabricCollector"]

PORT = ["node", "device", "port"]


class FabricCollector(Collector):
    def collect(self) -> Iterable[Metric]:
        from apps.cluster.choices import NodeStatus
        from apps.cluster.models import Node
        from apps.fabrics.services import fabrics_overview

        now = timezone.now()
        active = GaugeMetricFamily(
            "llmgw_ib_port_active",
            "1 when the port is ACTIVE with its link up; state and phys_state tell an unplugged cable "
            "(Disabled/Polling) from a missing subnet manager (INIT with LinkUp)",
            labels=[*PORT, "link_layer", "state", "phys_state"],
        )
        rate = GaugeMetricFamily("llmgw_ib_port_rate_gbps", "The rate the port's link trained at", labels=PORT)
        counters = CounterMetricFamily(
            "llmgw_ib_port_counter", "The port's error and data counters (data in bytes)", labels=[*PORT, "counter"]
        )
        flaps = CounterMetricFamily(
            "llmgw_ib_port_flaps", "Times the port went down or up since its agent started", labels=PORT
        )
        joined = GaugeMetricFamily(
            "llmgw_gpu_nvlink_joined",
            "1 when the card is joined to its node's multi-node NVLink domain (fabric Completed/Success, "
            "healthy, that domain's ClusterUUID and CliqueId); absent on a node in no such domain",
            labels=["node", "gpu", "domain", "state"],
        )
        imex = GaugeMetricFamily(
            "llmgw_imex_up",
            "1 when the node's IMEX daemon is READY, its domain UP and a channel present; absent on a node "
            "that is in no NVLink domain",
            labels=["node", "state", "domain_state"],
        )
        from apps.fabrics import nvlink

        nodes = Node.objects.exclude(status=NodeStatus.REVOKED).only("name", "sample", "sampled_at", "hardware")
        for node in nodes:
            sample = node.fresh_sample(now, FRESH)
            if sample is None:
                continue
            state = nvlink.read_node(sample, node.hardware)
            if state is not None and state.domain is not None:
                for card in state.cards:
                    joined.add_metric(
                        [node.name, str(card.index), card.domain or state.domain or "-", card.state or "-"],
                        1.0 if card.joined else 0.0,
                    )
                up = state.imex_up
                if up is not None:
                    summary = nvlink.imex_summary(state.imex) or {}
                    imex.add_metric(
                        [node.name, str(summary.get("state") or "-"), str(summary.get("domain_state") or "-")],
                        1.0 if up else 0.0,
                    )
            for port in sample.get("ib_ports") or []:
                if not isinstance(port, dict):
                    continue
                labels = [node.name, str(port.get("device")), str(port.get("port"))]
                if isinstance(port.get("up"), bool):
                    active.add_metric(
                        [
                            *labels,
                            str(port.get("link_layer") or "-"),
                            str(port.get("state_name") or port.get("state") or "-"),
                            str(port.get("phys_state_name") or port.get("phys_state") or "-"),
                        ],
                        1.0 if port["up"] else 0.0,
                    )
                if isinstance(port.get("rate_gbps"), int | float):
                    rate.add_metric(labels, float(port["rate_gbps"]))
                for name in ("xmit_bytes", "rcv_bytes"):
                    if isinstance(port.get(name), int):
                        counters.add_metric([*labels, name], float(port[name]))
                for name, value in (port.get("errors") or {}).items():
                    if isinstance(value, int):
                        counters.add_metric([*labels, str(name)], float(value))
                if isinstance(port.get("flaps"), int):
                    flaps.add_metric(labels, float(port["flaps"]))
        yield from (active, rate, counters, flaps, joined, imex)

        overview = fabrics_overview()
        master = GaugeMetricFamily(
            "llmgw_fabric_master_sm",
            "1 for each master subnet manager a fabric's ports report",
            labels=["fabric", "guid"],
        )
        managers = GaugeMetricFamily(
            "llmgw_fabric_subnet_managers",
            "Subnet managers listed on the fabric (master and standbys)",
            labels=["fabric"],
        )
        for fabric in overview["fabrics"]:
            if fabric["kind"] != "ib":
                continue
            managers.add_metric([fabric["id"]], float(len(fabric["subnet_managers"])))
            for sm in fabric["subnet_managers"]:
                if sm.get("master"):
                    master.add_metric([fabric["id"], sm["guid"]], 1.0)
        problems = GaugeMetricFamily("llmgw_fabric_problems", "Fabric problems found, by kind", labels=["code"])
        for code, count in sorted(Counter(p["code"] for p in overview["problems"]).items()):
            problems.add_metric([code], float(count))
        yield from (master, managers, problems)
