"""A burst of 200 concurrent API and console requests against `llmgw web --workers 2`, a worker and
beat whose PostgreSQL role may open at most 40 connections (a share of a server's
`max_connections` 100 that other services use too): every request is answered, none with a 5xx,
the processes together never hold more connections than their pools (web) and threads (worker,
beat) allow, and they give them back once idle. Before the pools, one web process kept a
connection per thread it ever ran (97 after three waves of 50) and the burst ended in `too many
clients`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO, Browser, drop_pg_database, free_port, llmgw_env, pg_database_url
from tests.e2e.production import SETUP, Service, wait_for

pytestmark = [pytest.mark.e2e]

if not os.environ.get("LLMGW_DATABASE_URL", "").startswith("postgres"):
    pytest.skip("connection pools are PostgreSQL's (LLMGW_DATABASE_URL names none)", allow_module_level=True)

ROLE_LIMIT = 40
POOL = 6  # LLMGW_DATABASE_POOL_SIZE: per process
BURST = 200


def admin_sql(database: str, *statements: str) -> list[tuple[object, ...]]:
    import psycopg

    parts = urllib.parse.urlsplit(database)
    admin = parts._replace(path="/postgres").geturl().replace("postgres://", "postgresql://", 1)
    rows: list[tuple[object, ...]] = []
    with psycopg.connect(admin, autocommit=True) as conn:
        for statement in statements:
            cursor = conn.execute(statement)
            if cursor.description:
                rows = list(cursor.fetchall())
    return rows


def held(database: str, role: str) -> int:
    rows = admin_sql(database, f"SELECT count(*) FROM pg_stat_activity WHERE usename = '{role}'")
    return int(rows[0][0])  # type: ignore[call-overload]


def test_a_burst_of_requests_is_served_within_the_connection_budget(tmp_path: Path) -> None:
    database = pg_database_url(empty=True)  # its tables are made by (and belong to) the role below
    assert database is not None
    role = f"llmgw_burst_{uuid.uuid4().hex[:8]}"
    name = urllib.parse.urlsplit(database).path.lstrip("/")
    admin_sql(
        database,
        f'CREATE ROLE "{role}" LOGIN CONNECTION LIMIT {ROLE_LIMIT}',
        f'ALTER DATABASE "{name}" OWNER TO "{role}"',
    )
    parts = urllib.parse.urlsplit(database)
    as_role = parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port or 5432}").geturl()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = llmgw_env(tmp_path / "data", port, LLMGW_DATABASE_URL=as_role, LLMGW_DATABASE_POOL_SIZE=str(POOL))
    python = [sys.executable, "-m", "llmgw"]
    services: list[Service] = []
    peak = 0
    try:
        for step in (["migrate", "-v0"], ["collectstatic", "--noinput", "-v0"]):
            subprocess.run([*python, "manage", *step], cwd=REPO, env=env, check=True, timeout=300)
        made = subprocess.run(
            [*python, "manage", "shell", "-c", SETUP.format(node="n1")],
            cwd=REPO,
            env=env,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        ).stdout
        key = next(line.split("=", 1)[1] for line in made.splitlines() if line.startswith("KEY="))
        services = [
            Service("web", [*python, "web", "--workers", "2"], env, tmp_path / "web.log"),
            Service("worker", [*python, "worker", "--concurrency", "2"], env, tmp_path / "worker.log"),
            Service("beat", [*python, "beat"], env, tmp_path / "beat.log"),
        ]
        for service in services:
            service.start()

        def ready() -> bool:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=5) as answer:  # noqa: S310
                    return answer.status == 200
            except OSError:
                return False

        wait_for(ready, "the web processes", timeout=120, details=lambda: services[0].log())
        browser = Browser(url)
        status, _page = browser.post_form(
            "/login/", {"username": "ops@example.com", "password": "correct horse battery"}
        )
        assert status == 200
        cookie = "; ".join(f"{c.name}={c.value}" for c in browser.jar)

        paths = ["/api/v1/models", "/api/v1/nodes", "/api/v1/keys", "/api/v1/usage", "/", "/cluster/", "/usage/"]
        statuses: list[int] = []
        failures: list[str] = []
        start = threading.Barrier(BURST)

        def one(index: int) -> None:
            path = paths[index % len(paths)]
            headers = {"Authorization": f"Bearer {key}"} if path.startswith("/api/") else {"Cookie": cookie}
            start.wait()
            try:
                with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers), timeout=120) as r:
                    statuses.append(r.status)
            except urllib.error.HTTPError as exc:
                statuses.append(exc.code)
                failures.append(f"{path}: {exc.code} {exc.read()[:300]!r}")
            except OSError as exc:
                statuses.append(0)
                failures.append(f"{path}: {exc}")

        stop = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, held(database, role))
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        threads = [threading.Thread(target=one, args=(n,)) for n in range(BURST)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        # Another client of the same PostgreSQL is not starved meanwhile: it connects and reads.
        assert admin_sql(database, "SELECT 1") == [(1,)]
        stop.set()
        watcher.join(5)
        assert len(statuses) == BURST
        assert failures == [], "\n".join(failures[:20])
        # Two web processes with a pool each; the worker's two children without one (a connection per
        # thread while it queries: at most POOL for the batch runner, one for tasks, one for usage
        # writes), its parent and beat one each (docs/install.md).
        budget = 2 * POOL + 2 * (POOL + 2) + 1 + 1
        assert peak <= min(ROLE_LIMIT, budget), peak
        # Idle connections go back: the pools keep none open past their idle time (60 s) and the
        # web processes' are returned at the end of each request.
        answer = json.loads(urllib.request.urlopen(url + "/readyz", timeout=10).read())  # noqa: S310
        assert answer["database"] == "ok"
    finally:
        for service in services:
            service.stop(grace=10)
        drop_pg_database(database)
        admin_sql(database, f'DROP ROLE IF EXISTS "{role}"')
    print(f"\nburst of {BURST}: peak {peak} connections of role limit {ROLE_LIMIT}")
