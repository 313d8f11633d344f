"""Prometheus figures for nodes, read from their latest samples at scrape time.

No scrape target on the nodes: the control plane exports what agents send. A sample
older than a minute is left out rather than repeated, and a figure the agent did not
measure is absent, never 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from django.utils import timezone
from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["MESSAGE_SECONDS", "NodeCollector", "PROTOCOL_ERRORS", "PROTOCOL_MESSAGES"]

PROTOCOL_MESSAGES = Counter("llmgw_agent_messages", "Agent messages handled, by type", ["type"])
MESSAGE_SECONDS = Histogram(
    "llmgw_agent_message_seconds", "Time the control plane took to handle one agent message, by type", ["type"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
PROTOCOL_ERRORS = Counter("llmgw_agent_protocol_errors", "Agent messages refused or failed, by reason", ["code"])

FRESH = timedelta(minutes=1)


class NodeCollector(Collector):
    def collect(self) -> Iterable[GaugeMetricFamily]:
        from apps.cluster.choices import NodeStatus
        from apps.cluster.models import Node

        now = timezone.now()
        g: dict[str, GaugeMetricFamily] = {}

        def family(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            if name not in g:
                g[name] = GaugeMetricFamily(name, doc, labels=labels)
            return g[name]

        def put(name: str, doc: str, labels: dict[str, str], value: float | int | None) -> None:
            if value is None or isinstance(value, bool):
                return
            family(name, doc, list(labels)).add_metric(list(labels.values()), float(value))

        nodes = Node.objects.exclude(status=NodeStatus.REVOKED).only(
            "name", "status", "cordoned", "sample", "sampled_at", "hardware", "last_seen_at"
        )
        for node in nodes:
            n = {"node": node.name}
            put("llmgw_node_up", "1 when the node's agent is connected and heartbeating", n,
                1 if node.live_status == NodeStatus.READY else 0)
            put("llmgw_node_cordoned", "1 when an operator cordoned the node", n, 1 if node.cordoned else 0)
            sample = node.fresh_sample(now, FRESH)
            if sample is None:
                continue
            put("llmgw_node_cpus", "Logical CPUs", n, sample.get("cpus"))
            put("llmgw_node_cpu_utilization_percent", "CPU busy across all cores", n, sample.get("cpu_utilization_pct"))
            load = sample.get("load") or []
            for period, value in zip(("1m", "5m", "15m"), load, strict=False):
                put("llmgw_node_load", "Load average", {**n, "period": period}, value)
            put("llmgw_node_memory_bytes", "Memory installed", n, sample.get("memory_total_bytes"))
            put("llmgw_node_memory_used_bytes", "Memory in use", n, sample.get("memory_used_bytes"))
            put("llmgw_node_memory_available_bytes", "Memory available to new work", n,
                sample.get("memory_available_bytes"))
            put("llmgw_node_cpu_package_temperature_celsius", "Hottest CPU package", n,
                sample.get("cpu_package_temp_c"))
            put("llmgw_node_inlet_temperature_celsius", "Board inlet temperature", n, sample.get("inlet_temp_c"))
            put("llmgw_node_cpu_package_power_watts", "CPU package power from RAPL", n,
                sample.get("cpu_package_power_w"))
            for pool in sample.get("storage") or []:
                s = {**n, "mountpoint": pool.get("mount_point", ""), "fstype": pool.get("fstype") or "",
                     "kind": "shared" if pool.get("shared") else "local"}
                put("llmgw_node_storage_free_bytes", "Free space on a filesystem holding model directories", s,
                    pool.get("free_bytes"))
                put("llmgw_node_storage_total_bytes", "Size of a filesystem holding model directories", s,
                    pool.get("total_bytes"))
            for gpu in sample.get("gpus") or []:
                labels = {**n, "gpu": str(gpu.get("index")), "uuid": gpu.get("uuid") or "",
                          "class": gpu.get("gpu_class") or ""}
                put("llmgw_gpu_utilization_percent", "GPU busy", labels, gpu.get("utilization_gpu_pct"))
                put("llmgw_gpu_memory_bandwidth_percent", "GPU memory controller busy", labels,
                    gpu.get("utilization_memory_pct"))
                mib = 1024 * 1024
                used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
                put("llmgw_gpu_memory_used_bytes", "GPU memory in use", labels,
                    used * mib if used is not None else None)
                put("llmgw_gpu_memory_total_bytes", "GPU memory", labels, total * mib if total is not None else None)
                put("llmgw_gpu_temperature_celsius", "GPU temperature", labels, gpu.get("temperature_gpu_c"))
                put("llmgw_gpu_memory_temperature_celsius", "HBM temperature", labels, gpu.get("temperature_memory_c"))
                put("llmgw_gpu_power_draw_watts", "GPU power draw", labels, gpu.get("power_draw_w"))
                put("llmgw_gpu_power_limit_watts", "Enforced GPU power limit", labels, gpu.get("power_limit_w"))
                put("llmgw_gpu_sm_clock_mhz", "SM clock", labels, gpu.get("sm_clock_mhz"))
                put("llmgw_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors since the driver loaded", labels,
                    gpu.get("ecc_uncorrected_volatile"))
                put("llmgw_gpu_remapped_rows_uncorrectable", "Rows remapped for uncorrectable errors", labels,
                    gpu.get("remapped_rows_uncorrectable"))
                put("llmgw_gpu_pcie_replays", "PCIe replay counter", labels, gpu.get("pcie_replay_count"))
                for code, count in (gpu.get("xids") or {}).items():
                    put("llmgw_gpu_xid_errors", "Kernel XID events seen, by code", {**labels, "xid": str(code)}, count)
                for counter, count in (gpu.get("nvlink_errors") or {}).items():
                    put("llmgw_gpu_nvlink_errors", "NVLink error counters summed over links",
                        {**labels, "counter": str(counter)}, count)
        yield from g.values()
