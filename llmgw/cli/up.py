"""`llmgw up`: the whole of llmgw on one machine, for a first look.

1. Check that the port is free and any configured PostgreSQL/Redis answers.
2. Migrate the database and create the first administrator if there is none.
3. Collect static files (content-hashed) into the data directory.
4. Start web, a worker with embedded beat, and a local agent as child processes, each in
   its own process group, their output prefixed with their name.
5. On Ctrl-C or SIGTERM stop every child (SIGTERM, then SIGKILL after a grace), or stop
   all of them when one dies, so no process is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable

__all__ = ["Supervisor", "run"]

STOP_GRACE_S = 10.0


def _die_with_parent() -> None:
    """In the child: ask the kernel to SIGTERM us if `llmgw up` itself dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Supervisor:
    """Starts named children, prefixes their output, and stops them all together."""

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._threads: list[threading.Thread] = []
        self._write = write or (lambda line: (sys.stdout.write(line), sys.stdout.flush()))
        self._lock = threading.Lock()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        process = subprocess.Popen(  # noqa: S603 - argv is built by us
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.children[name] = process
        thread = threading.Thread(target=self._pump, args=(name, process), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _pump(self, name: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        prefix = f"{name:<7}| "
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            with self._lock:
                self._write(prefix + line + "\n")

    def first_exited(self) -> tuple[str, int] | None:
        for name, process in self.children.items():
            code = process.poll()
            if code is not None:
                return name, code
        return None

    def stop_all(self, grace: float = STOP_GRACE_S) -> None:
        for process in self.children.values():
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self.children.values():
            remaining = max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=remaining)
        # Whatever is still there, and anything a child forked into its group, goes now.
        for process in self.children.values():
            _signal_group(process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        for thread in self._threads:
            thread.join(timeout=2)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _wait_ready(url: str, stop: threading.Event, timeout: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - our own loopback URL
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.3)
    return False


def _agent_available() -> bool:
    try:
        import agent.main  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> int:
    from llmgw.cli import _django_setup

    _django_setup()
    from django.conf import settings
    from django.core.management import call_command

    from llmgw.cli.local_agent import local_agent_config
    from llmgw.cli.serve import preflight
    from llmgw.env import parse_listen

    try:
        host, port = parse_listen("--listen", args.listen) if args.listen else settings.LISTEN
    except Exception as exc:
        print(f"llmgw up: {exc}", file=sys.stderr)
        return 2
    problems = preflight(listen=(host, port))
    if problems:
        print(f"llmgw up: cannot start: {problems[0]}", file=sys.stderr)
        return 1

    call_command("migrate", interactive=False, verbosity=0)
    from apps.accounts.services import ensure_first_admin

    created = ensure_first_admin(settings.FIRST_ADMIN_EMAIL)
    if created is not None:
        user, password = created
        print(f"llmgw up: created the first administrator {user.email} with password {password}")
        print("llmgw up: this password is shown only once; only its hash is kept.")
    call_command("collectstatic", interactive=False, verbosity=0)
    from django.db import connections

    connections.close_all()

    env = dict(os.environ)
    env["LLMGW_DATA_DIR"] = str(settings.DATA_DIR)
    env["LLMGW_LISTEN"] = f"{host}:{port}"
    env["PYTHONUNBUFFERED"] = "1"
    python = sys.executable
    supervisor = Supervisor()
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    supervisor.start("web", [python, "-m", "llmgw", "web", "--listen", f"{host}:{port}"], env)
    supervisor.start("worker", [python, "-m", "llmgw", "worker", "--beat", "--concurrency", "1"], env)
    base_url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    if not args.no_agent and _agent_available():
        agent_config = local_agent_config(settings.DATA_DIR, base_url)
        supervisor.start("agent", [python, "-m", "llmgw", "agent", "--config", str(agent_config)], env)

    def announce() -> None:
        if _wait_ready(f"{base_url}/healthz", stop):
            print(f"llmgw up: ready at {base_url}/ (API {base_url}/api/v1/, admin {base_url}/django-admin/)",
                  flush=True)

    threading.Thread(target=announce, daemon=True).start()
    exit_code = 0
    try:
        while not stop.is_set():
            exited = supervisor.first_exited()
            if exited is not None:
                name, code = exited
                print(f"llmgw up: {name} exited with code {code}; stopping the rest", file=sys.stderr, flush=True)
                exit_code = 1
                break
            stop.wait(0.5)
    finally:
        print("llmgw up: stopping", flush=True)
        supervisor.stop_all()
        print("llmgw up: stopped", flush=True)
    return exit_code



