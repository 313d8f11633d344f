"""The node's own command line, for an agent installed without the rest of llmgw.

    python3 llmgw-agent.pyz agent  --config /etc/llmgw/agent.yaml
    python3 llmgw-agent.pyz doctor --config /etc/llmgw/agent.yaml [--json]

The one-file bundle a node is onboarded with (apps/cluster/onboarding.py) runs this; `llmgw
agent` and `llmgw doctor` in a full installation run the same functions. No Django import;
importable on Python 3.11.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

__all__ = ["doctor", "find_config", "main"]

DEFAULT_CONFIG = os.environ.get("LLMGW_AGENT_CONFIG", "agent.yaml")
#: Where an installed node keeps its agent.yaml.
SYSTEM_CONFIG = "/etc/llmgw/agent.yaml"


def config_places() -> list[str]:
    """Where `doctor` looks for agent.yaml when it is not told: the current directory, the node's
    system file, and the local agent's that `llmgw up` writes (<data dir>/agent/agent.yaml, the data
    directory being LLMGW_DATA_DIR or ./var, as for the server)."""
    data_dir = os.path.expanduser(os.environ.get("LLMGW_DATA_DIR") or "var")
    return ["agent.yaml", SYSTEM_CONFIG, os.path.abspath(os.path.join(data_dir, "agent", "agent.yaml"))]


def find_config(given: str | None) -> tuple[str, list[str]]:
    """(the agent.yaml to read, the places looked at): `given` (--config) or LLMGW_AGENT_CONFIG as
    they are, else the first of config_places() that exists; ("", places) when none does."""
    named = given or os.environ.get("LLMGW_AGENT_CONFIG")
    if named:
        return named, [named]
    places = config_places()
    return next((place for place in places if os.path.isfile(place)), ""), places


def doctor(config_path: str | None, *, as_json: bool = False) -> int:
    """`llmgw doctor`: one line per check of this node; 1 when a check failed. Without a path
    (--config), the agent.yaml find_config() finds, and a first line saying which."""
    from agent import doctor as checks
    from agent.config import ConfigError, load_config

    path, places = find_config(config_path)
    if not path:
        print(f"fail  agent.yaml           none found: looked for {', '.join(places)} — pass --config PATH")
        return 1
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"fail  agent.yaml           {path}: {exc}")
        return 1
    if config_path is None and not as_json:  # found here: say which
        print(f"pass  agent.yaml           {os.path.abspath(path)}")
    found = checks.run_checks(config)
    if as_json:
        print(json.dumps([check.as_dict() for check in found], indent=2))
    else:
        print(checks.format_lines(found))
    return checks.exit_status(found)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmgw-agent", description="The llmgw node agent.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("agent", help="run the node agent")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="path of agent.yaml")
    p = sub.add_parser("doctor", help="check this node: engines, GPUs, AVX2, model directories, control plane, clock")
    p.add_argument("--config", default=None, help="path of agent.yaml (default: found, see find_config)")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    sub.add_parser("version", help="print the agent's version")
    args = parser.parse_args(argv)
    if args.command == "agent":
        from agent.main import run

        return run(args.config)
    if args.command == "doctor":
        return doctor(args.config, as_json=args.json)
    from agent.main import AGENT_VERSION

    print(f"llmgw-agent {AGENT_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
