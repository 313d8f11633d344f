"""Shared fixtures: people with each role, API clients, and a temporary data directory."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from django.utils import translation

from apps.accounts import services
from apps.accounts.choices import StaffRole
from apps.accounts.models import User

BACKEND = os.environ.get("LLMGW_TEST_BACKEND", "")
#: Set by scripts/test for its SQLite run after a PostgreSQL one: the tests that use neither the
#: database nor the web stack (the agent's own, placement's, the mirror's file readers, the fabric
#: map's parser and placement plugins, guardrails' rules, the gateway on its in-memory tables) ran
#: in the first and are not run a second time.
SKIP_BACKEND_FREE = os.environ.get("LLMGW_TEST_SKIP_BACKEND_FREE") == "1"
#: Files (and folders, ending in /) the SQLite run leaves to the PostgreSQL one although they use a
#: database: what they check does not depend on which (the API's shapes against its schema; the
#: agent installing engines and fetching models, where the control plane only relays; fleets of
#: agents on InfiniBand hosts, whose database side the fabric map's end-to-end test and the
#: fabrics' own tests cover on both; the editor CLIs and the browser, which see only HTTP).
SECOND_RUN_SKIPS = (
    "llmgw/test_api_schema.py",
    # Static files collected under hashed names, and the pages that load them by those names: each
    # collects ~900 files (3-4 s of CPU), and none of it touches the database.
    "llmgw/test_collect_static.py",
    "gateway/test_chat_math.py",
    # Bodies bounded before anything reads them, by a web process the tests start and talk to over a
    # socket: nothing of it reaches the database (16 s of CPU a run).
    "llmgw/test_body_limits.py",
    # The simulator works on its scenario in memory; its agreement with the reconciler's decisions
    # goes through the ORM alike on both (15 s). Its pages and runs (sim/test_pages.py) run on both.
    "sim/test_sim.py",
    "e2e/test_engine_install.py",
    "e2e/test_python_engine_install.py",
    "e2e/test_mirror.py",
    "e2e/test_editor_clients.py",
    "e2e/test_fabrics.py",
    "e2e/test_fabric_test.py",
    "e2e/test_fabric_map.py",
    "e2e/test_nvlink.py",
    "e2e/test_slices_fleet.py",  # MIG and AMD hosts: placement and the engines' devices, as the NVLink fleet
    "e2e/test_facility.py",
    "e2e/test_facility_power.py",
    # GPU time on a captured fleet: counted by the same code the SQLite run's test_models checks.
    "e2e/test_gpu_time.py",
    # What the reconciler decides (scaling, rolling, revoking) does not depend on the database; the
    # single-machine default on SQLite is walked by test_up*, test_models, test_nodes and the rest.
    "e2e/test_scaling.py",
    "e2e/test_rolling.py",
    "e2e/test_revoke.py",
    # How `llmgw up` stops its engines and what it prints do not depend on the database either; it
    # starts and serves on SQLite in test_up and test_models.
    "e2e/test_up_stop.py",
    "e2e/test_up_terminal.py",
    "e2e/test_onboarding.py",
    "browser/",
    "deploy/",  # Prometheus and promtool against llmgw's metrics: the same on either database
)
_LEFTOVERS = pytest.StashKey[list[Any]]()


def pytest_configure(config: Any) -> None:
    from tests import processes

    # Every process a test starts carries this session's mark, whatever it starts in turn.
    processes.mark_this_run()
    from tests import cpu

    cpu.install(config)
    from tests import after_flush

    after_flush.install()
    if BACKEND == "postgres":
        from tests import pgflush

        pgflush.install()


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """A test that starts a process stops it: what still runs with this session's mark now was left
    behind (an engine outliving its agent, a server no fixture stopped). It is killed here, so that
    it holds no port, memory or database connection after the suite, and named in the summary."""
    from multiprocessing import resource_tracker

    from tests import processes

    # A process pool (the guardrails' workers, in tests that run the gateway in this process)
    # starts multiprocessing's resource tracker, which lives as long as this process: stopped here,
    # it is not a leftover.
    with contextlib.suppress(Exception):
        resource_tracker._resource_tracker._stop()
    left = processes.leftovers()
    for process in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process.pid, signal.SIGKILL)
    session.config.stash[_LEFTOVERS] = left


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    left = config.stash.get(_LEFTOVERS, [])
    if left:
        terminalreporter.section("processes the tests left running (killed now)", yellow=True, bold=True)
        for process in left:
            terminalreporter.line(f"pid {process.pid}: {process.command}")


_DATABASE_FIXTURES = frozenset(
    {"db", "transactional_db", "live_server", "django_db_reset_sequences", "django_db_serialized_rollback"}
)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    # Every test hypothesis drives is a property test: `make properties` runs them at full count.
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.properties)
    if not SKIP_BACKEND_FREE:
        return
    here = os.path.dirname(__file__)
    free_dirs = ("agent", "placement", "mirror", "fabrics", "guardrails", "gateway")
    backend_free_dirs = tuple(os.path.join(here, name) + os.sep for name in free_dirs)
    second_run_files = {os.path.join(here, *name.split("/")) for name in SECOND_RUN_SKIPS if not name.endswith("/")}
    second_run_dirs = tuple(
        os.path.join(here, name.rstrip("/")) + os.sep for name in SECOND_RUN_SKIPS if name.endswith("/")
    )
    keep: list[Any] = []
    backend_free: list[Any] = []
    for item in items:
        path = str(item.path)
        fixtures = set(getattr(item, "fixturenames", ()))
        uses_database = bool(_DATABASE_FIXTURES & fixtures) or item.get_closest_marker("django_db") is not None
        free = path.startswith(backend_free_dirs) and not uses_database
        skipped = path in second_run_files or path.startswith(second_run_dirs)
        (backend_free if free or skipped else keep).append(item)
    if backend_free:
        config.hook.pytest_deselected(items=backend_free)
        items[:] = keep


#: A port nothing listens on: engine releases are read from here unless a test serves them.
CLOSED_RELEASES_API = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _plain_static_storage(settings: Any) -> None:
    # Content-hashed static files need collectstatic; pages in tests use plain names.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # Nothing in the suite reaches GitHub: a test that reads releases starts a server of its own.
    settings.ENGINE_RELEASES_API = CLOSED_RELEASES_API
    settings.HF_ENDPOINT = CLOSED_RELEASES_API  # nor the Hub: the mirror's tests run a Hub of their own


def forget_fleet_figures(*, history: bool = True) -> None:
    """Drop the fleet rollup (and, with `history`, the nodes' and models' histories and the rest of
    the cache) wherever they are kept: the local cache, or Redis."""
    from django.conf import settings
    from django.core.cache import cache

    from apps.cluster import history as cluster_history

    patterns = ["cluster:rollup:*"]
    if history:
        cache.clear()
        patterns += ["cluster:history:*", "cluster:engine-history:*"]
    else:
        from django.core.cache import caches
        from django.core.cache.backends.locmem import LocMemCache

        local = caches["default"]
        if isinstance(local, LocMemCache):  # its own keys read ":version:key"
            local.delete_many([key.split(":", 2)[2] for key in list(local._cache) if ":cluster:rollup:" in key])
    client = cluster_history.client()
    if client is not None:
        for pattern in patterns:
            for key in client.scan_iter(f"{settings.REDIS_PREFIX}:{pattern}"):
                client.delete(key)


@pytest.fixture(autouse=True)
def _empty_cache() -> Iterator[None]:
    # Row ids repeat between tests, so anything cached by id must not outlive its test.
    forget_fleet_figures()
    yield


@pytest.fixture(autouse=True)
def _english_after() -> Iterator[None]:
    # A page asked for in Turkish leaves Turkish active in this thread (the locale middleware
    # activates a language and nothing deactivates it): the next test starts in English.
    yield
    translation.deactivate()


def make_user(email: str, *, role: str = StaffRole.NONE, password: str = "correct horse battery", **extra: Any) -> User:
    if role == StaffRole.ADMIN:
        return User.objects.create_superuser(email, password, **extra)
    return User.objects.create_user(email, password, staff_role=role, **extra)


@pytest.fixture
def alice(db: Any) -> User:
    """An administrator."""
    return make_user("alice@example.com", role=StaffRole.ADMIN, name="Alice")


@pytest.fixture
def bob(db: Any) -> User:
    """A person with no staff role."""
    return make_user("bob@example.com", name="Bob")


@pytest.fixture
def charlie(db: Any) -> User:
    """Another person with no staff role: an outsider to Bob's things."""
    return make_user("charlie@example.com", name="Charlie")


@pytest.fixture
def viola(db: Any) -> User:
    """A viewer."""
    return make_user("viola@example.com", role=StaffRole.VIEWER, name="Viola")


@pytest.fixture
def key_for() -> Any:
    def make(user: User, **kwargs: Any) -> str:
        return services.create_api_key(user, name=kwargs.pop("name", "test"), actor=user, **kwargs).secret

    return make


@pytest.fixture
def api() -> Iterator[Any]:
    from rest_framework.test import APIClient

    yield APIClient()
