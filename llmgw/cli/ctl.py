"""`llmgw ctl`: a client for the REST API.

The server and key come from --server/--key, else LLMGW_SERVER/LLMGW_API_KEY, else
~/.config/llmgw/ctl.yaml (keys `server` and `key`). Tables print "-" for what is unknown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ApiError", "Client", "CommandParser", "add_parser", "format_table", "run"]

DEFAULT_SERVER = "http://127.0.0.1:8000"
CONFIG_PATH = Path("~/.config/llmgw/ctl.yaml")


class ApiError(Exception):
    def __init__(self, status: int, detail: str, errors: dict[str, list[str]] | None = None) -> None:
        super().__init__(f"{status}: {detail}")
        self.status = status
        self.detail = detail
        self.errors = errors or {}


@dataclass
class Client:
    server: str
    key: str | None
    timeout: float = 30.0

    def request(self, method: str, path: str, body: Any = None) -> Any:
        url = self.server.rstrip("/") + "/api/v1/" + path.lstrip("/")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method)  # noqa: S310 - the operator's URL
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            errors: dict[str, list[str]] = {}
            try:
                payload = json.loads(raw)
                detail = payload.get("detail") if isinstance(payload, dict) else None
                if isinstance(payload, dict) and isinstance(payload.get("errors"), dict):
                    errors = payload["errors"]
                    detail = f"{detail} {json.dumps(errors)}"
            except ValueError:
                detail = None
            raise ApiError(exc.code, str(detail or exc.reason), errors) from None
        except urllib.error.URLError as exc:
            raise ApiError(0, f"cannot reach {self.server}: {exc.reason}") from None
        return json.loads(raw) if raw else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body if body is not None else {})

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)


def load_config(path: Path | None = None) -> dict[str, str]:
    target = (path or CONFIG_PATH).expanduser()
    try:
        text = target.read_text()
    except OSError:
        return {}
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        sys.exit(f"llmgw ctl: {target} is not valid YAML: {exc}")
    if not isinstance(data, dict):
        sys.exit(f"llmgw ctl: {target} must be a mapping with keys 'server' and 'key'")
    return {str(k): str(v) for k, v in data.items() if v is not None}


def client_from_args(args: argparse.Namespace) -> Client:
    config = load_config(Path(args.config) if args.config else None)
    server = args.server or os.environ.get("LLMGW_SERVER") or config.get("server") or DEFAULT_SERVER
    key = args.key or os.environ.get("LLMGW_API_KEY") or config.get("key")
    return Client(server=server, key=key)


def cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list | tuple):
        return ",".join(cell(item) for item in value) or "-"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[cell(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    lines = ["  ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    lines += ["  ".join(v.ljust(widths[i]) for i, v in enumerate(row)).rstrip() for row in cells]
    return "\n".join(lines)


# Commands ------------------------------------------------------------------------------


def cmd_whoami(client: Client, args: argparse.Namespace) -> int:
    me = client.get("me")
    memberships = [
        "/".join(part for part in (m.get("organization"), m.get("team"), m.get("project")) if part) + f" ({m['role']})"
        for m in me.get("memberships", [])
    ]
    auth = me.get("auth", {})
    rows = [
        ("email", me.get("email")),
        ("name", me.get("name")),
        ("staff role", me.get("staff_role") or ("admin" if me.get("is_superuser") else None)),
        ("memberships", memberships),
        (
            "signed in with",
            f"key {auth.get('key_name')} ({auth.get('key_prefix')}…)"
            if auth.get("method") == "api_key"
            else auth.get("method"),
        ),
        ("server", client.server),
    ]
    print(format_table(["FIELD", "VALUE"], rows))
    return 0


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    status = client.get("status")
    rows: list[tuple[str, Any]] = [("server", client.server), ("version", status.get("version"))]
    rows += [(name, value) for name, value in status.get("counts", {}).items()]
    rows += [(name, value) for name, value in status.get("checks", {}).items()]
    print(format_table(["FIELD", "VALUE"], rows))
    held = [
        (fabric, entry["model"], entry["copies"])
        for fabric, models in (status.get("fabrics") or {}).items()
        for entry in models
    ]
    if held:
        print()
        print(format_table(["FABRIC", "MODEL", "COPIES"], held))
    return 0


JSON_HELP = "print the raw JSON answer where there is one"


class CommandParser(argparse.ArgumentParser):
    """The parser of every ctl command, and of their own commands: each takes --json as well, so it
    may come before the command or after it (`llmgw ctl --json usage`, `llmgw ctl usage --json`).

    Left out, a command's --json sets nothing (SUPPRESS), so the one given before the command holds.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=JSON_HELP)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("ctl", help="talk to an llmgw server's REST API")
    parser.add_argument("--server", help=f"server URL (default LLMGW_SERVER, ctl.yaml or {DEFAULT_SERVER})")
    parser.add_argument("--key", help="API key (default LLMGW_API_KEY or ctl.yaml)")
    parser.add_argument("--config", help=f"config file (default {CONFIG_PATH})")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)
    # Commands' parsers, and the parsers of their own commands (parser_class is inherited), are CommandParsers.
    ctl_sub = parser.add_subparsers(dest="ctl_command", required=True, metavar="COMMAND", parser_class=CommandParser)
    p = ctl_sub.add_parser("whoami", help="who the key belongs to")
    p.set_defaults(ctl_func=cmd_whoami)
    p = ctl_sub.add_parser("status", help="what the server holds and whether its services answer")
    p.set_defaults(ctl_func=cmd_status)
    from llmgw.cli import ctl_commands

    ctl_commands.add_all(ctl_sub)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    client = client_from_args(args)
    try:
        return int(args.ctl_func(client, args) or 0)
    except ApiError as exc:
        print(
            f"llmgw ctl: {exc.detail}" if exc.status == 0 else f"llmgw ctl: error {exc.status}: {exc.detail}",
            file=sys.stderr,
        )
        return 1
