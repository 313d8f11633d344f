"""ctl subcommands for fabrics: the physical fabrics and their problems, a map, and fabric-test."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from llmgw.cli.ctl import ApiError, Client, format_table

__all__ = ["add_fabric_commands"]


def cmd_fabrics(client: Client, args: argparse.Namespace) -> int:
    answer = client.get("fabrics")
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    rows = []
    for fabric in answer["fabrics"]:
        masters = [s["guid"] for s in fabric["subnet_managers"] if s.get("master")]
        standbys = [s["guid"] for s in fabric["subnet_managers"] if not s.get("master")]
        rows.append(
            [
                fabric["id"],
                ",".join(fabric["names"]) or "-",
                len(fabric["nodes"]),
                fabric["ports"],
                fabric["expected_gbps"],
                ",".join(masters) or "-",
                len(standbys) if fabric["kind"] == "ib" else "-",
            ]
        )
    print(format_table(["FABRIC", "NAMES", "NODES", "PORTS", "GBPS", "MASTER", "STANDBYS"], rows))
    for problem in answer["problems"]:
        print(f"! {problem['message']}")
    return 0


def _rail_rows(test: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for rail in test["rails"]:
        share = rail.get("share")
        rows.append(
            [
                rail.get("rail") if rail.get("rail") is not None else "-",
                f"{test['client']}:{rail.get('client') or '-'}",
                f"{test['server']}:{rail.get('server') or '-'}",
                rail.get("link_gbps"),
                rail.get("measured_gbps"),
                f"{share * 100:.0f}%" if isinstance(share, int | float) else "-",
                rail.get("grade") or rail.get("state"),
            ]
        )
    return rows


def cmd_fabric_test(client: Client, args: argparse.Namespace) -> int:
    try:
        test = client.post("fabric-tests", {"a": args.a, "b": args.b, "duration": args.duration})
    except ApiError as exc:
        print(f"llmgw ctl: fabric-test refused: {exc.detail}", file=sys.stderr)
        return 1
    print(f"fabric test {test['id']}: {test['client']} -> {test['server']} on {test['fabric']}, one rail at a time")
    deadline = time.monotonic() + args.timeout
    while test["state"] == "running" and time.monotonic() < deadline:
        time.sleep(1.0)
        test = client.get(f"fabric-tests/{test['id']}")
    if args.json:
        print(json.dumps(test, indent=2))
    else:
        print(
            format_table(["RAIL", "CLIENT", "SERVER", "LINK GBPS", "MEASURED GBPS", "SHARE", "GRADE"], _rail_rows(test))
        )
        for rail in test["rails"]:
            if rail.get("error"):
                print(f"! rail {rail.get('rail')}: {rail['error']}")
        if test.get("error"):
            print(f"! {test['error']}")
    if test["state"] == "running":
        print(f"llmgw ctl: still running after {args.timeout:.0f} s; see fabric-tests/{test['id']}", file=sys.stderr)
        return 1
    bad = test["state"] != "done" or any(r.get("grade") not in ("good", "unpaired") for r in test["rails"])
    return 1 if bad else 0


def add_fabric_commands(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("fabrics", help="the physical fabrics: names, nodes, subnet managers, problems")
    p.set_defaults(ctl_func=cmd_fabrics)
    p = ctl_sub.add_parser(
        "fabric-test", help="measure two nodes' shared fabric with ib_write_bw, rail by rail (A client, B server)"
    )
    p.add_argument("a", help="the node that runs the client")
    p.add_argument("b", help="the node that runs the server")
    p.add_argument("--duration", type=int, default=5, help="seconds per rail (default 5)")
    p.add_argument("--timeout", type=float, default=600, help="how long to wait for every rail (default 600 s)")
    p.set_defaults(ctl_func=cmd_fabric_test)
