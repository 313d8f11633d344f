"""ctl subcommands for guardrail policies: list them with what they did, show one as YAML, apply
policies from a file (YAML or JSON, one policy or a list), delete one."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from llmgw.cli.ctl import Client, format_table

__all__ = ["add_guardrail_commands"]


def _where(policy: dict[str, Any]) -> str:
    for key in ("organization", "team", "project", "model"):
        if policy.get(key):
            return f"{key} {policy[key]}"
    return "everyone"


def cmd_guardrails(client: Client, args: argparse.Namespace) -> int:
    answer = client.get("guardrails")
    if args.json:
        print(json.dumps(answer, indent=2, ensure_ascii=False))
        return 0
    rows = []
    for policy in answer["results"]:
        counts = policy.get("counts") or {}
        rows.append(
            [
                policy["name"] + ("" if policy["enabled"] else " (off)"),
                _where(policy),
                len(policy["rules"]),
                *(counts.get(action, 0) for action in ("refuse", "redact", "stop", "log")),
            ]
        )
    print(format_table(["POLICY", "APPLIES TO", "RULES", "REFUSED", "REDACTED", "STOPPED", "LOGGED"], rows))
    print("(actions in the last 24 hours)")
    return 0


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    import yaml

    policy = client.get("guardrails/" + quote(args.name, safe=""))
    policy.pop("counts", None)
    print(yaml.safe_dump(policy, sort_keys=False, allow_unicode=True, default_flow_style=None, width=100), end="")
    return 0


def cmd_apply(client: Client, args: argparse.Namespace) -> int:
    import yaml

    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as exc:  # one line, as model apply says it
        raise SystemExit(f"llmgw ctl: cannot read {args.file}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError as exc:
        print(f"llmgw ctl: {args.file} is not YAML or JSON: {exc}", file=sys.stderr)
        return 2
    policies = data if isinstance(data, list) else [data]
    for policy in policies:
        answer = client.post("guardrails", policy)
        print(f"policy {answer['name']}: {len(answer['rules'])} rules, applies to {_where(answer)}")
    return 0


def cmd_delete(client: Client, args: argparse.Namespace) -> int:
    client.delete("guardrails/" + quote(args.name, safe=""))
    print(f"policy {args.name} deleted")
    return 0


def add_guardrail_commands(ctl_sub: Any) -> None:
    guardrails = ctl_sub.add_parser("guardrails", help="guardrail policies: what they refuse, redact and stop")
    guardrails.set_defaults(ctl_func=cmd_guardrails)
    sub = guardrails.add_subparsers(dest="guardrails_command", metavar="ACTION")
    p = sub.add_parser("show", help="one policy as YAML, as apply takes it")
    p.add_argument("name")
    p.set_defaults(ctl_func=cmd_show)
    p = sub.add_parser("apply", help="set the policies in a YAML or JSON file (- for stdin); each replaces its name")
    p.add_argument("file")
    p.set_defaults(ctl_func=cmd_apply)
    p = sub.add_parser("delete", help="remove a policy")
    p.add_argument("name")
    p.set_defaults(ctl_func=cmd_delete)
