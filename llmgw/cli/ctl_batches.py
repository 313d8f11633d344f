"""ctl subcommands for batches of every organisation (staff), through /api/v1/batches.

    llmgw ctl batch list                          # the newest 50: ID API STATUS DONE FAILED MODEL OWNER CREATED
    llmgw ctl batch list --status in_progress --org 3 --limit 200
    llmgw ctl batch show batch_0123               # every field, the problems by line, the files
    llmgw ctl batch cancel batch_0123             # administrators and operators

A person reads their own batches with their key through /v1/batches (the OpenAI and Anthropic SDKs)
or on the console's Batches page; these commands are the operators' view across organisations.
"""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote, urlencode

from llmgw.cli.ctl import Client, format_table

__all__ = ["add_batch_commands"]

SHOWN_PROBLEMS = 20


def _done(batch: dict[str, Any]) -> str:
    total = batch.get("total")
    done = (batch.get("succeeded") or 0) + (batch.get("failed") or 0)
    return f"{done}/{total} ({batch.get('percent')}%)" if total else "-"


def cmd_batch_list(client: Client, args: argparse.Namespace) -> int:
    query: dict[str, Any] = {"limit": args.limit}
    if args.status:
        query["status"] = args.status
    if args.kind:
        query["kind"] = args.kind
    if args.org is not None:
        query["organization"] = args.org
    page = client.get(f"batches?{urlencode(query)}")
    rows = page["results"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [
        [
            b["id"],
            b["kind"],
            b["status"],
            _done(b),
            b.get("failed"),
            b.get("model"),
            b.get("organization_name") or b.get("owner"),
            (b.get("created_at") or "")[:19].replace("T", " "),
        ]
        for b in rows
    ]
    print(format_table(["ID", "API", "STATUS", "DONE", "FAILED", "MODEL", "OWNER", "CREATED"], table))
    if page.get("next"):
        print(f"(the newest {len(rows)} of {page.get('count')}; --limit for more)")
    return 0


def _print_batch(batch: dict[str, Any]) -> None:
    owner = batch.get("owner")
    if batch.get("organization_name"):
        owner = f"{batch['organization_name']} / {batch.get('project_name') or '-'} ({owner})"
    fields: list[tuple[str, Any]] = [
        ("id", batch["id"]),
        ("api", batch.get("kind")),
        ("status", batch.get("status")),
        ("endpoint", batch.get("endpoint")),
        ("model", batch.get("model")),
        ("owner", owner),
        ("requests", batch.get("total")),
        ("answered", _done(batch)),
        ("succeeded", batch.get("succeeded")),
        ("failed", batch.get("failed")),
        ("of which cancelled", batch.get("canceled")),
        ("of which expired", batch.get("expired")),
        ("prompt tokens", batch.get("prompt_tokens")),
        ("completion tokens", batch.get("completion_tokens")),
        ("lines without token counts", batch.get("lines_without_tokens")),
        ("input file", batch.get("input_file")),
        ("output file", batch.get("output_file")),
        ("error file", batch.get("error_file")),
    ]
    for moment in ("created", "in_progress", "expires", "finalizing", "completed", "failed", "expired"):
        fields.append((moment.replace("_", " ") + " at", batch.get(f"{moment}_at")))
    fields += [("cancelling at", batch.get("cancelling_at")), ("cancelled at", batch.get("cancelled_at"))]
    print(format_table(["FIELD", "VALUE"], fields))
    problems = batch.get("errors") or []
    if problems:
        print()
        rows = [[p.get("line"), p.get("code"), p.get("message")] for p in problems[:SHOWN_PROBLEMS]]
        print(format_table(["LINE", "CODE", "PROBLEM"], rows))
        if len(problems) > SHOWN_PROBLEMS:
            print(f"(the first {SHOWN_PROBLEMS} of {len(problems)} problems; --json for all)")


def cmd_batch_show(client: Client, args: argparse.Namespace) -> int:
    batch = client.get(f"batches/{quote(args.id, safe='')}")
    if args.json:
        print(json.dumps(batch, indent=2))
        return 0
    _print_batch(batch)
    return 0


def cmd_batch_cancel(client: Client, args: argparse.Namespace) -> int:
    batch = client.post(f"batches/{quote(args.id, safe='')}/cancel")
    if args.json:
        print(json.dumps(batch, indent=2))
        return 0
    print(f"batch {batch['id']}: {batch['status']}, {_done(batch)} answered")
    return 0


def add_batch_commands(ctl_sub: Any) -> None:
    batch = ctl_sub.add_parser("batch", help="batches of every organisation (staff): list, show, cancel")
    sub = batch.add_subparsers(dest="batch_command", required=True, metavar="ACTION")
    p = sub.add_parser("list", help="the newest batches: ID API STATUS DONE FAILED MODEL OWNER CREATED")
    p.add_argument("--status", help="only batches of this status (validating, in_progress, completed, ...)")
    p.add_argument("--kind", help="only batches of this API: openai or anthropic")
    p.add_argument("--org", type=int, metavar="ID", help="only this organisation's")
    p.add_argument("--limit", type=int, default=50, metavar="N", help="at most N batches (default 50)")
    p.set_defaults(ctl_func=cmd_batch_list)
    p = sub.add_parser("show", help="a batch's fields, counts, files and the problems of its lines")
    p.add_argument("id")
    p.set_defaults(ctl_func=cmd_batch_show)
    p = sub.add_parser("cancel", help="start no more of its lines; it is cancelled once those running end")
    p.add_argument("id")
    p.set_defaults(ctl_func=cmd_batch_cancel)
