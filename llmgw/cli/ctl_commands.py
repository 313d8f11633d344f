"""ctl subcommands for nodes, models, usage and rate limits."""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import UTC, datetime
from typing import Any

from llmgw.cli.ctl import Client, cell, format_table
from llmgw.cli.ctl_facility import location_text

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
    flags = [name for name in ("cordoned", "draining") if node.get(name)]
    return ",".join([node["status"], *flags])


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
    count = summary.get("gpu_count")
    if count is None:
        return None  # never heard from: unknown, not zero
    classes = summary.get("gpu_classes") or []
    if not count:
        return "0"
    return f"{count}×{'/'.join(classes)}" if classes else str(count)


def _engines(node: dict[str, Any]) -> str | None:
    """Each engine with its version, "-" where the node gave none ("llama.cpp b6500, vllm -"); "none"
    for a node that has none; None (shown "-") for one that never said, or a server too old to tell.
    An install under way or failed follows in the node's words ("llama.cpp installing: ...")."""
    engines = node.get("engines")
    status = node.get("engine_status") or {}
    listed = [f"{engine['name']} {engine.get('version') or '-'}" for engine in engines or []]
    listed += [f"{name} {text}" for name, text in sorted(status.items())]
    if listed:
        return ", ".join(listed)
    if engines is None:
        return None
    return "none"


def node_row(node: dict[str, Any]) -> list[Any]:
    s = node["summary"]
    return [
        node["name"],
        _status(node),
        _cpu(s),
        _pair(s.get("memory_used_bytes"), s.get("memory_total_bytes")),
        _gpus(node),
        _pair(s.get("disk_free_bytes"), s.get("disk_total_bytes")),
        _engines(node),
        location_text(node),
        human_age(node.get("created_at")),
    ]


def cmd_nodes(client: Client, args: argparse.Namespace) -> int:
    from llmgw.cli.ctl_facility import matches_domain

    nodes = client.get("nodes")["results"]
    if args.domain:
        nodes = [n for n in nodes if matches_domain(n, args.domain)]
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    header = ["NAME", "STATUS", "CPU", "MEM", "GPU", "DISK", "ENGINES", "LOCATION", "AGE"]
    print(format_table(header, [node_row(n) for n in nodes]))
    return 0


def cmd_node_show(client: Client, args: argparse.Namespace) -> int:
    node = client.get(f"nodes/{args.name}")
    if args.json:
        print(json.dumps(node, indent=2))
        return 0
    hw, s = node.get("hardware") or {}, node["summary"]
    sample = node.get("sample") or {}
    rows = [
        ("name", node["name"]),
        ("status", _status(node)),
        ("cordon reason", node.get("cordon_reason")),
        ("labels", [f"{k}={v}" for k, v in sorted((node.get("labels") or {}).items())]),
        ("location", location_text(node)),
        ("agent", node.get("agent_version")),
        ("cpu", hw.get("cpu_model")),
        ("cpus", s.get("cpus")),
        ("cpu busy", f"{s['cpu_utilization_pct']:.0f}%" if s.get("cpu_utilization_pct") is not None else None),
        ("load", sample.get("load")),
        ("memory", _pair(s.get("memory_used_bytes"), s.get("memory_total_bytes"))),
        ("disk (local)", _pair(s.get("disk_free_bytes"), s.get("disk_total_bytes"))),
        ("os", hw.get("os")),
        ("kernel", hw.get("kernel")),
        ("arch", hw.get("arch")),
        ("driver", hw.get("driver_version")),
        ("cuda", hw.get("cuda_version")),
        ("engines", _engines(node)),
        ("last seen", human_age(node.get("last_seen_at"))),
        ("warnings", node.get("warnings")),
        ("drain", _drain_line(node["drain"]) if node.get("drain") else None),
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
            table.append(
                [
                    gpu["index"],
                    gpu.get("gpu_class") or gpu.get("name"),
                    f"{live['utilization_gpu_pct']:.0f}%" if live.get("utilization_gpu_pct") is not None else None,
                    mem,
                    live.get("temperature_gpu_c"),
                    live.get("temperature_memory_c"),
                    f"{power if power is not None else '-'}/{limit if limit is not None else '-'}W"
                    if power is not None or limit is not None
                    else None,
                    live.get("ecc_uncorrected_volatile"),
                    "no" if gpu["ecc_fault"] or gpu["foreign_processes"] else "yes",
                ]
            )
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
    answer = client.post(
        "nodes/enrollments",
        {
            "name": args.name,
            "labels": _labels(args.label),
            "expires_in_seconds": _duration(args.expires),
            "disabled_engines": args.disable_engine or [],
        },
    )
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    print(f"Enrollment token for node {answer['node']} (one use, expires {answer['expires_at']}).")
    if answer.get("install_command"):
        print("On the node, run (it installs the agent from this control plane, checks the node, starts it):\n")
        print(f"  {answer['install_command']}\n")
        print("Or, where llmgw is installed already, write this to /etc/llmgw/agent.yaml:\n")
    else:
        print("On the node, write this to /etc/llmgw/agent.yaml:\n")
    print(answer["agent_yaml"])
    print(f"then start the agent:\n\n  {answer['command']}\n")
    return 0


def cmd_node_engines(client: Client, args: argparse.Namespace) -> int:
    node = client.post(f"nodes/{args.name}/engines", {"disable": args.disable, "enable": args.enable})
    if args.json:
        print(json.dumps(node, indent=2))
        return 0
    print(f"node {node['name']}: disabled engines: {', '.join(node.get('disabled_engines') or []) or 'none'}")
    return 0


# Engines ----------------------------------------------------------------------------------------


def _scope(args: argparse.Namespace) -> tuple[str, str]:
    picked = [(k, v) for k, v in (("gpu_class", args.gpu_class), ("label", args.label), ("node", args.node)) if v]
    if len(picked) > 1:
        raise SystemExit("llmgw ctl: name at most one of --gpu-class, --label and --node")
    return picked[0] if picked else ("all", "")


def _print_engines(answer: dict[str, Any]) -> None:
    rows = [[engine, version, "every node (built in)", None] for engine, version in sorted(answer["defaults"].items())]
    for choice in answer["choices"]:
        where = "every node" if choice["scope"] == "all" else f"{choice['scope'].replace('_', ' ')} {choice['match']}"
        rows.append([choice["engine"], choice["version"], where, human_age(choice.get("updated_at"))])
    print(format_table(["ENGINE", "VERSION", "APPLIES TO", "CHANGED"], rows))
    releases = answer.get("releases") or []
    if releases:
        print()
        table = []
        for r in releases:
            state = f"{r['assets']} assets" if r.get("fetched_at") else (r.get("error") or "not read yet")
            table.append([r["engine"], r["version"], state])
        print(format_table(["ENGINE", "RELEASE", "LISTING"], table))


def cmd_engines(client: Client, args: argparse.Namespace) -> int:
    answer = client.get("engines")
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    _print_engines(answer)
    return 0


def cmd_engine_set(client: Client, args: argparse.Namespace) -> int:
    scope, match = _scope(args)
    answer = client.post("engines", {"engine": args.engine, "version": args.version, "scope": scope, "match": match})
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    _print_engines(answer)
    return 0


def cmd_engine_unset(client: Client, args: argparse.Namespace) -> int:
    scope, match = _scope(args)
    answer = client.post("engines/remove", {"engine": args.engine, "scope": scope, "match": match})
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    _print_engines(answer)
    return 0


def cmd_engine_refresh(client: Client, args: argparse.Namespace) -> int:
    answer = client.post("engines/refresh", None)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    _print_engines(answer)
    return 0


def cmd_engine_build(client: Client, args: argparse.Namespace) -> int:
    node = client.post(f"nodes/{args.name}/engine-build", {"build": args.build})
    if args.json:
        print(json.dumps(node, indent=2))
        return 0
    print(f"node {node['name']}: vLLM/SGLang build {node['engine_build']}")
    for engine, text in sorted((node.get("engine_status") or {}).items()):
        if engine in ("vllm", "sglang"):
            print(f"  {engine} {text}")
    return 0


def add_engine_commands(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("engines", help="which engine versions the nodes should have, and the releases read")
    p.set_defaults(ctl_func=cmd_engines)
    engine = ctl_sub.add_parser("engine", help="set or unset the version of an engine for some nodes")
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="ACTION")
    for verb, func, text in (
        ("set", cmd_engine_set, "give the nodes picked (every node by default) this version; 'none' keeps it off"),
        ("unset", cmd_engine_unset, "remove a rule; the nodes it picked take the next one that matches"),
    ):
        p = engine_sub.add_parser(verb, help=text)
        p.add_argument("engine", help="llama.cpp, vllm or sglang")
        if verb == "set":
            p.add_argument("version", help="a release tag (b10991) or none")
        p.add_argument("--gpu-class", help="only nodes with a GPU of this class (H100-80GB)")
        p.add_argument("--label", metavar="KEY=VALUE", help="only nodes with this label")
        p.add_argument("--node", help="only this node")
        p.set_defaults(ctl_func=func)
    p = engine_sub.add_parser("refresh", help="read the releases the nodes want now (from the releases API)")
    p.set_defaults(ctl_func=cmd_engine_refresh)
    p = ctl_sub.add_parser(
        "engine-build", help="which CUDA build of vLLM and SGLang a node installs: auto, cu13, cu129 or none"
    )
    p.add_argument("name", help="the node")
    p.add_argument("build", choices=["auto", "cu13", "cu129", "none"])
    p.set_defaults(ctl_func=cmd_engine_build)


def _action(verb: str) -> Any:
    def run(client: Client, args: argparse.Namespace) -> int:
        body: dict[str, Any] | None = None
        if verb == "cordon":
            body = {"reason": args.reason}
        elif verb == "drain":
            body = {"grace": args.grace, "force": args.force}
        node = client.post(f"nodes/{args.name}/{verb}", body)
        print(f"node {node['name']}: {_status(node)}")
        drain = node.get("drain")
        if drain:
            print(_drain_line(drain))
        return 0

    return run


def _drain_line(drain: dict[str, Any]) -> str:
    if not drain["left"]:
        return "drained: no replica left on it"
    lines = [f"draining: {drain['left']} replica(s) left" + (" (forced)" if drain.get("force") else "")]
    for replica in drain["replicas"]:
        why = f": {'; '.join(replica['reasons'])}" if replica["reasons"] else ""
        lines.append(f"  {replica['model']}#{replica['replica']} {replica['state']}{why}")
    return "\n".join(lines)


def add_all(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("nodes", help="list nodes: NAME STATUS CPU MEM GPU DISK ENGINES LOCATION AGE")
    p.add_argument("--domain", metavar="LEVEL=NAME", help="only the nodes in one site, room, row, rack or PDU")
    p.set_defaults(ctl_func=cmd_nodes)
    node = ctl_sub.add_parser("node", help="one node: show, add, cordon, uncordon, drain, revoke")
    node_sub = node.add_subparsers(dest="node_command", required=True, metavar="ACTION")
    p = node_sub.add_parser("show", help="a node's hardware, figures and GPUs")
    p.add_argument("name")
    p.set_defaults(ctl_func=cmd_node_show)
    p = node_sub.add_parser("add", help="make a one-time enrollment token and print the agent's set-up")
    p.add_argument("name")
    p.add_argument("--label", action="append", metavar="KEY=VALUE", help="a label for the node (repeatable)")
    p.add_argument("--expires", default="1h", help="how long the token is good for (default 1h)")
    p.add_argument(
        "--disable-engine", action="append", metavar="ENGINE", help="keep an engine off this node (repeatable)"
    )
    p.set_defaults(ctl_func=cmd_node_add)
    p = node_sub.add_parser("engines", help="keep engines off a node, or let them back")
    p.add_argument("name")
    p.add_argument("--disable", action="append", metavar="ENGINE", default=[], help="keep this engine off (repeatable)")
    p.add_argument("--enable", action="append", metavar="ENGINE", default=[], help="let this engine back (repeatable)")
    p.set_defaults(ctl_func=cmd_node_engines)
    p = node_sub.add_parser("cordon", help="keep new replicas off a node")
    p.add_argument("name")
    p.add_argument("--reason", required=True, help="why (shown to other operators)")
    p.set_defaults(ctl_func=_action("cordon"))
    p = node_sub.add_parser("uncordon", help="let replicas be placed on a node again")
    p.add_argument("name")
    p.set_defaults(ctl_func=_action("uncordon"))
    p = node_sub.add_parser("drain", help="cordon a node and move its replicas elsewhere, each replaced first")
    p.add_argument("name")
    p.add_argument(
        "--grace",
        type=int,
        help="seconds its engines run on for the requests in flight, each stopped once idle "
        "(default: the server's drain grace)",
    )
    p.add_argument(
        "--force", action="store_true", help="stop replicas that cannot be placed elsewhere instead of waiting for room"
    )
    p.set_defaults(ctl_func=_action("drain"))
    p = node_sub.add_parser("revoke", help="cut a node off: its credential stops working at once")
    p.add_argument("name")
    p.set_defaults(ctl_func=_action("revoke"))
    add_engine_commands(ctl_sub)
    from llmgw.cli.ctl_mirror import add_mirror_commands

    add_mirror_commands(ctl_sub)
    from llmgw.cli.ctl_fabrics import add_fabric_commands

    add_fabric_commands(ctl_sub)
    from llmgw.cli.ctl_facility import add_facility_commands

    add_facility_commands(ctl_sub)
    from llmgw.cli.ctl_guardrails import add_guardrail_commands

    add_guardrail_commands(ctl_sub)
    add_model_commands(ctl_sub)
    add_usage_commands(ctl_sub)
    add_limit_commands(ctl_sub)
    from llmgw.cli.ctl_shares import add_share_commands

    add_share_commands(ctl_sub)
    from llmgw.cli.ctl_batches import add_batch_commands

    add_batch_commands(ctl_sub)


# Models ----------------------------------------------------------------------------------------


def cmd_models(client: Client, args: argparse.Namespace) -> int:
    models = client.get("models")["results"]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    rows = []
    for m in models:
        s = m["status"]
        where = "external" if m.get("external_url") else (",".join(s["nodes"]) or None)
        rolling = s.get("rolling")
        change = f"rolling {rolling['done']} of {rolling['of']}" if rolling else None
        rows.append(
            [
                m["name"],
                m["capacity_class"],
                f"{s['ready']}/{s['wanted']}",
                s["starting"] or None,
                s["pending"] or None,
                s["failed"] or None,
                change,
                where,
            ]
        )
    print(format_table(["NAME", "CLASS", "READY", "STARTING", "PENDING", "FAILED", "CHANGE", "NODES"], rows))
    for m in models:
        for line in _model_troubles(m):
            print(line)
    return 0


def _model_troubles(model: dict[str, Any]) -> list[str]:
    """Under the table, why a model is not running: the refusals its pending replica met, and each
    failed engine with its exit code and the last lines of its own log."""
    status = model["status"]
    lines = [f"{model['name']}: pending: {reason}" for reason in status.get("reasons") or []]
    for failure in status.get("failures") or []:
        code = failure.get("exit_code")
        head = f"{model['name']}#{failure['replica']} failed on {failure['node']}"
        head += f" (exit code {code})" if code is not None else ""
        lines.append(f"{head}: {failure.get('message') or '-'}")
        lines += [f"    | {line}" for line in failure.get("log_tail") or []]
    return lines


def cmd_model_apply(client: Client, args: argparse.Namespace) -> int:
    import yaml

    try:
        with open(args.file) as handle:
            data = yaml.safe_load(handle)
    except OSError as exc:
        raise SystemExit(f"llmgw ctl: cannot read {args.file}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise SystemExit(f"llmgw ctl: {args.file} is not valid YAML: {exc}") from None
    from llmgw.cli.ctl import ApiError

    body = dict(data) if isinstance(data, dict) else {"models": data}
    if args.dry_run:
        body["dry_run"] = True
    try:
        answer = client.post("models/apply", body)
    except ApiError as exc:
        if exc.status == 400 and exc.errors:
            for path, messages in exc.errors.items():
                for message in messages:
                    print(f"llmgw ctl: {args.file}: {path}: {message}", file=sys.stderr)
            return 1
        if exc.status == 400:
            print(f"llmgw ctl: {args.file}: {exc.detail}", file=sys.stderr)
            return 1
        raise
    for result in answer["results"]:
        verb = (
            {"created": "would be created", "changed": "would change", "unchanged": "unchanged"}[result["outcome"]]
            if args.dry_run
            else result["outcome"]
        )
        print(f"model {result['name']}: {verb}")
        if args.dry_run:
            for line in _diff_lines(result.get("changes") or {}):
                print(f"  {line}")
    return 0


def _diff_lines(changes: dict[str, Any], prefix: str = "") -> list[str]:
    """A dry run's changes, one field a line: `- old` and `+ new`, as kubectl diff shows them."""
    lines: list[str] = []
    for field, change in changes.items():
        if field == "profiles" and isinstance(change, dict):
            for name, diff in change.items():
                lines += _diff_lines(diff, f"profiles[{name}].")
        elif field == "profiles_removed":
            lines += [f"- profiles[{name}] (removed)" for name in change]
        elif isinstance(change, list) and len(change) == 2:
            lines.append(f"{prefix}{field}:")
            lines.append(f"  - {json.dumps(change[0])}")
            lines.append(f"  + {json.dumps(change[1])}")
    return lines


def cmd_model_delete(client: Client, args: argparse.Namespace) -> int:
    if not args.yes:
        if not sys.stdin.isatty():  # a script or CI: there is no one to ask
            print(
                f"model {args.name}: not deleted: deleting asks for a confirmation and no terminal is attached "
                "to answer it; add --yes to delete without asking",
                file=sys.stderr,
            )
            return 2
        try:
            answer = input(f"Delete model {args.name}? Its replicas stop and no route serves it. [y/N] ")
        except EOFError:  # the terminal's end of input (Ctrl-D) is no
            answer = ""
            print()
        if answer.strip().lower() not in ("y", "yes"):
            print("not deleted")
            return 1
    client.delete(f"models/{args.name}")
    print(f"model {args.name}: deleted (its replicas are stopping; its usage history stays)")
    return 0


def cmd_model_show(client: Client, args: argparse.Namespace) -> int:
    model = client.get(f"models/{args.name}")
    if args.json:
        print(json.dumps(model, indent=2))
        return 0
    s = model["status"]
    rows = [
        ("name", model["name"]),
        ("class", model["capacity_class"]),
        (
            "replicas",
            f"{s['ready']} ready of {s['wanted']} wanted ({model['min_replicas']} always running, "
            f"up to {model['max_replicas']} under load)",
        ),
        ("every replica last busy", model.get("busy_at")),
        ("source", model.get("source")),
        ("fallbacks", model.get("fallbacks")),
        ("external", model.get("external_url")),
        ("held until", model.get("held_until")),
        ("message", s.get("message")),
    ]
    print(format_table(["FIELD", "VALUE"], rows))
    if model.get("profiles"):
        print()
        print(
            format_table(
                ["PROFILE", "PRIORITY", "ENGINE", "ACCELERATOR", "GPUS", "NODES", "MEMORY", "CORES"],
                [
                    [
                        p["name"],
                        p["priority"],
                        p["engine"],
                        p["accelerator"],
                        p["gpus_per_shard"] or None,
                        p["nodes_per_replica"],
                        human_bytes(p["memory_bytes"]) if p["memory_bytes"] else None,
                        p["cpu_cores"] or None,
                    ]
                    for p in model["profiles"]
                ],
            )
        )
    if model.get("replicas"):
        print()
        print(
            format_table(
                ["REPLICA", "STATE", "PROFILE", "NODES", "PORTS", "AGE", "MESSAGE"],
                [
                    [
                        r["id"],
                        r["state"],
                        r.get("profile"),
                        ",".join(sh["node"] for sh in r["shards"]) or None,
                        ",".join(str(sh["port"]) for sh in r["shards"]) or None,
                        human_age(r.get("created_at")),
                        r.get("message"),
                    ]
                    for r in model["replicas"]
                ],
            )
        )
    return 0


def _notes(node: dict[str, Any]) -> str:
    """What placement's plugins say of a node (its fabric and leaf), as "; fabric ib-a (...), leaf lf01"."""
    notes = node.get("notes") or {}
    return "".join(f"; {key} {value}" for key, value in notes.items())


def _placed_lines(answer: dict[str, Any]) -> list[str]:
    """Where each placed replica runs and why (its own claims not counted against it), then the
    heading of what follows: where one more replica would go."""
    lines = []
    for item in answer.get("placed") or []:
        for node in item["nodes"]:
            head = f"replica {item['replica']} ({item['state']}) runs on {node['node']} [{item['profile'] or '-'}]"
            if node["fits"]:
                score = f" (score {node['score']:.2f})" if node.get("score") is not None else ""
                weights = f"; {node['weights']}" if node.get("weights") else ""
                lines.append(f"{head}: fits{score}{weights}{_notes(node)}")
            elif node["fits"] is None:
                lines.append(f"{head}: -")
            for reason in [*item.get("reasons", []), *node["reasons"]]:
                lines.append(f"{head}: would be refused now: {reason}")
    if answer.get("more_placed"):
        lines.append(f"... {answer['more_placed']} more placed replicas")
    if lines and answer["profiles"]:
        lines.append("one more replica:")
    return lines


def cmd_model_explain(client: Client, args: argparse.Namespace) -> int:
    answer = client.get(f"models/{args.name}/explain?nodes={'all' if args.all else args.nodes}")
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    for line in _placed_lines(answer):
        print(line)
    for profile in answer["profiles"]:
        verdict = "fits" if profile["fits"] else "fits nowhere"
        print(f"profile {profile['profile']} (priority {profile['priority']}): {verdict}")
        for reason in profile.get("reasons") or []:
            print(f"  {reason}")
        for node in profile["nodes"]:
            if node["fits"]:
                score = f" (score {node['score']:.2f}" if node.get("score") is not None else ""
                if score and node.get("scores"):
                    score += ": " + ", ".join(f"{name} {value:.2f}" for name, value in node["scores"].items())
                score += ")" if score else ""
                weights = f"; {node['weights']}" if node.get("weights") else ""
                print(f"  {node['node']}: fits{score}{weights}{_notes(node)}")
            for index, reason in enumerate(node["reasons"]):
                print(f"  {node['node']}: {reason}{_notes(node) if index == 0 else ''}")
        if profile.get("more_fit"):
            print(f"  ... {profile['more_fit']} more nodes fit")
        for group in profile.get("more_refused") or []:
            print(f"  ... {group['count']} more refused, such as: {group['example']}")
    placed = [r for r in answer["replicas"] if r["rejections"]]
    for replica in placed:
        print(f"replica {replica['id']} ({replica['state']}) was refused by:")
        for rejection in replica["rejections"]:
            print(f"  {rejection['node'] or '-'} [{rejection['profile']}]: {rejection['reason']}")
    return 0


def cmd_model_target(client: Client, args: argparse.Namespace) -> int:
    body = {k: v for k, v in (("min", args.min), ("max", args.max)) if v is not None}
    model = client.post(f"models/{args.name}/target", body)
    print(f"model {model['name']}: {model['min_replicas']} always-running, up to {model['max_replicas']}")
    return 0


def cmd_model_resources(client: Client, args: argparse.Namespace) -> int:
    body = {
        k: v for k, v in (("memory", args.memory), ("cores", args.cores), ("profile", args.profile)) if v is not None
    }
    for profile in client.post(f"models/{args.name}/resources", body):
        print(
            f"profile {profile['name']}: memory {human_bytes(profile['memory_bytes']) or '-'}, "
            f"cores {profile['cpu_cores'] or '-'}"
        )
    return 0


def cmd_model_class(client: Client, args: argparse.Namespace) -> int:
    model = client.post(f"models/{args.name}/class", {"capacity_class": args.capacity_class})
    print(f"model {model['name']}: class {model['capacity_class']}")
    return 0


def cmd_replicas(client: Client, args: argparse.Namespace) -> int:
    replicas = client.get("replicas")["results"]
    if args.json:
        print(json.dumps(replicas, indent=2))
        return 0
    print(
        format_table(
            ["ID", "MODEL", "STATE", "PROFILE", "NODES", "AGE", "MESSAGE"],
            [
                [
                    r["id"],
                    r["model"],
                    r["state"],
                    r.get("profile"),
                    ",".join(s["node"] for s in r["shards"]) or None,
                    human_age(r.get("created_at")),
                    r.get("message"),
                ]
                for r in replicas
            ],
        )
    )
    return 0


def add_model_commands(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser("models", help="list models: ready of wanted, starting, nodes")
    p.set_defaults(ctl_func=cmd_models)
    p = ctl_sub.add_parser("replicas", help="list replicas")
    p.set_defaults(ctl_func=cmd_replicas)
    model = ctl_sub.add_parser("model", help="one model: apply, show, explain, target, resources, class")
    sub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    p = sub.add_parser(
        "apply",
        help="create or update models from a YAML file (idempotent; each model's spec is its whole declaration)",
    )
    p.add_argument("-f", "--file", required=True)
    p.add_argument("--dry-run", action="store_true", help="change nothing; list, field by field, what would change")
    p.set_defaults(ctl_func=cmd_model_apply)
    p = sub.add_parser("delete", help="take a model out of service: its replicas stop, its usage history stays")
    p.add_argument("name")
    p.add_argument("--yes", action="store_true", help="do not ask for a confirmation")
    p.set_defaults(ctl_func=cmd_model_delete)
    p = sub.add_parser("show", help="a model, its profiles and replicas")
    p.add_argument("name")
    p.set_defaults(ctl_func=cmd_model_show)
    p = sub.add_parser("explain", help="where the model fits, and why every other node was refused")
    p.add_argument("name")
    p.add_argument("--nodes", type=int, default=200, help="nodes spelled out per profile, the rest counted")
    p.add_argument("--all", action="store_true", help="spell out every node")
    p.set_defaults(ctl_func=cmd_model_explain)
    p = sub.add_parser("target", help="set always-running (--min) and under-load (--max) replicas")
    p.add_argument("name")
    p.add_argument("--min", type=int)
    p.add_argument("--max", type=int)
    p.set_defaults(ctl_func=cmd_model_target)
    p = sub.add_parser("resources", help="set the memory and cores a model's profiles claim")
    p.add_argument("name")
    p.add_argument("--memory", help="e.g. 24GB")
    p.add_argument("--cores", type=float)
    p.add_argument("--profile", help="only this profile")
    p.set_defaults(ctl_func=cmd_model_resources)
    p = sub.add_parser("class", help="set the capacity class: critical, standard, opportunistic")
    p.add_argument("name")
    p.add_argument("capacity_class", choices=["critical", "standard", "opportunistic", ""])
    p.set_defaults(ctl_func=cmd_model_class)


# Usage -----------------------------------------------------------------------------------------


def _since(text: str, now: datetime | None = None) -> str:
    """A duration back from now (30m, 6h, 7d) or an ISO time, as an ISO time in UTC."""
    from datetime import timedelta

    match = re.fullmatch(r"(\d+)([smhd]?)", text.strip())
    if match:
        seconds = int(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        moment = (now or datetime.now(UTC)) - timedelta(seconds=seconds)
    else:
        try:
            moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise SystemExit(
                f"llmgw ctl: --since {text!r}: expected a duration such as 1h or 7d, or an ISO time"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z")


def _ms(value: float | None) -> str | None:
    """Milliseconds: whole from 100 up, else three significant digits (0.357, 4.20, 42.0)."""
    import math

    if value is None:
        return None
    if value >= 100 or value <= 0:
        return f"{value:.0f}"
    return f"{value:.{max(0, 2 - math.floor(math.log10(value)))}f}"


USAGE_COLUMNS = (  # header, field of the API's row
    ("GROUP", "label"),
    ("REQUESTS", "requests"),
    ("SERVER_ERRORS", "server_errors"),
    ("CLIENT_ERRORS", "client_errors"),
    ("REFUSALS", "refusals"),
    ("TOKENS_IN", "prompt_tokens"),
    ("TOKENS_OUT", "completion_tokens"),
    ("GPU_HOURS", "gpu_hours"),
    ("CORE_HOURS", "core_hours"),
    ("P50_TTFT_MS", "first_token_ms_p50"),
    ("P95_TTFT_MS", "first_token_ms_p95"),
    ("P99_TTFT_MS", "first_token_ms_p99"),
    ("P50_LATENCY_MS", "latency_ms_p50"),
    ("P95_LATENCY_MS", "latency_ms_p95"),
    ("P99_LATENCY_MS", "latency_ms_p99"),
    ("P50_QUEUE_MS", "queue_ms_p50"),
    ("P99_QUEUE_MS", "queue_ms_p99"),
)


def _usage_cell(name: str, value: Any) -> Any:
    if name.endswith(("_p50", "_p95", "_p99")):
        return _ms(value)
    if name == "gpu_hours" and isinstance(value, dict):  # by GPU class: "10.0 (H100-80GB)"
        classes = ",".join(sorted(value))
        return f"{sum(value.values()):.1f}" + (f" ({classes})" if classes else "")
    if name == "core_hours" and isinstance(value, int | float):
        return f"{value:.1f}"
    return value


def cmd_usage(client: Client, args: argparse.Namespace) -> int:
    from urllib.parse import urlencode

    answer = client.get("usage?" + urlencode({"group_by": args.by, "since": _since(args.since)}))
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    rows = []
    for result in answer["results"]:
        # A server from before server_errors and client_errors: its errors were the server's; client ones unknown.
        row = {"server_errors": result.get("errors"), "client_errors": None, **result}
        rows.append([_usage_cell(name, row.get(name)) for _header, name in USAGE_COLUMNS])
    print(format_table([header for header, _name in USAGE_COLUMNS], rows))
    return 0


def cmd_request(client: Client, args: argparse.Namespace) -> int:
    from urllib.parse import quote

    record = client.get(f"requests/{quote(args.id, safe='')}")
    if args.json:
        print(json.dumps(record, indent=2))
        return 0
    rows = []
    for name, value in record.items():
        if name == "guardrail":
            # What each guardrail rule did: "refuse company/no cards (card); log pii/mails (email)".
            value = (
                "; ".join(
                    f"{f.get('action')} {f.get('policy')}/{f.get('rule')}"
                    + (f" ({f['detector']})" if f.get("detector") else "")
                    + (" on the answer" if f.get("where") == "answer" else "")
                    + (f" [no verdict: {f['error']}]" if f.get("error") else "")
                    for f in value
                )
                if value
                else None
            )
        rows.append((name, value))
    print(format_table(["FIELD", "VALUE"], rows))
    return 0


def add_usage_commands(ctl_sub: Any) -> None:
    p = ctl_sub.add_parser(
        "usage",
        help="usage per group: requests, server and client errors, refusals (429), "
        "tokens, TTFT, latency and queue wait percentiles in ms",
    )
    p.add_argument(
        "--by",
        default="model",
        choices=["organization", "team", "project", "key", "model", "user"],
        help="what to group by (default model)",
    )
    p.add_argument("--since", default="24h", help="how far back: 1h, 7d or an ISO time (default 24h)")
    p.set_defaults(ctl_func=cmd_usage)
    p = ctl_sub.add_parser("request", help="every field of one request through the gateway")
    p.add_argument("id", help="the request id (x-request-id)")
    p.set_defaults(ctl_func=cmd_request)


# Rate limits -----------------------------------------------------------------------------------

LIMIT_OPTIONS = (
    ("rpm", "requests_per_minute"),
    ("tpm", "tokens_per_minute"),
    ("tpd", "tokens_per_day"),
    ("budget", "monthly_token_budget"),
)
# --api-key, not --key: ctl's own --key is the caller's key.
OWNER_OPTIONS = (("org", "organization"), ("team", "team"), ("project", "project"), ("api_key", "api_key"))


def _limit_values(args: argparse.Namespace) -> dict[str, int | None]:
    """The limits given on the command line; 0 clears one (no limit)."""
    return {field: (value or None) for option, field in LIMIT_OPTIONS if (value := getattr(args, option)) is not None}


def _print_limit(limit: dict[str, Any], outcome: str) -> None:
    values = ", ".join(f"{option} {cell(limit[field])}" for option, field in LIMIT_OPTIONS)
    print(f"limit {limit['id']} ({limit['scope']}) {outcome}: {values}")


def cmd_limits(client: Client, args: argparse.Namespace) -> int:
    limits = client.get("limits")["results"]
    if args.json:
        print(json.dumps(limits, indent=2))
        return 0
    print(
        format_table(
            ["ID", "SCOPE", "RPM", "TPM", "TPD", "BUDGET"],
            [[limit["id"], limit["scope"], *(limit[field] for _option, field in LIMIT_OPTIONS)] for limit in limits],
        )
    )
    return 0


def cmd_limit_create(client: Client, args: argparse.Namespace) -> int:
    owners = {field: value for option, field in OWNER_OPTIONS if (value := getattr(args, option)) is not None}
    if len(owners) != 1:
        raise SystemExit("llmgw ctl: give exactly one of --org, --team, --project or --api-key")
    _print_limit(client.post("limits", {**owners, **_limit_values(args)}), "created")
    return 0


def cmd_limit_set(client: Client, args: argparse.Namespace) -> int:
    _print_limit(client.request("PATCH", f"limits/{args.id}", _limit_values(args)), "set")
    return 0


def cmd_limit_delete(client: Client, args: argparse.Namespace) -> int:
    client.request("DELETE", f"limits/{args.id}")
    print(f"limit {args.id} deleted")
    return 0


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    for option, field in LIMIT_OPTIONS:
        parser.add_argument(f"--{option}", type=int, metavar="N", help=f"{field.replace('_', ' ')} (0: no limit)")


def add_limit_commands(ctl_sub: Any) -> None:
    limits = ctl_sub.add_parser("limits", help="rate limits and token budgets: list, create, set, delete")
    limits.set_defaults(ctl_func=cmd_limits)
    sub = limits.add_subparsers(dest="limits_command", metavar="ACTION")
    p = sub.add_parser("list", help="every limit (the default)")
    p.set_defaults(ctl_func=cmd_limits)
    p = sub.add_parser("create", help="a limit for one organisation, team, project or API key (by id)")
    for option, field in OWNER_OPTIONS:
        p.add_argument(
            f"--{option.replace('_', '-')}", type=int, metavar="ID", help=f"the {field.replace('_', ' ')}'s id"
        )
    _limit_arguments(p)
    p.set_defaults(ctl_func=cmd_limit_create)
    p = sub.add_parser("set", help="change some of a limit's values")
    p.add_argument("id", type=int)
    _limit_arguments(p)
    p.set_defaults(ctl_func=cmd_limit_set)
    p = sub.add_parser("delete", help="remove a limit")
    p.add_argument("id", type=int)
    p.set_defaults(ctl_func=cmd_limit_delete)
