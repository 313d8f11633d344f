"""`llmgw up`: the whole of llmgw on one machine, for a first look.

1. Check that the port is free and any configured PostgreSQL/Redis answers.
2. Migrate the database and create the first administrator if there is none.
3. Collect static files (content-hashed) into the data directory.
4. Start web and a worker with embedded beat as child processes, each in its own process
   group, and a local agent once web answers.
5. On Ctrl-C or SIGTERM stop every child (SIGTERM to each, then SIGKILL to its whole group
   after a grace), or stop all of them when one dies, so no process is left behind. The agent
   goes first (its engines run on without it); then web, with the worker: web takes no new
   request and finishes those in flight (up to LLMGW_DRAIN_GRACE_SECONDS; a second Ctrl-C stops
   at once). Then the engines the local agent ran, which nothing can reach any more: they live
   in sessions of their own, so they are read from the agent's engines.json and stopped with the
   agent's own supervisor (the same proof that a pid is still the engine it started; SIGTERM, the engine's
   stop grace, SIGKILL). `--keep-engines` leaves them running, for the agent of the next
   `llmgw up` to adopt, as a production agent adopts its engines after a restart.

Every line a child writes goes to `<data_dir>/logs/up.log`, prefixed with its name. The
terminal shows what a person needs: the address, the first administrator's password (once,
at the end of start-up), warnings and errors, and processes or engines that stop, start or
start again.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TextIO

__all__ = ["LineFilter", "Output", "Supervisor", "no_engine_line", "run", "stop_local_engines"]

STOP_GRACE_S = 10.0
# Web's requests in flight get the drain grace; this much more is left for its own stop after it.
WEB_STOP_MARGIN_S = 15.0
WEB_QUIET_S = 2.0  # web still running this long after SIGTERM is finishing requests: say so
READY_TIMEOUT_S = 90.0
LOG_ROTATE_BYTES = 32 * 1024 * 1024
TAIL_LINES = 15  # a child's last lines, shown when it exits on its own
NO_ENGINE = (
    "llmgw up: this machine has no llama.cpp engine, so models will stay pending until the local agent "
    "has installed one (progress below): the llama.cpp release the control plane chooses, from GitHub or "
    "an archive added with `llmgw engine-files`, else compiled from the llama-cpp-python source on the "
    "package index (about 18 minutes on 2 cores); or set LLMGW_LLAMA_SERVER=/path/to/llama-server, "
    "put llama-server on PATH, or run scripts/ensure-llama-server"
)


# --------------------------------------------------------------------------- output


#: A log record's level, as Python's logging, Celery and uvicorn write it, at the start of a line.
_LEVEL = re.compile(r"^\s*\[?(?:\d{4}-\d\d-\d\d[ T][\d:.,]+\]?:?\s+)?(WARNING|WARN|ERROR|CRITICAL|FATAL)\b")
_PY_WARNING = re.compile(r"\b\w*Warning: ")
#: The CLI's own words ("llmgw worker: it stopped (exit code 1); starting it again in 1 s").
_LLMGW_LINE = re.compile(r"^llmgw( \w+)?: ")
#: The agent's engine supervisor logs only changes: started, adopted, restarting, ready, failed, stopped;
#: its installer what an install is doing (downloading, with progress, checking, failed, installed).
_ENGINE_CHANGE = re.compile(r" llmgw\.agent\.(?:supervisor|install): ")
#: Warnings that say nothing to a person running `llmgw up`: Celery's about running as root;
#: kombu's about the filesystem broker, which has no host name to give; and kombu's about a task it
#: had fetched while the worker was stopping, which it puts back on the queue for the next start.
_NOISE = (
    re.compile(r"SecurityWarning: You're running the worker with superuser privileges"),
    re.compile(r"kombu\.connection: No hostname was supplied"),
    re.compile(r"kombu\.transport\.virtual\.base: Requeuing undeliverable message for queue '[^']*': No consumers"),
)


class LineFilter:
    """Decides, line by line, what of one child's output the terminal shows."""

    def __init__(self) -> None:
        self._traceback = False

    def shown(self, line: str) -> bool:
        if line.startswith("Traceback (most recent call last):"):
            self._traceback = True
            return False
        if self._traceback:
            if (
                not line.strip()
                or line[:1] in (" ", "\t")
                or line.startswith(
                    ("During handling of the above exception", "The above exception was the direct cause")
                )
            ):
                return False
            self._traceback = False
            return True  # the exception itself ("ValueError: ..."), below the lines of its traceback
        if any(noise.search(line) for noise in _NOISE):
            return False
        return bool(
            _LEVEL.search(line) or _PY_WARNING.search(line) or _LLMGW_LINE.search(line) or _ENGINE_CHANGE.search(line)
        )


class Output:
    """Where `llmgw up`'s lines go: every one into the log file, and what a person needs onto the terminal.

    Without a log file (it could not be opened) the terminal shows everything, as it is the only copy.
    """

    def __init__(
        self, log_path: Path | None = None, terminal: TextIO | None = None, errors: TextIO | None = None
    ) -> None:
        self.log_path = log_path
        self._terminal = terminal or sys.stdout
        self._errors = errors or sys.stderr
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._filters: dict[str, LineFilter] = {}
        self._tails: dict[str, collections.deque[str]] = {}
        self.problem: str | None = None
        if log_path is not None:
            try:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    if log_path.stat().st_size > LOG_ROTATE_BYTES:
                        os.replace(log_path, log_path.with_name(log_path.name + ".1"))
                self._file = log_path.open("a", encoding="utf-8", errors="replace")
            except OSError as exc:
                self.problem = f"cannot write {log_path}: {exc.strerror or exc}"
                self.log_path = None
        self._log(f"==== llmgw up {time.strftime('%Y-%m-%dT%H:%M:%S%z')} (pid {os.getpid()})")

    def say(self, text: str, *, error: bool = False, log: bool = True) -> None:
        """One of `llmgw up`'s own lines: on the terminal, and (unless log=False) in the log file."""
        with self._lock:
            stream = self._errors if error else self._terminal
            stream.write(text + "\n")
            stream.flush()
            if log:
                self._log(f"{'up':<7}| {text}")

    def log(self, text: str) -> None:
        """A line for the log file only."""
        with self._lock:
            self._log(f"{'up':<7}| {text}")

    def child(self, name: str, line: str, *, show: bool | None = None) -> None:
        """One line a child wrote; `show` overrides the filter."""
        text = f"{name:<7}| {line}"
        with self._lock:
            self._log(text)
            self._tails.setdefault(name, collections.deque(maxlen=TAIL_LINES)).append(line)
            shown = self._filters.setdefault(name, LineFilter()).shown(line) if show is None else show
            if shown or self._file is None:
                self._terminal.write(text + "\n")
                self._terminal.flush()

    def tail(self, name: str) -> list[str]:
        with self._lock:
            return list(self._tails.get(name, ()))

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _log(self, text: str) -> None:
        if self._file is not None:
            try:
                self._file.write(text + "\n")
                self._file.flush()
            except OSError:
                self._file = None


class _ToOutput(logging.Handler):
    """Log records of this process (the engine supervisor's, at stop) into the log file;
    warnings and errors onto the terminal too."""

    def __init__(self, output: Output, name: str) -> None:
        super().__init__()
        self.output = output
        self.name_shown = name
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.output.child(self.name_shown, self.format(record), show=record.levelno >= logging.WARNING)
        except Exception:
            self.handleError(record)


# --------------------------------------------------------------------------- children


def _die_with_parent() -> None:
    """In the child: ask the kernel to SIGTERM us if `llmgw up` itself dies (even by SIGKILL).

    The kernel sends it when the thread that started the child ends, so children are started
    from the main thread only."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Supervisor:
    """Starts named children, passes their output on line by line, and stops them."""

    def __init__(self, on_line: Callable[[str, str], None] | None = None) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._on_line = on_line or (lambda name, line: (sys.stdout.write(f"{name:<7}| {line}\n"), sys.stdout.flush()))
        self._deadlines: dict[str, float] = {}
        #: Set to stop waiting for graces: what is still running is killed at once.
        self.hurry = threading.Event()

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
        self._threads[name] = thread

    def _pump(self, name: str, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            self._on_line(name, raw.decode(errors="replace").rstrip("\r\n"))

    def first_exited(self) -> tuple[str, int] | None:
        for name, process in list(self.children.items()):
            code = process.poll()
            if code is not None:
                return name, code
        return None

    def finish_output(self, name: str, timeout: float = 2.0) -> None:
        """Wait until everything `name` wrote has been passed on (it has exited)."""
        thread = self._threads.get(name)
        if thread is not None:
            thread.join(timeout=timeout)

    def terminate(self, names: Iterable[str], grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the main process of each (it stops its own children: Celery's pool, the worker it
        supervises), and note when its group gets SIGKILL."""
        for name in names:
            process = self.children.get(name)
            if process is None or name in self._deadlines:
                continue
            self._deadlines[name] = time.monotonic() + grace
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)

    def reap(self, names: Iterable[str]) -> None:
        """Wait for each to end (until its grace is over); then SIGKILL whatever is left in its group."""
        chosen = [name for name in names if name in self.children]
        for name in chosen:
            process = self.children[name]
            deadline = self._deadlines.get(name, time.monotonic())
            while process.poll() is None and not self.hurry.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        # Whatever is still there, and anything a child forked into its group, goes now.
        for name in chosen:
            process = self.children[name]
            _signal_group(process, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        for name in chosen:
            self.finish_output(name)

    def exited(self, names: Iterable[str], seconds: float) -> bool:
        """Wait up to `seconds` for each to end; whether all have."""
        deadline = time.monotonic() + seconds
        for name in names:
            process = self.children.get(name)
            if process is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            if process.poll() is None:
                return False
        return True

    def stop(self, names: Iterable[str], grace: float = STOP_GRACE_S) -> None:
        names = list(names)
        self.terminate(names, grace)
        self.reap(names)

    def stop_all(self, grace: float = STOP_GRACE_S) -> None:
        """The agent first (so it leaves the control plane while it still answers), then the rest."""
        self.stop([name for name in self.children if name == "agent"], grace)
        self.stop(list(self.children), grace)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _wait_ready(url: str, stop: threading.Event, timeout: float = READY_TIMEOUT_S) -> bool:
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


# --------------------------------------------------------------------------- engines


def no_engine_line(found: str | None, configured: str | None) -> str | None:
    """What to say at start about this machine's llama.cpp engine: nothing when there is one;
    how to get one when there is none; and LLMGW_LLAMA_SERVER's mistake when it names no program."""
    if found is None:
        if configured:
            return NO_ENGINE + f" (LLMGW_LLAMA_SERVER={configured} is not an executable file)"
        return NO_ENGINE
    if configured and os.path.realpath(found) != os.path.realpath(configured):
        return f"llmgw up: LLMGW_LLAMA_SERVER={configured} is not an executable file; using {found}"
    return None


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" + ("" if count == 1 else "s")


def _running_engines(state_dir: Path) -> int:
    """How many engines in the agent's engines.json still run as recorded (same pid, start time, group)."""
    import json

    from agent.supervisor import STATE_FILE, read_proc_stat

    try:
        records = json.loads((state_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return 0
    count = 0
    for record in records.values() if isinstance(records, dict) else ():
        if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
            continue
        stat = read_proc_stat(record["pid"])
        if (
            stat is not None
            and not stat.dead
            and stat.start_ticks == record.get("start_ticks")
            and stat.pgrp == record.get("pgid")
        ):
            count += 1
    return count


def stop_local_engines(state_dir: Path, output: Output | None = None) -> int:
    """Stop every engine the agent with this state_dir left running; return how many there were.

    The agent's own supervisor reads engines.json and adopts only processes proven to be the
    engines it started; converging on nothing then stops each (SIGTERM to its process group, the
    engine's stop grace, SIGKILL) and leaves engines.json empty. Call it once the agent has exited.
    """
    import asyncio

    from agent.supervisor import RUNNING, STATE_FILE
    from agent.supervisor import Supervisor as EngineSupervisor

    if not (state_dir / STATE_FILE).exists():
        return 0
    logger = logging.getLogger("llmgw.agent")
    handler = _ToOutput(output, "engines") if output is not None else None
    saved = logger.propagate
    if handler is not None:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        engines = EngineSupervisor(state_dir, {})
        running = [state for state in engines.states() if state["state"] in RUNNING]
        if running:
            asyncio.run(engines.converge([]))
        return len(running)
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            logger.propagate = saved


# --------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """`llmgw up` itself (the steps in the module docstring); the exit status: 2 for a bad --listen,
    1 when it cannot start, a child exits on its own or the engines could not be stopped, else 0."""
    from llmgw.cli import _django_setup

    _django_setup()
    from django.conf import settings

    from llmgw.cli.local_agent import find_llama_server
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

    output = _open_output(Path(settings.DATA_DIR))
    with_agent = not args.no_agent and _agent_available()
    keep_engines = bool(getattr(args, "keep_engines", False))
    if with_agent:
        notice = no_engine_line(find_llama_server(), os.environ.get("LLMGW_LLAMA_SERVER") or None)
        if notice:
            output.say(notice)
    password_lines = _prepare(output, settings.FIRST_ADMIN_EMAIL)
    return _run_children(
        output,
        host=host,
        port=port,
        data_dir=settings.DATA_DIR,
        drain_grace=settings.DRAIN_GRACE,
        with_agent=with_agent,
        keep_engines=keep_engines,
        password_lines=password_lines,
    )


def _open_output(data_dir: Path) -> Output:
    """The output of this run, its log file under ``<data_dir>/logs``; the first line says where it goes."""
    output = Output(data_dir / "logs" / "up.log")
    if output.log_path is not None:
        output.say(f"llmgw up: the full output of every process goes to {output.log_path}")
    else:
        output.say(f"llmgw up: {output.problem}; every process's output is shown here", error=True)
    return output


def _prepare(output: Output, admin_email: str) -> list[str]:
    """Migrate, create the first administrator if there is none, and collect static files; the
    lines that show the new administrator's password (none when there was one already), for the
    terminal only."""
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)
    from apps.accounts.services import ensure_first_admin

    created = ensure_first_admin(admin_email)
    password_lines: list[str] = []
    if created is not None:
        user, password = created
        password_lines = [
            f"llmgw up: created the first administrator {user.email} with password {password}",
            "llmgw up: this password is shown only once; only its hash is kept.",
        ]
        output.log(f"created the first administrator {user.email} (its password is shown on the terminal only)")
    collect_static()
    from django.db import connections

    connections.close_all()
    return password_lines


#: What the collected static files were collected from, in STATIC_ROOT beside them.
COLLECTED_STAMP = ".llmgw-collected"


def collect_static() -> bool:
    """Run collectstatic unless STATIC_ROOT already holds what the sources are now (their paths,
    sizes and modification times, the same as at the last collection here). Hashing and compressing
    some 900 files costs 3-4 s of CPU, which every `llmgw up` paid again for files that had not
    changed. True when it collected."""
    import hashlib

    from django.conf import settings
    from django.contrib.staticfiles.finders import get_finders
    from django.core.management import call_command

    digest = hashlib.sha256(settings.STORAGES["staticfiles"]["BACKEND"].encode())
    for finder in get_finders():
        for path, storage in finder.list([]):
            stat = os.stat(storage.path(path))
            digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    stamp = Path(settings.STATIC_ROOT) / COLLECTED_STAMP
    with contextlib.suppress(OSError):
        if stamp.read_text() == digest.hexdigest():
            return False
    call_command("collectstatic", interactive=False, verbosity=0)
    stamp.write_text(digest.hexdigest())
    return True


def _show_password(output: Output, password_lines: list[str]) -> None:
    """Put the first administrator's password on the terminal, once: the lines are emptied."""
    for line in password_lines:
        output.say(line, log=False)
    password_lines.clear()


def _run_children(
    output: Output,
    *,
    host: str,
    port: int,
    data_dir: Path,
    drain_grace: int,
    with_agent: bool,
    keep_engines: bool,
    password_lines: list[str],
) -> int:
    """Start web and the worker, and the local agent once web answers (or gave up); then wait for
    Ctrl-C or SIGTERM, or for a child to exit on its own, and stop everything.  The exit status."""
    from llmgw.cli.local_agent import local_agent_config

    env = _child_env(data_dir, host, port)
    python = sys.executable
    supervisor = Supervisor(output.child)
    stop = threading.Event()
    wake = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        if stop.is_set():
            supervisor.hurry.set()  # a second Ctrl-C: no more waiting
        stop.set()
        wake.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    supervisor.start("web", [python, "-m", "llmgw", "web", "--listen", f"{host}:{port}"], env)
    supervisor.start("worker", [python, "-m", "llmgw", "worker", "--beat", "--concurrency", "1"], env)
    base_url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    agent_state: Path | None = None
    if with_agent:
        agent_config = local_agent_config(data_dir, base_url)
        agent_state = agent_config.parent  # state_dir, as local_agent_config writes it

    web_ready = threading.Event()
    web_waited = threading.Event()

    def wait_for_web() -> None:
        if _wait_ready(f"{base_url}/healthz", stop):
            web_ready.set()
        web_waited.set()
        wake.set()

    threading.Thread(target=wait_for_web, daemon=True).start()
    exit_code = 0
    started = False
    try:
        while not stop.is_set():
            exited = supervisor.first_exited()
            if exited is not None:
                _say_exited(supervisor, output, *exited)
                exit_code = 1
                break
            if web_waited.is_set() and not started:
                started = True
                _say_started(output, base_url, ready=web_ready.is_set())
                if agent_state is not None:
                    # From the main thread: the kernel ties the agent's life to the thread that starts it.
                    supervisor.start(
                        "agent", [python, "-m", "llmgw", "agent", "--config", str(agent_state / "agent.yaml")], env
                    )
                _show_password(output, password_lines)
            wake.wait(0.5)
            wake.clear()
    finally:
        _show_password(output, password_lines)  # never lost, however early the stop came
        if not _stop_everything(supervisor, output, drain_grace, agent_state, keep_engines=keep_engines):
            exit_code = 1
    return exit_code


def _child_env(data_dir: Path, host: str, port: int) -> dict[str, str]:
    """The children's environment: this one, with the data directory and the address fixed, and
    unbuffered output so that their lines arrive as they write them."""
    env = dict(os.environ)
    env["LLMGW_DATA_DIR"] = str(data_dir)
    env["LLMGW_LISTEN"] = f"{host}:{port}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _say_exited(supervisor: Supervisor, output: Output, name: str, code: int) -> None:
    """A child exited on its own: say so on the terminal, with its last lines and where the rest are."""
    supervisor.finish_output(name)
    output.say(f"llmgw up: {name} exited with code {code}; stopping the rest", error=True)
    for line in output.tail(name):
        output.say(f"{name:<7}| {line}", error=True, log=False)
    if output.log_path is not None:
        output.say(f"llmgw up: its full output is in {output.log_path}", error=True)


def _say_started(output: Output, base_url: str, *, ready: bool) -> None:
    """The address to open once web answers, or that it did not answer in time."""
    if ready:
        output.say(f"llmgw up: ready at {base_url}/ (API {base_url}/api/v1/, admin {base_url}/django-admin/)")
    else:
        output.say(
            f"llmgw up: web does not answer at {base_url}/healthz after {READY_TIMEOUT_S:g} s; "
            f"see {output.log_path or 'its output above'}",
            error=True,
        )


def _stop_everything(
    supervisor: Supervisor, output: Output, drain_grace: int, agent_state: Path | None, *, keep_engines: bool
) -> bool:
    """Stop every child and the local agent's engines, in order, and close the output; False when
    the engines could not be stopped."""
    output.say("llmgw up: stopping")
    # The agent leaves first (its engines run on without it); web then finishes the requests in
    # flight, and only then are the engines that answer them stopped.
    supervisor.stop(["agent"])
    others = [name for name in supervisor.children if name != "agent"]
    supervisor.terminate(["web"], drain_grace + WEB_STOP_MARGIN_S)
    supervisor.terminate(others)
    if not supervisor.exited(["web"], WEB_QUIET_S):
        output.say(
            f"llmgw up: web is finishing the requests in flight (at most {drain_grace} s; Ctrl-C again stops at once)"
        )
    supervisor.reap(["web"])
    engines_stopped = agent_state is None or _stop_engines(output, agent_state, keep_engines=keep_engines)
    supervisor.reap(others)
    output.say("llmgw up: stopped")
    output.close()
    return engines_stopped


def _stop_engines(output: Output, agent_state: Path, *, keep_engines: bool) -> bool:
    """Stop the engines the local agent ran (or, with --keep-engines, say how many run on); False
    when that failed, which must not keep the other children from being stopped."""
    try:
        if keep_engines:
            count = _running_engines(agent_state)
            if count:
                output.say(
                    f"llmgw up: left {_plural(count, 'engine')} running (--keep-engines); the next llmgw up adopts them"
                )
        else:
            count = stop_local_engines(agent_state, output)
            if count:
                output.say(f"llmgw up: stopped {_plural(count, 'engine')}")
    except Exception as exc:  # the children must still be stopped
        output.say(f"llmgw up: could not stop the engines in {agent_state}: {exc!r}", error=True)
        return False
    return True
