"""Write deploy/grafana/*.json, the Grafana dashboards for llmgw, from the panels listed here.

    .venv/bin/python scripts/grafana_dashboards.py          # write them
    .venv/bin/python scripts/grafana_dashboards.py --check  # exit 1 when a file differs

Each dashboard takes a Prometheus data source (the `datasource` variable, asked on import) and,
where it helps, filters by node or model. Every panel's query is run against a real Prometheus
scraping llmgw in the test suite (tests/deploy/test_prometheus.py), so a metric renamed in the
code breaks the build, not the dashboard.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy" / "grafana"

# The port counters that count errors (agent/probes/infiniband.py reads them from sysfs).
IB_ERRORS = (
    "symbol_error|link_error_recovery|link_downed|port_rcv_errors|port_rcv_remote_physical_errors"
    "|port_xmit_discards|local_link_integrity_errors|excessive_buffer_overrun_errors"
)


def _quantile(q: float, histogram: str, by: str = "le") -> str:
    return f'histogram_quantile({q}, sum by ({by}) (rate({histogram}_bucket{{model=~"$model"}}[5m])))'


# (title, unit, queries as (expr, legend)), one panel each; a title starting with "#" is a stat.
Panel = tuple[str, str, list[tuple[str, str]]]

DASHBOARDS: dict[str, tuple[str, list[str], list[Panel]]] = {
    "llmgw-fleet": (
        "llmgw / Fleet",
        ["node"],
        [
            ("#Nodes up", "none", [("sum(llmgw_node_up)", "up")]),
            ("#Nodes unreachable", "none", [("count(llmgw_node_up == 0) or vector(0)", "unreachable")]),
            ("#Nodes cordoned", "none", [("sum(llmgw_node_cordoned)", "cordoned")]),
            ("#Replicas ready", "none", [('sum(llmgw_replicas{state="ready"})', "ready")]),
            ("Replicas by state", "none", [("sum by (state) (llmgw_replicas)", "{{state}}")]),
            ("CPU busy", "percent", [('llmgw_node_cpu_utilization_percent{node=~"$node"}', "{{node}}")]),
            (
                "Memory in use",
                "percentunit",
                [('llmgw_node_memory_used_bytes{node=~"$node"} / llmgw_node_memory_bytes', "{{node}}")],
            ),
            ("Load (1 minute)", "none", [('llmgw_node_load{period="1m",node=~"$node"}', "{{node}}")]),
            ("Inlet temperature", "celsius", [('llmgw_node_inlet_temperature_celsius{node=~"$node"}', "{{node}}")]),
            ("CPU package power (RAPL)", "watt", [('llmgw_node_cpu_package_power_watts{node=~"$node"}', "{{node}}")]),
            (
                "Model storage free",
                "bytes",
                [('llmgw_node_storage_free_bytes{node=~"$node"}', "{{node}} {{mountpoint}}")],
            ),
        ],
    ),
    "llmgw-gpus": (
        "llmgw / GPUs",
        ["node"],
        [
            ("#GPUs held", "none", [("sum(llmgw_gpu_assigned)", "held")]),
            ("#GPUs seen", "none", [("count(llmgw_gpu_memory_total_bytes)", "seen")]),
            (
                "Utilisation",
                "percent",
                [('llmgw_gpu_utilization_percent{node=~"$node"}', "{{node}} gpu{{gpu}}")],
            ),
            (
                "Memory in use",
                "percentunit",
                [
                    (
                        'llmgw_gpu_memory_used_bytes{node=~"$node"} / llmgw_gpu_memory_total_bytes',
                        "{{node}} gpu{{gpu}}",
                    )
                ],
            ),
            (
                "Temperature",
                "celsius",
                [
                    ('llmgw_gpu_temperature_celsius{node=~"$node"}', "{{node}} gpu{{gpu}}"),
                    ('llmgw_gpu_memory_temperature_celsius{node=~"$node"}', "{{node}} gpu{{gpu}} HBM"),
                ],
            ),
            (
                "Power draw of the limit",
                "percentunit",
                [('llmgw_gpu_power_draw_watts{node=~"$node"} / llmgw_gpu_power_limit_watts', "{{node}} gpu{{gpu}}")],
            ),
            ("SM clock", "hertz", [('llmgw_gpu_sm_clock_mhz{node=~"$node"} * 1e6', "{{node}} gpu{{gpu}}")]),
            (
                "Clocks held down, by reason",
                "none",
                [('sum by (reason) (llmgw_gpu_clock_event{node=~"$node"})', "{{reason}}")],
            ),
            (
                "XIDs in the last hour",
                "none",
                [
                    (
                        'sum by (node, gpu, xid) (increase(llmgw_gpu_xid_errors{node=~"$node"}[1h]))',
                        "{{node}} gpu{{gpu}} xid {{xid}}",
                    )
                ],
            ),
            (
                "Uncorrected ECC errors",
                "none",
                [('llmgw_gpu_ecc_uncorrected_errors{node=~"$node"}', "{{node}} gpu{{gpu}}")],
            ),
            (
                "Rows remapped (uncorrectable)",
                "none",
                [('llmgw_gpu_remapped_rows_uncorrectable{node=~"$node"}', "{{node}} gpu{{gpu}}")],
            ),
            (
                "PCIe replays in the last hour",
                "none",
                [('increase(llmgw_gpu_pcie_replays{node=~"$node"}[1h])', "{{node}} gpu{{gpu}}")],
            ),
        ],
    ),
    "llmgw-fabrics": (
        "llmgw / Fabrics",
        ["node"],
        [
            ("#Ports down", "none", [("count(llmgw_ib_port_active == 0) or vector(0)", "down")]),
            ("Subnet managers per fabric", "none", [("llmgw_fabric_subnet_managers", "{{fabric}}")]),
            ("Fabric problems, by kind", "none", [("llmgw_fabric_problems", "{{code}}")]),
            (
                "Port rate",
                "none",
                [('llmgw_ib_port_rate_gbps{node=~"$node"}', "{{node}} {{device}}/{{port}}")],
            ),
            (
                "Port errors (5 minutes)",
                "none",
                [
                    (
                        "sum by (node, device, port) (increase(llmgw_ib_port_counter"
                        '{node=~"$node",counter=~"' + IB_ERRORS + '"}[5m]))',
                        "{{node}} {{device}}/{{port}}",
                    )
                ],
            ),
            (
                "Port flaps in the last hour",
                "none",
                [('increase(llmgw_ib_port_flaps{node=~"$node"}[1h])', "{{node}} {{device}}/{{port}}")],
            ),
            ("NVLink domain members, by state", "none", [("count by (state) (llmgw_gpu_nvlink_joined)", "{{state}}")]),
            ("IMEX daemons up", "none", [("sum(llmgw_imex_up)", "up")]),
        ],
    ),
    "llmgw-gateway": (
        "llmgw / Gateway",
        ["model"],
        [
            (
                "Requests per second, by status",
                "reqps",
                [('sum by (status) (rate(llmgw_gateway_requests_total{model=~"$model"}[5m]))', "{{status}}")],
            ),
            (
                "Error ratio (5xx)",
                "percentunit",
                [
                    (
                        'sum(rate(llmgw_gateway_requests_total{model=~"$model",status=~"5.."}[5m]))'
                        ' / sum(rate(llmgw_gateway_requests_total{model=~"$model"}[5m]))',
                        "5xx",
                    )
                ],
            ),
            (
                "Time to first token",
                "s",
                [(_quantile(q, "llmgw_gateway_first_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.95, 0.99)],
            ),
            (
                "Request duration",
                "s",
                [
                    (_quantile(q, "llmgw_gateway_request_duration_seconds"), f"p{int(q * 100)}")
                    for q in (0.5, 0.95, 0.99)
                ],
            ),
            ("In flight", "none", [("sum(llmgw_gateway_in_flight)", "holding a slot")]),
            (
                "Waiting for a replica",
                "none",
                [
                    ('llmgw_gateway_queue_depth{model=~"$model"}', "{{model}}"),
                    ("max(llmgw_gateway_queue_limit)", "limit"),
                ],
            ),
            (
                "Tokens per second",
                "none",
                [('sum by (kind) (rate(llmgw_gateway_tokens_total{model=~"$model"}[5m]))', "{{kind}}")],
            ),
            (
                "Guardrail actions per minute",
                "none",
                [("sum by (policy, action) (rate(llmgw_guardrail_actions_total[5m])) * 60", "{{policy}} {{action}}")],
            ),
        ],
    ),
    "llmgw-models": (
        "llmgw / Models",
        ["model"],
        [
            (
                "Replicas by state",
                "none",
                [('sum by (model, state) (llmgw_replicas{model=~"$model"})', "{{model}} {{state}}")],
            ),
            ("GPUs held", "none", [('sum by (model) (llmgw_gpu_assigned{model=~"$model"})', "{{model}}")]),
            (
                "CPU cores claimed and used",
                "none",
                [
                    ('sum by (model) (llmgw_shard_cpu_cores{model=~"$model"})', "{{model}} claimed"),
                    ('sum by (model) (llmgw_shard_cpu_cores_used{model=~"$model"})', "{{model}} used"),
                ],
            ),
            (
                "Requests per second",
                "reqps",
                [('sum by (model) (rate(llmgw_gateway_requests_total{model=~"$model"}[5m]))', "{{model}}")],
            ),
            (
                "Time to first token (p95)",
                "s",
                [(_quantile(0.95, "llmgw_gateway_first_token_seconds", "le, model"), "{{model}}")],
            ),
            ("Waiting for a replica", "none", [('llmgw_gateway_queue_depth{model=~"$model"}', "{{model}}")]),
            (
                "Replica failures in a row",
                "none",
                [('max by (model) (llmgw_replica_failures{model=~"$model"})', "{{model}}")],
            ),
            (
                "Inside the engines: requests running and waiting",
                "none",
                [
                    ('sum by (model) (llmgw_engine_requests_running{model=~"$model"})', "{{model}} running"),
                    ('sum by (model) (llmgw_engine_requests_waiting{model=~"$model"})', "{{model}} waiting"),
                ],
            ),
            (
                "Inside the engines: KV cache in use",
                "percentunit",
                [('avg by (model) (llmgw_engine_kv_cache_usage_ratio{model=~"$model"})', "{{model}}")],
            ),
            (
                "Inside the engines: time to first token and per output token (mean)",
                "s",
                [
                    (
                        'sum by (model) (rate(llmgw_engine_time_to_first_token_seconds_sum{model=~"$model"}[5m]))'
                        ' / sum by (model) (rate(llmgw_engine_time_to_first_token_seconds_count{model=~"$model"}[5m]))',
                        "{{model}} first token",
                    ),
                    (
                        'sum by (model) (rate(llmgw_engine_time_per_output_token_seconds_sum{model=~"$model"}[5m]))'
                        " / sum by (model) "
                        '(rate(llmgw_engine_time_per_output_token_seconds_count{model=~"$model"}[5m]))',
                        "{{model}} per output token",
                    ),
                ],
            ),
            (
                "Inside the engines: tokens per second and prefix-cache hits",
                "none",
                [
                    (
                        'sum by (model) (rate(llmgw_engine_generation_tokens_total{model=~"$model"}[5m]))',
                        "{{model}} generated",
                    ),
                    (
                        'sum by (model) (rate(llmgw_engine_prefix_cache_hits_total{model=~"$model"}[5m]))'
                        ' / sum by (model) (rate(llmgw_engine_prefix_cache_queries_total{model=~"$model"}[5m]))',
                        "{{model}} share of prompt tokens cached",
                    ),
                ],
            ),
        ],
    ),
    "llmgw-owners": (
        "llmgw / GPU time per owner",
        [],
        [
            ("GPUs held now, by owner", "none", [("sum by (owner) (llmgw_gpu_assigned)", "{{owner}}")]),
            (
                "GPU-hours held in the last 24 hours, by owner",
                "none",
                [("sum by (owner) (sum_over_time(llmgw_gpu_assigned[24h:1m])) / 60", "{{owner}}")],
            ),
            (
                "GPU-hours held in the last 24 hours, by owner and model",
                "none",
                [("sum by (owner, model) (sum_over_time(llmgw_gpu_assigned[24h:1m])) / 60", "{{owner}} {{model}}")],
            ),
            (
                "Capacity quotas: held of the limit",
                "percentunit",
                [("llmgw_capacity_quota_used / llmgw_capacity_quota_limit", "{{owner}} {{resource}}")],
            ),
        ],
    ),
}

LABEL_OF = {"node": ("llmgw_node_up", "Node"), "model": ("llmgw_replicas", "Model")}


def _target(expr: str, legend: str, ref: int) -> dict[str, Any]:
    return {
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "expr": expr,
        "legendFormat": legend,
        "refId": chr(ord("A") + ref),
    }


def _panel(index: int, panel: Panel, x: int, y: int) -> dict[str, Any]:
    title, unit, queries = panel
    stat = title.startswith("#")
    return {
        "id": index + 1,
        "type": "stat" if stat else "timeseries",
        "title": title.lstrip("#"),
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": 6 if stat else 12, "h": 4 if stat else 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {} if stat else {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [_target(expr, legend, i) for i, (expr, legend) in enumerate(queries)],
    }


def dashboard(uid: str) -> dict[str, Any]:
    title, variables, panels = DASHBOARDS[uid]
    laid: list[dict[str, Any]] = []
    x = y = 0
    row_height = 0
    for index, panel in enumerate(panels):
        width = 6 if panel[0].startswith("#") else 12
        if x + width > 24:
            x, y = 0, y + row_height
            row_height = 0
        laid.append(_panel(index, panel, x, y))
        row_height = max(row_height, laid[-1]["gridPos"]["h"])
        x += width
    templating = [
        {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus", "current": {}}
    ]
    for name in variables:
        metric, label = LABEL_OF[name]
        templating.append(
            {
                "name": name,
                "label": label,
                "type": "query",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": f"label_values({metric}, {name})", "refId": "variable"},
                "includeAll": True,
                "allValue": ".*",
                "multi": True,
                "refresh": 2,
                "current": {"text": "All", "value": "$__all"},
            }
        )
    return {
        "uid": uid,
        "title": title,
        "tags": ["llmgw"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": templating},
        "panels": laid,
    }


def rendered() -> dict[Path, str]:
    return {OUT / f"{uid}.json": json.dumps(dashboard(uid), indent=2) + "\n" for uid in DASHBOARDS}


def main(argv: list[str]) -> int:
    files = rendered()
    if "--check" in argv:
        stale = [str(path) for path, text in files.items() if not path.exists() or path.read_text() != text]
        if stale:
            print("out of date (run scripts/grafana_dashboards.py): " + ", ".join(stale))
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
