"""What a Prometheus scrape of /metrics costs on a large fleet, and how the cost grows.

    .venv/bin/python bench/metrics.py [--nodes 2000] [--models 500] [--repeat 5] [--ports 8]

A fresh PostgreSQL database (SQLite with --sqlite) is filled in steps of a quarter, a half and
all of the fleet: 8-GPU nodes whose samples carry the cards of a captured H100 report
(nvidia-smi -q, with the XIDs of a captured kernel log), models with 8-card replicas filling
the nodes, each replica's engine figures as the agent sends them (from a captured SGLang
page), with --ports that many InfiniBand ports per node (copied from a captured DGX A100's
sysfs tree), and a capacity quota per team. At each step the database-read collectors are scraped
as /metrics serves them (llmgw.metrics.database_metrics)
`--repeat` times. The baseline is the least any scrape must do, measured in the same run: read
every node's row with its sample (one query, the documents decoded) and write as many series lines
as the scrape wrote, each with a node and a GPU label, by plain string formatting. The ratio is
the scrape's cost over that floor.

Prints, per step: series, the median scrape time, its ratio to the baseline, and the time per
node against the first step's (1.0 means the cost grows linearly), the load average at the start
and end, and the target as met or missed. Target: the whole fleet (2,000 nodes x 8 GPUs, 500
models) in at most 1 s. The captures are found as the tests find them ($LLMGW_FIXTURES_DIR, else
../shared/fixtures beside the clone); without them the bench says so and measures nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.report import Report, fixture, fixture_roots  # noqa: E402

NVIDIA_SMI = ("nvidia-smi-q", "h100-80gb-hbm3-x8-drv535.161-fabric-completed.txt")
KERNEL_LOG = ("xid", "xid48-dbe-xid63-rowremap-xid94-contained.log.txt")
SYSFS_TREE = ("sysfs-infiniband", "dgx-a100-cx6-ports-at-100-edr-instead-of-hdr.json.txt")
TARGET_S = 1.0
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--models", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--ports", type=int, default=0, help="InfiniBand ports per node (from a captured sysfs tree), 0 for none"
    )
    parser.add_argument("--sqlite", action="store_true", help="the SQLite default instead of PostgreSQL")
    parser.add_argument("--profile", action="store_true", help="print where the last scrape spent its time")
    args = parser.parse_args()
    with Report(__doc__) as report:
        needed = [NVIDIA_SMI, KERNEL_LOG] + ([SYSFS_TREE] if args.ports else [])
        missing = [f"{folder}/{name}" for folder, name in needed if fixture(folder, name) is None]
        if missing:
            roots = ", ".join(str(root) for root in fixture_roots())
            report.not_measured("scrape", f"captures not found in {roots}: {', '.join(missing)}")
            return
        with fresh_database(sqlite=args.sqlite, name="metrics"):
            took = run(args)
        report.target("scrape", measured=took, limit=TARGET_S, unit=" s")


@contextlib.contextmanager
def fresh_database(*, sqlite: bool, name: str, redis: str | None = None) -> Iterator[None]:
    """Django set up on an empty, migrated database of its own (PostgreSQL, dropped after; or SQLite),
    with Redis at `redis` (its keys under a prefix of their own) or none."""
    database = None
    os.environ["LLMGW_DATA_DIR"] = tempfile.mkdtemp(prefix=f"llmgw-bench-{name}-")
    os.environ["DJANGO_SETTINGS_MODULE"] = "llmgw.settings"
    os.environ.pop("LLMGW_REDIS_URL", None)
    if redis:
        os.environ["LLMGW_REDIS_URL"] = redis
        os.environ["LLMGW_REDIS_PREFIX"] = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    if not sqlite:
        import psycopg

        database = f"llmgw_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{database}"')
        os.environ["LLMGW_DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{database}"
    else:
        os.environ.pop("LLMGW_DATABASE_URL", None)
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        yield
    finally:
        if redis:  # the run's keys, under its own prefix
            import redis as redis_client

            client = redis_client.Redis.from_url(redis)
            for key in client.scan_iter(f"{os.environ['LLMGW_REDIS_PREFIX']}:*", count=1000):
                client.delete(key)
            client.close()
        if database is not None:
            from django.db import connections

            connections.close_all()
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


class Fleet:
    """Captured 8 x H100 nodes, each holding one 8-card SGLang replica of one of the models, grown
    in steps (`grow`): samples as the agent sends them (nvidia-smi -q with a captured kernel log's
    XIDs on card 0, InfiniBand ports from a captured sysfs tree, the engine's figures from a
    captured SGLang page), and a capacity quota for each of 20 teams."""

    def __init__(self, ports: int = 0) -> None:
        from agent.engine_metrics import normalise, parse_exposition
        from agent.probes.nvidia import parse_nvidia_smi_text
        from agent.probes.xid import count_xids, parse_xid_lines
        from agent.sampler import _gpu_dict
        from apps.accounts import services as accounts
        from apps.quotas.models import CapacityQuota

        report = parse_nvidia_smi_text(read(NVIDIA_SMI))
        self.cards = [_gpu_dict(gpu) for gpu in report.gpus]
        log = read(KERNEL_LOG)
        xids = next(iter(count_xids(parse_xid_lines(log)).values()))
        self.cards[0]["xids"] = {str(code): n for code, n in xids.items()}
        self.ports = ib_ports(ports)
        page = (REPO / "tests" / "agent" / "engine_metrics" / "sglang-docs.prom").read_text()
        self.figures = normalise("sglang", parse_exposition(page))
        org = accounts.create_organization(name="Bench", actor=None)
        self.teams = [accounts.create_team(org, name=f"Team {i}", actor=None) for i in range(20)]
        for team in self.teams:
            CapacityQuota.objects.create(team=team, gpus=800)
        self.nodes = self.models = 0

    def grow(self, nodes: int, models: int) -> None:
        """Up to `nodes` nodes and `models` models, every node heartbeating now."""
        from django.utils import timezone

        from apps.catalog.models import Model, Profile
        from apps.cluster.choices import NodeStatus, ReplicaState
        from apps.cluster.models import Gpu, Node, Replica, Shard

        now = timezone.now()
        new_nodes = [
            Node(
                name=f"bench-{i:05d}",
                status=NodeStatus.READY,
                agent_version="bench",
                registered_at=now,
                last_seen_at=now,
                sampled_at=now,
                hardware={"cpus": 224, "gpu_count": 8},
                sample={
                    "cpus": 224,
                    "cpu_utilization_pct": 31.5,
                    "memory_total_bytes": 2 << 40,
                    "gpus": self.cards,
                    **({"ib_ports": self.ports} if self.ports else {}),
                },
            )
            for i in range(self.nodes, nodes)
        ]
        Node.objects.bulk_create(new_nodes, batch_size=500)
        rows = list(Node.objects.filter(name__in=[n.name for n in new_nodes]).order_by("name"))
        Gpu.objects.bulk_create(
            [Gpu(node=n, index=i, gpu_class="H100-80GB", name="NVIDIA H100 80GB HBM3") for n in rows for i in range(8)],
            batch_size=2000,
        )
        for i in range(self.models, models):
            model = Model.objects.create(
                name=f"model-{i:04d}",
                min_replicas=1,
                max_replicas=8,
                source=f"/models/m{i}",
                team=self.teams[i % len(self.teams)],
            )
            Profile.objects.create(
                model=model, name="gpu", engine="sglang", accelerator="H100-80GB", gpus_per_shard=8, parallel=64
            )
        # Spread the new nodes over the models: each node holds one 8-card replica.
        live = list(Model.objects.order_by("name"))
        shards = []
        for j, node in enumerate(rows):
            model = live[(self.nodes + j) % len(live)]
            replica = Replica.objects.create(
                model=model, profile=model.profiles.first(), state=ReplicaState.READY, spec={"engine": "sglang"}
            )
            shards.append(Shard(replica=replica, node=node, rank=0, port=30000, secret="s", gpu_indices=list(range(8))))
            node.sample = {
                **node.sample,
                "shards": [{"shard": f"r{replica.pk}s0", "cpu_cores": 3.5, "engine": self.figures}],
            }
        Shard.objects.bulk_create(shards, batch_size=500)
        Node.objects.bulk_update(rows, ["sample"], batch_size=500)
        self.nodes, self.models = nodes, models
        self.touch()

    def heartbeat(self) -> None:
        """Every node heartbeats now through the connections' own write (apps.cluster.heartbeats):
        its row, its history and the fleet rollup, 500 nodes a batch as the writer sends them."""
        from django.utils import timezone

        from apps.cluster.heartbeats import _write
        from apps.cluster.models import Node

        now, taken = timezone.now(), time.time()
        batch = {}
        for pk, sample in Node.objects.values_list("pk", "sample").iterator(chunk_size=500):
            batch[pk] = ({**sample, "taken_at": taken}, now)
            if len(batch) == 500:
                _write(batch)
                batch = {}
        if batch:
            _write(batch)

    def touch(self) -> None:
        """Every node heartbeating now: a sample older than a minute is left out of what is shown."""
        from django.utils import timezone

        from apps.cluster.models import Node

        Node.objects.update(sampled_at=timezone.now(), last_seen_at=timezone.now())


def read(where: tuple[str, str]) -> str:
    path = fixture(*where)
    assert path is not None, where  # checked before the bench starts
    return path.read_text()


def run(args: argparse.Namespace) -> float:
    """The scrape's median time at the whole fleet, in seconds."""
    from llmgw.metrics import database_metrics

    fleet = Fleet(args.ports)

    def scrape() -> tuple[float, int]:
        times = []
        size = 0
        for _ in range(args.repeat):
            start = time.perf_counter()
            body = database_metrics()
            times.append(time.perf_counter() - start)
            size = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        return statistics.median(times), size

    def baseline(series: int) -> float:
        """Read every node's sample and write `series` lines: the floor under any scrape."""
        from apps.cluster.models import Node

        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            rows = list(Node.objects.values_list("name", "sample"))
            per_node = max(1, series // max(1, len(rows)))
            lines = [
                f'bench_series{{node="{name}",gpu="{i}"}} {len(sample or ())}\n'
                for name, sample in rows
                for i in range(per_node)
            ]
            "".join(lines).encode()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    steps = sorted({max(1, args.nodes // 4), max(1, args.nodes // 2), args.nodes})
    first_per_node = None
    header = ("nodes", 6), ("models", 6), ("series", 8), ("scrape ms", 10), ("baseline ms", 12), ("ratio", 6)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'per node vs first':>18}")
    for nodes in steps:
        models = max(1, args.models * nodes // args.nodes)
        fleet.grow(nodes, models)
        took, series = scrape()
        base = baseline(series)
        per_node = took / nodes
        first_per_node = first_per_node or per_node
        print(
            f"{nodes:>6} {models:>6} {series:>8} {took * 1000:>10.0f} {base * 1000:>12.0f} "
            f"{took / base:>6.1f} {per_node / first_per_node:>18.2f}"
        )
    if args.profile:
        from apps.cluster.metrics import scrape_nodes
        from llmgw.metrics import _factories

        # Each collector alone (outside a scrape, each reads the nodes itself), then the profile.
        for factory in [scrape_nodes, *_factories]:
            start = time.perf_counter()
            collector = factory()
            for method in ("text", "collect"):
                if hasattr(collector, method):
                    list(getattr(collector, method)())
            print(f"{getattr(factory, '__name__', factory)}: {(time.perf_counter() - start) * 1000:.0f} ms")
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.runcall(database_metrics)
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    return took


def ib_ports(count: int) -> list[dict]:
    """`count` ports as the agent sends them, copied from the ports of a captured DGX A100 sysfs tree."""
    if count <= 0:
        return []
    import json

    from agent.fabrics import FabricWatcher
    from agent.probes.infiniband import read_ports
    from agent.probes.sysfs import SysfsReader

    tree = json.loads(read(SYSFS_TREE))
    watcher = FabricWatcher("/nonexistent", [], runner=None)  # type: ignore[arg-type]
    captured = [watcher._port_dict(port) for port in read_ports(SysfsReader(tree)).ports]
    return [{**captured[i % len(captured)], "device": f"mlx5_{i}", "port": 1} for i in range(count)]


if __name__ == "__main__":
    main()
