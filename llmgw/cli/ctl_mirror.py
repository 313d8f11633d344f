"""`llmgw ctl mirror`: what the model mirror holds and is fetching, and fetching more."""

from __future__ import annotations

import argparse
import json
from typing import Any

from llmgw.cli.ctl import Client, format_table
from llmgw.cli.ctl_commands import human_bytes


def _left(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _progress(file: dict[str, Any]) -> str:
    size = file.get("size")
    if file["state"] == "held":
        return "held"
    if file["state"] == "failed":
        return f"failed: {file.get('error') or '-'}"
    done = human_bytes(file.get("bytes_done") or 0) or "0B"
    total = human_bytes(size) if size is not None else "-"
    pct = f" {100 * (file.get('bytes_done') or 0) // size}%" if size else ""
    rate = f" {human_bytes(file['rate'])}/s" if file.get("rate") else ""
    left = f" {_left(file.get('seconds_left'))} left" if file.get("seconds_left") is not None else ""
    return f"{file['state']} {done}/{total}{pct}{rate}{left}"


def print_mirror(answer: dict[str, Any]) -> None:
    free = human_bytes(answer.get("free_bytes")) or "-"
    print(f"mirror: {human_bytes(answer.get('used_bytes') or 0) or '0B'} held, {free} free")
    rows = []
    for version in answer["versions"]:
        for file in version["files"]:
            rows.append(
                [
                    version["id"],
                    version["repo"],
                    version["commit"][:8],
                    file["path"],
                    human_bytes(file.get("size")) or "-",
                    _progress(file),
                ]
            )
    if rows:
        print(format_table(["ID", "REPO", "COMMIT", "FILE", "SIZE", "STATE"], rows))


def cmd_mirror(client: Client, args: argparse.Namespace) -> int:
    answer = client.get("mirror")
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print_mirror(answer)
    return 0


def cmd_mirror_add(client: Client, args: argparse.Namespace) -> int:
    answer = client.post("mirror", {"urls": args.urls})
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print_mirror(answer)
    return 0


def cmd_mirror_rm(client: Client, args: argparse.Namespace) -> int:
    answer = client.delete(f"mirror/{args.id}")
    print(f"removed; {human_bytes(answer.get('freed_bytes') or 0) or '0B'} freed")
    return 0


def cmd_mirror_manifest(client: Client, args: argparse.Namespace) -> int:
    print(json.dumps(client.get(f"mirror/{args.id}/manifest"), indent=2))
    return 0


def add_mirror_commands(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("mirror", help="the model mirror: what it holds and is fetching (add, rm, manifest)")
    p.set_defaults(ctl_func=cmd_mirror)
    sub = p.add_subparsers(dest="mirror_command", metavar="ACTION")
    q = sub.add_parser("add", help="fetch files from the Hub: URL... (…/owner/name/resolve/main/FILE or hf://…)")
    q.add_argument("urls", nargs="+", metavar="URL")
    q.set_defaults(ctl_func=cmd_mirror_add)
    q = sub.add_parser("rm", help="remove a held version and free its space")
    q.add_argument("id", type=int)
    q.set_defaults(ctl_func=cmd_mirror_rm)
    q = sub.add_parser("manifest", help="a held version's files with sha256 and size")
    q.add_argument("id", type=int)
    q.set_defaults(ctl_func=cmd_mirror_manifest)
