"""ctl subcommands for nodes (and, later, models)."""

from __future__ import annotations

import argparse
import json
import re
from datetime import UTC, datetime
from typing import Any

from llmgw.cli.ctl import Client, format_table

__all__ = ["add_all", "human_age", "human_bytes"]

GIB = 1024**3


def human_bytes(value: int | float | None) -> str | None:
    if value is None:
        return None
    for unit, size in (("T", 1024**4), ("G", GIB), ("M", 1024**2)):
        if value >= size:
            amount = value / size
            return f"{amount:.0f}{unit}" if amount >= 10 else f"{amount:.1f}{unit}"
    return f"{int(value)}B"


def human_age(iso: str | None, now: datetime | None = None) -> str | None:
    if not iso:
        return None
    then = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    seconds = max(0, int(((now or datetime.now(UTC)) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _status(node: dict[str, Any]) -> str:
    return node["status"] + (",cordoned" if node.get("cordoned") else "")


def _cpu(summary: dict[str, Any]) -> str | None:
    cpus, util = summary.get("cpus"), summary.get("cpu_utilization_pct")
    if cpus is None:
        return None
    return f"{util:.0f}% of {cpus}" if util is not None else str(cpus)


def _pair(used: int | None, total: int | None) -> str | None:
    if total is None:
        return None
    return f"{human_bytes(used) if used is not None else '-'}/{human_bytes(total)}"


def _gpus(node: dict[str, Any]) -> str | None:
    summary = node["summary"]
    if node.get("registered_at") is None:
        return None  # never heard from: unknown, not zero
    count = summary.get("gpu_count") or 0
    classes = summary.get("gpu_classes") or []
    if not count:
        return "0"
    return f"{count}×{'/'.join(classes)}" if classes else str(count)


def node_row(node: dict[str, Any]) -> list[Any]:
    s = node["summary"]
    return [node["name"], _status(node), _cpu(s), _pair(s.get("memory_used_bytes"), s.get("memory_total_bytes")),
            _gpus(node), _pair(s.get("disk_free_bytes"), s.get("disk_total_bytes")), human_age(node.get("created_at"))]


def cmd_nodes(client: Client, args: argparse.Namespace) -> int:
    nodes = client.get("nodes")["results"]
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    print(format_table(["NAME", "STATUS", "CPU", "MEM", "GPU", "DISK", "AGE"], [node_row(n) for n in nodes]))
    return 0


def cmd_node_show(client: Client, args: argparse.Namespace) -> int:
    node = client.get(f"nodes/{args.name}")
    if args.json:
        print(json.dumps(node, indent=2))
        return 0
    hw, s = node.get("hardware") or {}, node["summary"]
    sample = node.get("sample") or {}
    rows = [
        ("name", node["name"]), ("status", _status(node)), ("cordon reason", node.get("cordon_reason")),
        ("labels", [f"{k}={v}" for k, v in sorted((node.get("labels") or {}).items())]),
        ("agent", node.get("agent_version")), ("cpu", hw.get("cpu_model")), ("cpus", s.get("cpus")),
        ("cpu busy", f"{s['cpu_utilization_pct']:.0f}%" if s.get("cpu_utilization_pct") is not None else None),
        ("load", sample.get("load")),
        ("memory", _pair(s.get("memory_used_bytes"), s.get("memory_total_bytes"))),
        ("disk (local)", _pair(s.get("disk_free_bytes"), s.get("disk_total_bytes"))),
        ("os", hw.get("os")), ("kernel", hw.get("kernel")), ("arch", hw.get("arch")),
        ("driver", hw.get("driver_version")), ("cuda", hw.get("cuda_version")),
        ("last seen", human_age(node.get("last_seen_at"))), ("warnings", node.get("warnings")),
    ]
    print(format_table(["FIELD", "VALUE"], rows))
    gpus = {g["index"]: g for g in sample.get("gpus") or []}
    if node.get("gpus"):
        print()
        table = []
        for gpu in node["gpus"]:
            live = gpus.get(gpu["index"], {})
            mem = None
            if gpu.get("memory_total_mib") is not None:
                used = live.get("memory_used_mib")
                mem = f"{used if used is not None else '-'}/{gpu['memory_total_mib']}MiB"
            power = live.get("power_draw_w")
            limit = live.get("power_limit_w")
            table.append([
                gpu["index"], gpu.get("gpu_class") or gpu.get("name"),
                f"{live['utilization_gpu_pct']:.0f}%" if live.get("utilization_gpu_pct") is not None else None,
                mem, live.get("temperature_gpu_c"), live.get("temperature_memory_c"),
                f"{power if power is not None else '-'}/{limit if limit is not None else '-'}W"
                if power is not None or limit is not None else None,
                live.get("ecc_uncorrected_volatile"), "no" if gpu["ecc_fault"] or gpu["foreign_processes"] else "yes",
            ])
        print(format_table(["GPU", "CLASS", "UTIL", "MEMORY", "TEMP", "HBM", "POWER", "ECC", "HEALTHY"], table))
    return 0


LABEL = re.compile(r"^([A-Za-z0-9._/-]+)=(.*)$")


def _labels(values: list[str] | None) -> dict[str, str]:
    labels = {}
    for value in values or []:
        match = LABEL.match(value)
        if not match:
            raise SystemExit(f"llmgw ctl: --label {value!r}: expected key=value")
        labels[match.group(1)] = match.group(2)
    return labels


def _duration(text: str) -> int:
    match = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if not match:
        raise SystemExit(f"llmgw ctl: --expires {text!r}: expected a duration such as 30m, 1h or 2d")
    return int(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def cmd_node_add(client: Client, args: argparse.Namespace) -> int:
    answer = client.post("nodes/enrollments", {"name": args.name, "labels": _labels(args.label),
                                                "expires_in_seconds": _duration(args.expires)})
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print(f"Enrollment token for node {answer['node']} (one use, expires {answer['expires_at']}).")
    print("On the node, write this to /etc/llmgw/agent.yaml:\n")
    print(answer["agent_yaml"])
    print(f"then start the agent:\n\n  {answer['command']}\n")
    return 0


def _action(verb: str) -> Any:
    def run(client: Client, args: argparse.Namespace) -> int:
        body = {"reason": args.reason} if verb == "cordon" else None
        node = client.post(f"nodes/{args.name}/{verb}", body)
        print(f"node {node['name']}: {_status(node)}")
        return 0

    return run


def add_all(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("nodes", help="list nodes: NAME STATUS CPU MEM GPU DISK AGE")
    p.set_defaults(ctl_func=cmd_nodes)
    node = ctl_sub.add_parser("node", help="one node: show, add, cordon, uncordon, revoke")
    node_sub = node.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    p = node_sub.add_parser("show", help="a node's hardware, figures and GPUs")
    p.add_argument("name")
    p.set_defaults(ctl_func=cmd_node_show)
    p = node_sub.add_parser("add", help="make a one-time enrollment token and print the agent's set-up")
    p.add_argument("name")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="a label for the node (repeatable)")
    p.add_argument("--expires", default="1h", help="how long the token is good for (default 1h)")
    p.set_defaults(ctl_func=cmd_node_add)
    p = node_sub.add_parser("cordon", help="keep new replicas off a node")
    p.add_argument("name")
    p.add_argument("--reason", required=True, help="why (shown to other operators)")
    p.set_defaults(ctl_func=_action("cordon"))
    p = node_sub.add_parser("uncordon", help="let replicas be placed on a node again")
    p.add_argument("name")
    p.set_defaults(ctl_func=_action("uncordon"))
    p = node_sub.add_parser("revoke", help="cut a node off: its credential stops working at once")
    p.add_argument("name")
    p.set_defaults(ctl_func=_action("revoke"))
