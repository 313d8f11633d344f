"""ctl subcommands for the facility: labels that say where a node is, the domains, and holds."""

from __future__ import annotations

import argparse
import json
from typing import Any

from apps.facility.locations import LEVELS, parse_domain
from llmgw.cli.ctl import Client, format_table

__all__ = ["add_facility_commands", "location_text", "matches_domain"]


def location_text(node: dict[str, Any]) -> str | None:
    """site/room/row/rack as far as the node says them, then its PDU: "dc1/hall-a/r3/r12 pdu r12-a"."""
    place = node.get("location") or {}
    path = "/".join(str(place[level]) for level in LEVELS[:4] if place.get(level))
    pdu = f"pdu {place['pdu']}" if place.get("pdu") else ""
    return " ".join(part for part in (path, pdu) if part) or None


def matches_domain(node: dict[str, Any], domain: str) -> bool:
    level, _sep, name = domain.partition("=")
    return bool((node.get("location") or {}).get(level.strip().lower()) == name.strip())


def _domain(text: str) -> str:
    try:
        level, name = parse_domain(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return f"{level}={name}"


def cmd_facility(client: Client, args: argparse.Namespace) -> int:
    answer = client.get("facility")
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    rows = []
    for domain in answer["domains"]:
        hold = domain.get("hold")
        held = f"{'draining' if hold.get('drain') else 'held'}: {hold['reason'] or '-'}" if hold else "-"
        rows.append(
            [
                domain["domain"],
                len(domain["nodes"]),
                ",".join(domain["nodes"]),
                _draw(domain),
                _kw(domain.get("cap_watts")),
                held,
            ]
        )
    print(format_table(["DOMAIN", "NODES", "NAMES", "DRAW", "CAP", "HOLD"], rows))
    named = {d["domain"] for d in answer["domains"]}
    for hold in answer["holds"]:
        if hold["domain"] not in named:
            print(f"! {hold['domain']} is held but no node is in it")
    if answer["unplaced"]:
        print(f"no location: {', '.join(answer['unplaced'])}")
    return 0


def _kw(watts: float | None) -> str | None:
    return f"{watts / 1000:.1f} kW" if isinstance(watts, int | float) else None


def _draw(domain: dict[str, Any]) -> str | None:
    """What a capped domain draws: the known part, and how many nodes' draw is unknown."""
    if domain.get("cap_watts") is None:
        return None
    known = _kw(domain.get("drawn_watts")) or "-"
    unknown = domain.get("draw_unknown") or 0
    return f"{known} (+{unknown} unknown)" if unknown else known


def cmd_budget(client: Client, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"domain": args.domain, "redundant": args.redundant}
    if args.watts is not None:
        body["watts"] = args.watts
    if args.feed:
        feeds = []
        for item in args.feed:
            name, _sep, watts = item.partition("=")
            if not (watts.isascii() and watts.isdigit()):
                print(f"llmgw ctl: expected --feed NAME=WATTS, got {item!r}")
                return 2
            feeds.append({"name": name, "watts": int(watts)})
        body["feeds"] = feeds
    budget = client.post("facility/budgets", body)
    print(
        f"{budget['domain']}: cap {_kw(budget['cap_watts'])}"
        + (" (one feed of an A/B pair)" if budget["redundant"] else "")
    )
    return 0


def cmd_hold(client: Client, args: argparse.Namespace) -> int:
    hold = client.post("facility/holds", {"domain": args.domain, "reason": args.reason or "", "drain": args.drain})
    moving = "; its replicas are moved out, each replaced elsewhere first" if hold.get("drain") else ""
    print(
        f"{hold['domain']} held: nothing new is placed there until "
        f"`llmgw ctl facility release {hold['domain']}`{moving}"
    )
    return 0


def cmd_release(client: Client, args: argparse.Namespace) -> int:
    hold = client.post("facility/release", {"domain": args.domain})
    print(f"{hold['domain']} released")
    return 0


def cmd_label(client: Client, args: argparse.Namespace) -> int:
    """`ctl label NODE llmgw.io/rack=r12 llmgw.io/pdu-`: set a label, or drop a kept one (KEY-)."""
    set_labels: dict[str, str] = {}
    remove: list[str] = []
    for item in args.labels:
        if item.endswith("-") and "=" not in item:
            remove.append(item[:-1])
            continue
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            print(f"llmgw ctl: expected KEY=VALUE or KEY- (to drop it), got {item!r}")
            return 2
        set_labels[key] = value
    node = client.post(f"nodes/{args.name}/labels", {"set": set_labels, "remove": remove})
    print(f"{node['name']}: " + (" ".join(f"{k}={v}" for k, v in sorted(node["labels"].items())) or "no kept labels"))
    location = location_text(node)
    if location:
        print(f"location: {location}")
    return 0


def add_facility_commands(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("label", help="keep labels on a node over its agent's (KEY=VALUE), or drop one (KEY-)")
    p.add_argument("name")
    p.add_argument("labels", nargs="+", metavar="KEY=VALUE|KEY-")
    p.set_defaults(ctl_func=cmd_label)
    facility = ctl_sub.add_parser("facility", help="sites, rooms, rows, racks and PDUs with their nodes and holds")
    facility.set_defaults(ctl_func=cmd_facility)
    facility_sub = facility.add_subparsers(dest="facility_command", metavar="ACTION")
    p = facility_sub.add_parser("hold", help="place nothing new in a domain (rack=r12) until it is released")
    p.add_argument("domain", type=_domain, metavar="LEVEL=NAME")
    p.add_argument("--reason", help="why (shown in explain and to other operators)")
    p.add_argument("--drain", action="store_true", help="also move its replicas out, each replaced elsewhere first")
    p.set_defaults(ctl_func=cmd_hold)
    p = facility_sub.add_parser("budget", help="set a domain's power cap, in watts or by the feeds that carry it")
    p.add_argument("domain", type=_domain, metavar="LEVEL=NAME")
    p.add_argument("--watts", type=int, help="the cap in watts")
    p.add_argument("--feed", action="append", metavar="NAME=WATTS", help="a circuit feeding it (repeatable)")
    p.add_argument("--redundant", action="store_true", help="A/B fed: either feed must carry it alone")
    p.set_defaults(ctl_func=cmd_budget)
    p = facility_sub.add_parser("release", help="end the hold on a domain")
    p.add_argument("domain", type=_domain, metavar="LEVEL=NAME")
    p.set_defaults(ctl_func=cmd_release)
