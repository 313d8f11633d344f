"""Helpers for tests that start llmgw processes for real."""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import processes

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def descendants(pid: int) -> set[int]:
    """Every live process below pid, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Running:
    process: subprocess.Popen[str]
    url: str
    env: dict[str, str]
    database: str | None = None
    lines: list[str] = field(default_factory=list)

    def wait_for_line(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            while seen < len(self.lines):
                match = re.search(pattern, self.lines[seen])
                seen += 1
                if match:
                    return match
            if self.process.poll() is not None and seen >= len(self.lines):
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}; output:\n" + "".join(self.lines[-80:]))


def pg_database_url(*, empty: bool = False) -> str | None:
    """A fresh PostgreSQL database for one llmgw process when the suite runs on PostgreSQL: a copy
    of a migrated template (tests' processes then find nothing to migrate; every table, data
    migration and sequence is as `migrate` leaves it, since `migrate` made the template), or with
    `empty` one with no table at all (for a test whose own role must own what migrate creates)."""
    base = os.environ.get("LLMGW_DATABASE_URL", "")
    if not base.startswith("postgres"):
        return None
    import psycopg

    parts = urllib.parse.urlsplit(base)
    name = f"llmgw_e2e_{uuid.uuid4().hex[:10]}"
    admin = parts._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    template = "template1" if empty else _migrated_template(parts, admin)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return parts._replace(path=f"/{name}").geturl()


#: The migrated template of this test process, once made.
_TEMPLATE: dict[str, str] = {}


def _migrations_digest() -> str:
    """What the migrations are: their files' names and contents, so a changed one makes a new template."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(REPO.glob("apps/*/migrations/*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _migrated_template(parts: urllib.parse.SplitResult, admin: str) -> str:
    """A database migrated once per test process and used only as a template (never connected to
    after `migrate`, which PostgreSQL requires of a template). Its own per process: two streams of
    the suite never copy a template the other is still migrating."""
    if "name" in _TEMPLATE:
        return _TEMPLATE["name"]
    import psycopg

    name = f"llmgw_tpl_{_migrations_digest()}_{os.getpid()}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = parts._replace(path=f"/{name}").geturl()
    _migrate(Path(os.environ.get("TMPDIR", "/tmp")) / f"{name}-data", LLMGW_DATABASE_URL=url)
    _TEMPLATE["name"] = name
    import atexit

    atexit.register(drop_pg_database, url)
    return name


def _migrate(data_dir: Path, **settings: str) -> None:
    """`llmgw manage migrate` in a process of its own, with none of the test's LLMGW_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "DJANGO_"))}
    env.update(LLMGW_DATA_DIR=str(data_dir), **settings)
    subprocess.run(
        [sys.executable, "-m", "llmgw", "manage", "migrate", "-v0"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=600,
        stdout=subprocess.DEVNULL,
    )


def _sqlite_template() -> Path:
    """A SQLite database migrated once per test process, copied into the data directory of each
    `llmgw up` a test starts on the SQLite default: its `migrate` then finds nothing to apply (2 of
    the 4 s of CPU it spends on an empty database). A first migration on SQLite is still walked by
    the tests that run `llmgw manage migrate` themselves, as an operator would (test_beat,
    test_web_alone, test_worker_restart and others)."""
    if "sqlite" in _TEMPLATE:
        return Path(_TEMPLATE["sqlite"])
    import sqlite3
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="llmgw-sqlite-template-"))
    import atexit

    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    _migrate(folder / "data")
    # Through SQLite's backup, so that nothing still in a write-ahead log is left behind.
    template = folder / "llmgw.sqlite3"
    source, copy = sqlite3.connect(folder / "data" / "llmgw.sqlite3"), sqlite3.connect(template)
    with contextlib.closing(source), contextlib.closing(copy):
        source.backup(copy)
    _TEMPLATE["sqlite"] = str(template)
    return template


def drop_pg_database(url: str) -> None:
    import psycopg

    parts = urllib.parse.urlsplit(url)
    name = parts.path.lstrip("/")
    admin = parts._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


#: PostgreSQL connections each web process a test starts may hold, and the threads a worker
#: process's batch runner queries from (LLMGW_DATABASE_POOL_SIZE; 10 in production; the worker and
#: beat keep no pool). A test's processes serve one test's requests, so a few each are plenty, and
#: the suite stays well inside PostgreSQL's max_connections (README: the suite's connection budget).
TEST_POOL_SIZE = 3


def llmgw_env(data_dir: Path, port: int, **extra: str) -> dict[str, str]:
    """The environment of an llmgw process a test starts: none of the test's own LLMGW_* settings,
    its data directory and address, a small database pool (TEST_POOL_SIZE), and the marks by which
    what it starts is found again (tests/processes.py: this session's, and the data directory's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMGW_", "DJANGO_", "PROMETHEUS_"))}
    env.update({"LLMGW_DATA_DIR": str(data_dir), "LLMGW_LISTEN": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"})
    env["LLMGW_DATABASE_POOL_SIZE"] = str(TEST_POOL_SIZE)
    env["LLMGW_STATIC_ROOT"] = str(_static_root())
    env[processes.OWNER_MARK] = processes.owner(data_dir)
    # Engine releases come from a server of the test's own, or from nowhere: never GitHub; and a
    # local agent without an engine never compiles one from a real package index.
    env["LLMGW_ENGINE_RELEASES_API"] = "http://127.0.0.1:9"
    env["PIP_INDEX_URL"] = "http://127.0.0.1:9/simple"
    if os.environ.get("LLMGW_REDIS_URL"):
        env["LLMGW_REDIS_URL"] = os.environ["LLMGW_REDIS_URL"]
        env["LLMGW_REDIS_PREFIX"] = f"llmgw-e2e-{uuid.uuid4().hex[:8]}"
    env.update(extra)
    return env


def _static_root() -> Path:
    """One folder of collected static files for every llmgw this test process starts: the first
    `llmgw up` collects them, the others find them current (llmgw.cli.up.collect_static), where
    each data directory of its own cost 3-4 s of CPU to hash and compress them again."""
    if "path" not in _STATIC:
        import atexit
        import shutil
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="llmgw-static-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _STATIC["path"] = path
    return _STATIC["path"]


_STATIC: dict[str, Path] = {}


@contextmanager
def llmgw_up(
    tmp_path: Path,
    *args: str,
    data_dir: Path | None = None,
    database: str | None = None,
    keep_database: bool = False,
    **extra_env: str,
) -> Iterator[Running]:
    """Start `llmgw up` for real (PostgreSQL and Redis when the suite runs on them).

    Pass the data_dir and database of an earlier run to start again on the same state.
    """
    port = free_port()
    owned = database is None
    database = database or pg_database_url()
    data = data_dir or tmp_path / "data"
    if not database and "LLMGW_DATABASE_URL" not in extra_env and not (data / "llmgw.sqlite3").exists():
        data.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_sqlite_template(), data / "llmgw.sqlite3")
    env = llmgw_env(data, port, **({"LLMGW_DATABASE_URL": database} if database else {}), **extra_env)
    process = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "up", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    running = Running(process=process, url=f"http://127.0.0.1:{port}", env=env, database=database)

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            running.lines.append(line)

    threading.Thread(target=pump, daemon=True).start()
    try:
        yield running
    finally:
        if process.poll() is None:
            for pid in descendants(process.pid):
                with suppress(ProcessLookupError):
                    os.kill(pid, 9)
            process.kill()
        process.wait(timeout=30)
        # Engines live in sessions of their own and outlive a killed agent: whatever this data
        # directory's processes started goes too, unless --keep-engines left it for the next `up`.
        if "--keep-engines" not in args:
            processes.kill_marked(processes.OWNER_MARK, env[processes.OWNER_MARK])
        if database and owned and not keep_database:
            drop_pg_database(database)


class Browser:
    """Just enough of a browser: cookies, forms with CSRF tokens, redirects."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(self.base + path, headers=headers or {})
        try:
            with self.opener.open(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post_form(self, path: str, fields: dict[str, Any]) -> tuple[int, str]:
        status, page = self.get(path)
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page)
        assert token, f"no CSRF token on {path} ({status})"
        data = urllib.parse.urlencode({**fields, "csrfmiddlewaretoken": token.group(1)}).encode()
        request = urllib.request.Request(self.base + path, data=data, headers={"Referer": self.base + path})
        try:
            with self.opener.open(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
