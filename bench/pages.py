"""What the cluster and nodes pages cost on the server as the fleet grows.

    .venv/bin/python bench/pages.py [--nodes 10000] [--models 2000] [--repeat 3] [--sqlite]
                                    [--redis redis://127.0.0.1:6379/13]

A fresh PostgreSQL database (SQLite with --sqlite) is filled in steps of a quarter, a half and
all of the fleet with the captured 8 x H100 nodes of bench/metrics.py (each holding one 8-card
replica), every node heartbeating through the agent connections' own write (its row, its
history and the fleet rollup; in Redis with --redis, as a fleet of several web processes keeps
them, else in the local cache). At each step an operator's browser session asks for /cluster/ and /nodes/ (the whole
page and the part htmx refreshes) `--repeat` times through Django's test client, the same
request path as the server's; the baseline is the about page (/about), rendered in the same run.
The held idle replicas the cluster page lists are worked out by the worker every 15 s
(apps.cluster.overview.summarise_idle); that is timed on its own at each step.

Prints, per page and step: the median time, its ratio to the baseline, the queries it made, the
HTML it sent, and the time per node against the first step's (1.0: linear); the load average at
the start and the end; and each target as met, missed or not measured. Targets: both pages, whole
and their live parts, in at most 300 ms with 10,000 nodes (a smaller --nodes prints the figures but
does not measure the target), with a query count at the whole fleet no more than at the first step.
The captures are found as the tests find them ($LLMGW_FIXTURES_DIR, else ../shared/fixtures beside
the clone); without them the bench says so and measures nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.metrics import KERNEL_LOG, NVIDIA_SMI, Fleet, fresh_database  # noqa: E402
from bench.report import Report, fixture, fixture_roots  # noqa: E402

TARGET_MS = 300.0
FULL_NODES = 10_000

PAGES: tuple[tuple[str, str, dict[str, str]], ...] = (
    ("cluster", "/cluster/", {}),
    ("cluster live part", "/cluster/", {"HTTP_HX_REQUEST": "true"}),
    ("nodes", "/nodes/", {}),
    ("nodes live part", "/nodes/", {"HTTP_HX_REQUEST": "true"}),
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--models", type=int, default=2_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sqlite", action="store_true", help="the SQLite default instead of PostgreSQL")
    parser.add_argument("--redis", help="a Redis URL: histories and the rollup there, as with several web processes")
    parser.add_argument("--profile", action="store_true", help="print where the cluster page spent its time")
    args = parser.parse_args()
    with Report(__doc__) as report:
        missing = [f"{folder}/{name}" for folder, name in (NVIDIA_SMI, KERNEL_LOG) if fixture(folder, name) is None]
        if missing:
            roots = ", ".join(str(root) for root in fixture_roots())
            for name, _path, _headers in PAGES:
                report.not_measured(name, f"captures not found in {roots}: {', '.join(missing)}")
            return
        with fresh_database(sqlite=args.sqlite, name="pages", redis=args.redis):
            run(args, report)


def run(args: argparse.Namespace, report: Report) -> None:
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    settings.ALLOWED_HOSTS = ["*"]
    # Static files by their plain names: no collectstatic manifest in a fresh data folder.
    settings.STORAGES = {
        **settings.STORAGES,
        "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    }
    user = get_user_model().objects.create_superuser("bench@example.com", "bench-password-1")
    client = Client()
    client.force_login(user)

    def measure(path: str, headers: dict[str, str]) -> tuple[float, int, int]:
        times, queries, size = [], 0, 0
        for _ in range(args.repeat):
            with CaptureQueriesContext(connection) as captured:
                start = time.perf_counter()
                response = client.get(path, **headers)  # type: ignore[arg-type]
                times.append(time.perf_counter() - start)
            assert response.status_code == 200, (path, response.status_code)
            queries, size = len(captured), len(response.content)
        return statistics.median(times), queries, size

    from apps.cluster.overview import summarise_idle

    fleet = Fleet()
    steps = sorted({max(1, args.nodes // 4), max(1, args.nodes // 2), args.nodes})
    first: dict[str, float] = {}
    header = ("page", 20), ("nodes", 6), ("ms", 8), ("ratio", 7), ("queries", 8), ("KiB", 8)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'per node vs first':>18}")
    worst: dict[str, tuple[float, int]] = {}
    first_queries: dict[str, int] = {}
    for nodes in steps:
        fleet.grow(nodes, max(1, args.models * nodes // args.nodes))
        started = time.perf_counter()
        fleet.heartbeat()
        print(f"{'':>20} {nodes:>6} heartbeats written in {time.perf_counter() - started:.1f} s")
        # What the worker does every IDLE_SUMMARY_SECONDS, off the pages' path; timed here.
        summaries = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            summarise_idle(keep=True)
            summaries.append(time.perf_counter() - started)
        summary = statistics.median(summaries)
        print(f"{'held idle summary':>20} {nodes:>6} {summary * 1000:>8.0f}   (the worker's, every 15 s)")
        measure("/about", {})  # warm
        base, _queries, _size = measure("/about", {})
        for name, path, headers in PAGES:
            fleet.touch()
            summarise_idle(keep=True)  # as fresh as the worker keeps it
            took, queries, size = measure(path, headers)
            first.setdefault(name, took / nodes)
            first_queries.setdefault(name, queries)
            worst[name] = (took, queries)
            print(
                f"{name:>20} {nodes:>6} {took * 1000:>8.0f} {took / base:>7.1f} {queries:>8} {size / 1024:>8.0f} "
                f"{took / nodes / first[name]:>18.2f}"
            )
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(client.get, "/cluster/")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    for name, (took, queries) in worst.items():
        if args.nodes < FULL_NODES:
            report.not_measured(
                name, f"this run had {args.nodes} nodes ({took * 1000:.0f} ms); the target is for {FULL_NODES:,}"
            )
        else:
            report.target(name, measured=took * 1000, limit=TARGET_MS, unit=" ms")
        report.target(f"{name} queries", measured=queries, limit=first_queries[name])


if __name__ == "__main__":
    main()
