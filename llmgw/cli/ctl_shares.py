"""ctl subcommands for the shares of a busy model: the weights of organisations, teams, projects and
API keys, and the highest band of projects and keys.

    llmgw ctl share list                                  # every branch's weight and band (staff)
    llmgw ctl share team 3 --weight 4                     # administrators, the organisation's managers
    llmgw ctl share project 7 --weight 2 --band batch     # ... and the team's managers
    llmgw ctl share key 12 --band batch                   # a key's owner may lower its band

The values go to the server as given, so that what it refuses (a weight of 0 or 1001, a band that
does not exist) is refused in its words, naming the field and the range.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from llmgw.cli.ctl import Client, format_table

__all__ = ["add_share_commands"]

# The collection of each kind of thing that has a share, in the API.
COLLECTIONS = {"org": "organizations", "team": "teams", "project": "projects", "key": "keys"}
KIND_WORDS = {"org": "organisation", "team": "team", "project": "project", "key": "key"}


def _value(text: str) -> Any:
    """A whole number as a number, anything else as the text (for the server to refuse by name)."""
    return int(text) if re.fullmatch(r"[+-]?\d{1,12}", text.strip()) else text


def _all(client: Client, collection: str) -> list[dict[str, Any]]:
    """Every row of a collection, page after page."""
    rows: list[dict[str, Any]] = []
    while True:
        page = client.get(f"{collection}?limit=1000&offset={len(rows)}")
        rows += page["results"]
        if not page.get("next") or not page["results"]:
            return rows


def cmd_share_list(client: Client, args: argparse.Namespace) -> int:
    orgs = _all(client, "organizations")
    teams = _all(client, "teams")
    projects = _all(client, "projects")
    if args.json:
        print(json.dumps({"organizations": orgs, "teams": teams, "projects": projects}, indent=2))
        return 0
    org_names = {org["id"]: org["name"] for org in orgs}
    team_names = {team["id"]: f"{org_names.get(team['organization'], '?')} / {team['name']}" for team in teams}
    rows: list[list[Any]] = [["org", org["id"], org["name"], org.get("weight"), None] for org in orgs]
    rows += [["team", team["id"], team_names[team["id"]], team.get("weight"), None] for team in teams]
    rows += [
        ["project", p["id"], f"{team_names.get(p['team'], '?')} / {p['name']}", p.get("weight"), p.get("band")]
        for p in projects
    ]
    print(format_table(["KIND", "ID", "NAME", "WEIGHT", "BAND"], rows))
    return 0


def cmd_share_set(client: Client, args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.weight is not None:
        body["weight"] = _value(args.weight)
    if getattr(args, "band", None) is not None:
        body["band"] = args.band
    if not body:
        raise SystemExit("llmgw ctl: give --weight" + (" or --band" if args.kind in ("project", "key") else ""))
    answer = client.request("PATCH", f"{COLLECTIONS[args.kind]}/{args.id}/share", body)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    said = f"weight {answer.get('weight')}"
    if "band" in answer:
        said += f", band {answer.get('band')}"
    print(f"{KIND_WORDS[args.kind]} {answer.get('id')} ({answer.get('name')}): {said}")
    return 0


def add_share_commands(ctl_sub: Any) -> None:
    share = ctl_sub.add_parser(
        "share", help="the weights (1 to 1000) and bands that share a busy model: list them, set one"
    )
    share.set_defaults(ctl_func=cmd_share_list)
    sub = share.add_subparsers(dest="share_command", metavar="KIND")
    p = sub.add_parser("list", help="every organisation's, team's and project's weight, and projects' bands")
    p.set_defaults(ctl_func=cmd_share_list)
    for kind, helps in (
        ("org", "an organisation's weight (administrators)"),
        ("team", "a team's weight (administrators and its organisation's managers)"),
        ("project", "a project's weight and highest band (administrators, its team's and organisation's managers)"),
        ("key", "an API key's weight and highest band (its project's managers; its owner may lower its band)"),
    ):
        p = sub.add_parser(kind, help=helps)
        p.add_argument("id", type=int, help=f"the {KIND_WORDS[kind]}'s id")
        p.add_argument("--weight", metavar="N", help="a whole number from 1 to 1000 (1 by default)")
        if kind in ("project", "key"):
            p.add_argument("--band", metavar="BAND", help="the highest band its requests may use: interactive or batch")
        p.set_defaults(ctl_func=cmd_share_set, kind=kind)
