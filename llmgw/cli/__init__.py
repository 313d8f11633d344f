"""The `llmgw` command.

llmgw up        everything on one machine (web, worker with beat, a local agent)
llmgw web       the ASGI server (console, API, gateway, agent websockets)
llmgw worker    a Celery worker (--beat to embed the scheduler)
llmgw beat      the Celery beat scheduler (run exactly one)
llmgw agent     the node agent
llmgw manage    Django management commands
llmgw ctl       a client for the REST API
llmgw version
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _django_setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    from django.core.exceptions import ImproperlyConfigured

    try:
        import django

        django.setup()
    except ImproperlyConfigured as exc:
        sys.exit(f"llmgw: configuration error: {exc}")


def cmd_version(args: argparse.Namespace) -> int:
    import llmgw

    print(f"llmgw {llmgw.__version__}")
    return 0


def cmd_manage(args: argparse.Namespace) -> int:
    _django_setup()
    from django.core.management import execute_from_command_line

    execute_from_command_line(["llmgw manage", *args.rest])
    return 0


def _process(kind: str) -> None:
    """Say which process this is before Django's settings load: the worker and beat keep no
    database pool (llmgw.settings: PROCESS), and whatever they start inherits it."""
    os.environ["LLMGW_PROCESS"] = kind


def cmd_web(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmgw.cli import serve

    _process("web")
    # Before Django imports any metric: several web processes must share one folder of counters.
    serve.prepare_metrics_dir(Path(os.environ.get("LLMGW_DATA_DIR") or "var").expanduser().resolve())

    return serve.run_web(args)


def cmd_worker(args: argparse.Namespace) -> int:
    from llmgw.cli import serve

    _process("worker")
    return serve.run_worker(args)


def cmd_beat(args: argparse.Namespace) -> int:
    from llmgw.cli import serve

    _process("beat")
    return serve.run_beat(args)


def cmd_up(args: argparse.Namespace) -> int:
    from llmgw.cli import up

    return up.run(args)


def cmd_ctl(args: argparse.Namespace) -> int:
    from llmgw.cli import ctl

    return ctl.run(args)


def cmd_agent(args: argparse.Namespace) -> int:
    try:
        from agent.main import run as run_agent
    except ImportError:
        sys.exit("llmgw: the agent is not part of this installation")
    return run_agent(args.config)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Check this node: its engines and their libraries, GPUs, AVX2, model directories, the
    control plane and the clock. One line per check; exit 1 when one failed."""
    try:
        from agent.cli import doctor
    except ImportError:
        sys.exit("llmgw: the agent is not part of this installation")
    return doctor(args.config, as_json=args.json)


ENGINE_FILES_ACTIONS = ("add", "fetch", "list")


def engine_files_parser() -> argparse.ArgumentParser:
    """`llmgw engine-files add|fetch|list`; a bare list of files is `add` (as before)."""
    parser = argparse.ArgumentParser(
        prog="llmgw engine-files",
        description="Keep engine archives on the control plane: its nodes fetch them from it, "
        "whether or not GitHub can be reached.",
    )
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("add", help="keep archives copied here (named as the release names them)")
    p.add_argument("files", nargs="+", metavar="FILE")
    p = sub.add_parser(
        "fetch", help="fetch once, from GitHub, the archives of a release the fleet's nodes need (their builds)"
    )
    p.add_argument("tag", metavar="TAG", help="the release tag, e.g. b10991")
    p.add_argument("--engine", default="llama.cpp", help="the engine (default llama.cpp)")
    p.add_argument(
        "--asset", action="append", default=[], metavar="NAME", help="also fetch this archive of the release (repeat)"
    )
    sub.add_parser("list", help="the archives held, with their digests")
    return parser


def cmd_engine_files(args: argparse.Namespace) -> int:
    """Keep engine archives on the control plane, to serve its nodes (sites without the internet)."""
    words = list(args.words)
    if words and words[0] not in ENGINE_FILES_ACTIONS and not words[0].startswith("-"):
        words.insert(0, "add")
    options = engine_files_parser().parse_args(words)
    _django_setup()
    from apps.cluster import engines

    try:
        if options.action == "add":
            return _engine_files_add(options.files)
        if options.action == "fetch":
            return _engine_files_fetch(options.engine, options.tag, options.asset)
    except engines.EngineConfigError as exc:
        sys.exit(f"llmgw engine-files: {exc}")
    from django.conf import settings

    held = engines.held_files()
    if not held:
        print(f"no engine archives held in {settings.ENGINE_FILES_DIR}")
    for item in held.values():
        print(f"{item.name}: {item.size} bytes, sha256 {item.sha256}")
    return 0


def _engine_files_add(files: list[str]) -> int:
    from pathlib import Path

    from apps.cluster.engines import store_file

    for name in files:
        path = Path(name)
        try:
            with open(path, "rb") as handle:
                stored, digest, size = store_file(path.name, iter(lambda: handle.read(1 << 20), b""))
        except OSError as exc:
            sys.exit(f"llmgw engine-files: cannot read {path}: {exc.strerror}")
        print(f"{stored.name}: {size} bytes, sha256 {digest}")
    return 0


def _engine_files_fetch(engine: str, tag: str, names: list[str]) -> int:
    """Print each archive fetched (or held already, or failed, with why) and the nodes it is for,
    then the nodes that need none; exit 1 when one failed."""
    from apps.cluster.engines import fetch_held

    done = fetch_held(engine, tag, names=names)
    for item in done.files:
        nodes = f" (for {', '.join(item.nodes)})" if item.nodes else ""
        print(f"{item.name}: {item.state}: {item.detail}{nodes}")
    for node, why in done.without:
        print(f"node {node}: no archive of {tag} needed: {why}")
    return 1 if any(item.state == "failed" for item in done.files) else 0


def cmd_sim(args: argparse.Namespace) -> int:
    """Run a fleet scenario through the reconciler's own decisions and print what happened."""
    import json
    from pathlib import Path

    if args.captures:
        os.environ["LLMGW_SIM_CAPTURES"] = args.captures
    _django_setup()
    import yaml

    from apps.sim import report as text_report
    from apps.sim.service import ScenarioError, simulate_text

    path = Path(args.scenario)
    try:
        source: Any = sys.stdin.read() if args.scenario == "-" else path.read_text(encoding="utf-8")
    except OSError as exc:
        sys.exit(f"llmgw sim: cannot read {path}: {exc.strerror}")
    if args.from_cluster:  # the same as from_cluster: true in the file
        try:
            document = yaml.safe_load(source)
        except yaml.YAMLError:
            document = None  # the parser says what is wrong with it
        if isinstance(document, dict):
            source = {**document, "from_cluster": True}
    try:
        result = simulate_text(source, base=None if args.scenario == "-" else path.resolve().parent)
    except ScenarioError as exc:
        print(f"llmgw sim: {path} has {len(exc.problems)} problem(s):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(result, indent=1, default=str))
    else:
        print(text_report.as_text(result))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmgw", description="A private LLM service over your own servers.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("up", help="run everything on this machine (web, worker with beat, local agent)")
    p.add_argument("--listen", help="host:port (default LLMGW_LISTEN or 127.0.0.1:8000)")
    p.add_argument("--no-agent", action="store_true", help="do not start a local agent")
    p.add_argument(
        "--keep-engines",
        action="store_true",
        help="leave the local agent's engines running at stop, for the next `llmgw up` to adopt",
    )
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("web", help="run the ASGI server")
    p.add_argument("--listen", help="host:port (default LLMGW_LISTEN or 127.0.0.1:8000)")
    p.add_argument("--workers", type=int, default=1, help="number of web processes (default 1)")
    p.set_defaults(func=cmd_web)

    p = sub.add_parser("worker", help="run a Celery worker")
    p.add_argument("--beat", action="store_true", help="embed the beat scheduler (one per installation)")
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--no-restart", action="store_true", help=argparse.SUPPRESS)  # the supervised worker itself
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("beat", help="run the Celery beat scheduler (exactly one per installation)")
    p.set_defaults(func=cmd_beat)

    p = sub.add_parser("agent", help="run the node agent")
    p.add_argument(
        "--config",
        default=os.environ.get("LLMGW_AGENT_CONFIG", "agent.yaml"),
        help="path of agent.yaml (default ./agent.yaml or LLMGW_AGENT_CONFIG)",
    )
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("doctor", help="check this node: engines, GPUs, AVX2, model directories, control plane, clock")
    p.add_argument(
        "--config",
        default=None,
        help=(
            "path of agent.yaml (default LLMGW_AGENT_CONFIG, else the first that exists of ./agent.yaml,"
            " /etc/llmgw/agent.yaml and the local agent's <data dir>/agent/agent.yaml written by `llmgw up`)"
        ),
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser(
        "engine-files",
        help="keep engine archives on the control plane for its nodes (add FILE..., fetch TAG, list)",
        add_help=False,
    )
    p.add_argument("words", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_engine_files)

    p = sub.add_parser("sim", help="what if: a fleet and a script of events through the real scheduler, in memory")
    p.add_argument("scenario", metavar="SCENARIO", help="the scenario's YAML file (- for stdin); see docs/sim.md")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.add_argument("--out", metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("--captures", metavar="DIR", help="where captured files are looked up (LLMGW_SIM_CAPTURES)")
    p.add_argument(
        "--from-cluster",
        action="store_true",
        help="start from the live fleet's nodes, models, holds and caps (as from_cluster: true)",
    )
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("manage", help="Django management commands", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_manage)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=cmd_version)

    from llmgw.cli import ctl

    ctl.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["engine-files"]:  # its own parser, so that `llmgw engine-files --help` is its help
        return cmd_engine_files(argparse.Namespace(words=words[1:]))
    parser = build_parser()
    args = parser.parse_args(words)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
