"""`llmgw web`, `llmgw worker`, `llmgw beat`: the production processes."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import socket
import sys
from pathlib import Path

__all__ = ["check_port", "preflight", "run_beat", "run_web", "run_worker"]


def check_port(host: str, port: int) -> str | None:
    """None when host:port can be listened on, else the one-line reason."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use by another program"
            return f"cannot listen on {host}:{port}: {exc.strerror}"
    return None


def preflight(*, listen: tuple[str, int] | None) -> list[str]:
    """Reasons not to start: the port is taken, or a configured service does not answer."""
    from django.conf import settings

    from llmgw import readiness

    problems: list[str] = []
    if listen is not None:
        reason = check_port(*listen)
        if reason:
            problems.append(reason)
    database = readiness.check_database(direct=True)
    if database != "ok":
        where = settings.DATABASE.host or settings.DATABASE.name
        problems.append(f"the database at {where} does not answer ({database})")
    if settings.REDIS_URL:
        broker = readiness.check_broker()
        if broker != "ok":
            problems.append(f"Redis at {settings.REDIS_URL} does not answer ({broker})")
    return problems


def _setup() -> None:
    from llmgw.cli import _django_setup

    _django_setup()


def _listen(args: argparse.Namespace) -> tuple[str, int]:
    from django.conf import settings

    from llmgw.env import parse_listen

    if getattr(args, "listen", None):
        try:
            return parse_listen("--listen", args.listen)
        except Exception as exc:
            sys.exit(f"llmgw: {exc}")
    host, port = settings.LISTEN
    return host, port


def prepare_metrics_dir(data_dir: Path) -> None:
    """Give this web server's processes one folder for their counters, emptied at start."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return
    folder = data_dir / "prometheus"
    shutil.rmtree(folder, ignore_errors=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)


def run_web(args: argparse.Namespace) -> int:
    _setup()
    import uvicorn
    from django.conf import settings

    host, port = _listen(args)
    if args.workers > 1 and not settings.REDIS_URL:
        sys.exit(
            f"llmgw web: cannot start {args.workers} workers without Redis: web processes share replica "
            "slots, rate limits and agent connections through it; set LLMGW_REDIS_URL, or run one worker"
        )
    problems = preflight(listen=(host, port))
    if problems:
        sys.exit(f"llmgw web: cannot start: {problems[0]}")
    from llmgw.celery import ensure_queue_folders

    # Web processes send tasks too (usage batches, reconciler kicks): without Redis the queue's
    # folders must exist before the first, whether or not a worker has started yet.
    ensure_queue_folders()
    log_level = os.environ.get("LLMGW_LOG_LEVEL", "info").lower()
    uvicorn.run(
        "llmgw.asgi:application",
        host=host,
        port=port,
        workers=max(1, args.workers),
        lifespan="on",
        http="llmgw.http_protocol:HttpProtocol",
        proxy_headers=True,
        forwarded_allow_ips=os.environ.get("LLMGW_FORWARDED_ALLOW_IPS", "127.0.0.1"),
        log_level=log_level,
        # One line per request only where it would be shown: building it costs every request.
        access_log=log_level in ("trace", "debug", "info"),
        # The requests in flight finish: the gateway ends those still running after the drain grace
        # with an error naming it (apps.gateway.asgi.begin_stop); uvicorn cuts off what is left after.
        timeout_graceful_shutdown=settings.DRAIN_GRACE + 5,
        ws_max_size=4 * 1024 * 1024,
        # A ping every 20 s, as uvicorn does, but a minute for the answer: under a fleet joining at
        # once the process may be slow to read a pong, and closing a healthy agent's connection
        # then only adds it to those joining. A dead agent's connection still goes within 80 s.
        ws_ping_interval=20.0,
        ws_ping_timeout=60.0,
    )
    return 0


RESTART_WAITS_S = (1.0, 2.0, 5.0, 10.0, 30.0)


def supervise(argv: list[str], what: str) -> int:
    """Run `argv` and start it again whenever it stops on its own, with a growing wait (reset once
    it has run a minute); SIGTERM or SIGINT stop it and end here. Celery's worker can give up for
    good when its broker goes away at the wrong moment ("Unrecoverable error"); the node
    liveness, reconciler and usage writes it carries must come back without an operator."""
    import signal
    import subprocess
    import time

    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failures = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(argv)  # noqa: S603 - our own command line
        code = child.wait()
        if stopping:
            return 0 if code in (0, -signal.SIGTERM, -signal.SIGINT) else code
        failures = 0 if time.monotonic() - started > 60 else failures + 1
        wait = RESTART_WAITS_S[min(failures, len(RESTART_WAITS_S) - 1)]
        print(
            f"llmgw {what}: it stopped (exit code {code}); starting it again in {wait:g} s", file=sys.stderr, flush=True
        )
        deadline = time.monotonic() + wait
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.2)
        if stopping:
            return 0


def run_worker(args: argparse.Namespace) -> int:
    if not getattr(args, "no_restart", False):
        argv = [sys.executable, "-m", "llmgw", "worker", "--no-restart", "--concurrency", str(args.concurrency)]
        return supervise(argv + (["--beat"] if args.beat else []), "worker")
    _setup()
    from llmgw.celery import app, ensure_queue_folders

    problems = preflight(listen=None)
    if problems:
        sys.exit(f"llmgw worker: cannot start: {problems[0]}")
    ensure_queue_folders()
    apply_server_config()
    argv = [
        "worker",
        "--loglevel",
        os.environ.get("LLMGW_LOG_LEVEL", "info").lower(),
        "--concurrency",
        str(max(1, args.concurrency)),
        "--without-gossip",
        "--without-mingle",
    ]
    if args.beat:
        from django.conf import settings

        argv += ["--beat", "--schedule", settings.CELERY_BEAT_SCHEDULE_FILENAME]
    app.worker_main(argv)
    return 0


def apply_server_config() -> None:
    """Models declared in server.yaml (LLMGW_SERVER_CONFIG, else <data dir>/server.yaml) are applied at start."""
    from django.conf import settings

    from apps.catalog.services import SpecError
    from apps.catalog.services import apply_server_config as apply

    path = settings.SERVER_CONFIG
    if not path or not os.path.exists(path):
        return
    try:
        results = apply(path)
    except SpecError as exc:
        sys.exit(f"llmgw: {path}: " + "; ".join(f"{field}: {' '.join(m)}" for field, m in exc.errors.items()))
    for result in results:
        if result.outcome != "unchanged":
            print(f"llmgw: {path}: model {result.name} {result.outcome}", flush=True)
    from apps.cluster.engines import EngineConfigError, apply_server_engines

    try:
        rules = apply_server_engines(path)
    except EngineConfigError as exc:
        sys.exit(f"llmgw: {path}: {exc}")
    if rules is not None:
        print(f"llmgw: {path}: {len(rules)} engine choice(s) applied", flush=True)
    from apps.facility.power import BudgetError, apply_server_budgets

    try:
        budgets = apply_server_budgets(path)
    except BudgetError as exc:
        sys.exit(f"llmgw: {path}: {exc}")
    if budgets is not None:
        print(f"llmgw: {path}: {len(budgets)} power budget(s) applied", flush=True)


def run_beat(args: argparse.Namespace) -> int:
    _setup()
    from django.conf import settings

    from llmgw.celery import app, ensure_queue_folders

    problems = preflight(listen=None)
    if problems:
        sys.exit(f"llmgw beat: cannot start: {problems[0]}")
    ensure_queue_folders()
    app.start(
        [
            "beat",
            "--loglevel",
            os.environ.get("LLMGW_LOG_LEVEL", "info").lower(),
            "--schedule",
            settings.CELERY_BEAT_SCHEDULE_FILENAME,
        ]
    )
    return 0
