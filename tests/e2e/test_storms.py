"""Storms of agents against a real `llmgw web` on PostgreSQL and Redis: a thousand connecting at once,
every one of them replaced at once, and all of them dropping at once.

What must hold: no error in the web process, every agent registered and in its node's group,
every agent getting its pushes (a desired-state push to every node reaches every connection),
every replaced connection told so, and the groups left with one live member per node. Runs where
the suite has PostgreSQL and Redis (one web process holds every agent, as in the reported storms).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent import protocol
from tests.e2e.helpers import REPO, descendants, drop_pg_database, free_port, llmgw_env, pg_database_url

pytestmark = pytest.mark.e2e

AGENTS = int(os.environ.get("LLMGW_TEST_STORM_AGENTS", "600"))

MAKE_NODES = """
import secrets, hashlib
from apps.cluster.models import Node
creds = ["llmgwn_" + secrets.token_urlsafe(32) for _ in range({count})]
Node.objects.bulk_create([Node(name=f"storm-{{i:05d}}", credential_hash=hashlib.sha256(c.encode()).hexdigest())
                          for i, c in enumerate(creds)], batch_size=500)
print("\\n".join(creds))
"""

PUSH_ALL = """
from apps.cluster.reconciler import push_desired_state
push_desired_state()
"""

GROUP_SIZES = """
import redis
from django.conf import settings
from apps.cluster.models import Node
from apps.cluster.actions import node_group
from channels.layers import get_channel_layer
layer = get_channel_layer()
client = redis.Redis.from_url(settings.REDIS_URL)
sizes = [client.zcard(layer._group_key(node_group(pk))) for pk in Node.objects.values_list("pk", flat=True)]
print(min(sizes), max(sizes))
"""

REGISTER = protocol.encode(
    "register",
    {
        "agent_version": "0.1.0",
        "features": ["heartbeat.v1"],
        "hardware": {"hostname": "storm", "cpus": 8, "memory_total_bytes": 8 * 1024**3, "gpus": []},
    },
)


@dataclass
class Web:
    url: str
    env: dict[str, str]
    log: Path
    credentials: list[str]

    def shell(self, code: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", "shell", "-c", code],
            env=self.env,
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    if not os.environ.get("LLMGW_REDIS_URL") or not os.environ.get("LLMGW_DATABASE_URL", "").startswith("postgres"):
        pytest.skip("the storms are of many processes' channel layer, on Redis; this run has none")
    database = pg_database_url()
    assert database is not None
    tmp = tmp_path_factory.mktemp("storm")
    port = free_port()
    env = llmgw_env(tmp / "data", port, LLMGW_DATABASE_URL=database, LLMGW_LOG_LEVEL="warning")
    log = tmp / "web.log"
    process = None
    try:
        subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, cwd=REPO, check=True, timeout=300
        )
        running = Web(f"ws://127.0.0.1:{port}/ws/agent/", env, log, [])
        running.credentials = [
            word for word in running.shell(MAKE_NODES.format(count=AGENTS)).split() if word.startswith("llmgwn_")
        ]
        with log.open("wb") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "llmgw", "web"],
                env=env,
                cwd=REPO,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        import urllib.request

        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        yield running
    finally:
        if process is not None:
            for pid in descendants(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            process.kill()
            process.wait(timeout=30)
        drop_pg_database(database)


class Agent:
    """One simulated agent: registers, then keeps what the server sends it."""

    def __init__(self, credential: str) -> None:
        self.credential = credential
        self.received: list[dict[str, object]] = []
        self.close_code: int | None = None
        self.registered = asyncio.Event()
        self.ws: object = None

    async def run(self, url: str, stop: asyncio.Event) -> None:
        from websockets.asyncio.client import connect

        async with connect(
            url,
            additional_headers={"Authorization": f"Bearer {self.credential}"},
            proxy=None,
            open_timeout=120,
            ping_interval=None,
            compression=None,
        ) as ws:
            self.ws = ws
            await ws.send(REGISTER)
            reader = asyncio.create_task(self._read(ws))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait({reader, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not reader.done():
                reader.cancel()
            self.close_code = ws.close_code

    async def _read(self, ws: object) -> None:
        async for raw in ws:  # type: ignore[attr-defined]
            message = json.loads(raw)
            self.received.append(message)
            if message.get("type") == "registered":
                self.registered.set()

    def count(self, kind: str) -> int:
        return sum(1 for m in self.received if m.get("type") == kind)


async def _connect_all(web: Web, stop: asyncio.Event) -> tuple[list[Agent], list[asyncio.Task[None]]]:
    agents = [Agent(c) for c in web.credentials]
    tasks = [asyncio.create_task(agent.run(web.url, stop)) for agent in agents]  # all at once: a storm
    async with asyncio.timeout(240):
        done = asyncio.gather(*(agent.registered.wait() for agent in agents))
        while not done.done():
            await asyncio.sleep(1)
            failed = [t for t in tasks if t.done()]
            if failed:
                raise AssertionError([t.exception() for t in failed][:3])
    return agents, tasks


def _errors(log: Path) -> list[str]:
    text = log.read_text(errors="replace")
    return [
        line
        for line in text.splitlines()
        if "Traceback" in line or "ERROR" in line or "MaxConnectionsError" in line or "Too many connections" in line
    ]


def test_a_storm_of_agents_connecting_replacing_and_dropping_at_once_loses_nothing(web: Web) -> None:
    async def storm() -> dict[str, object]:
        stop_first, stop_second = asyncio.Event(), asyncio.Event()
        first, first_tasks = await _connect_all(web, stop_first)
        desired_before = [agent.count("desired") for agent in first]
        await asyncio.to_thread(web.shell, PUSH_ALL)  # the periodic push to every node
        async with asyncio.timeout(120):
            while any(a.count("desired") <= before for a, before in zip(first, desired_before, strict=True)):
                await asyncio.sleep(0.2)
        # Every node reconnects at once, as after a network blip: each old connection must be told.
        second, second_tasks = await _connect_all(web, stop_second)
        async with asyncio.timeout(120):
            await asyncio.gather(*first_tasks, return_exceptions=True)
        replaced = sum(1 for a in first if a.close_code == protocol.CLOSE_REPLACED)
        # The new connections get the next push, every one of them.
        before = [agent.count("desired") for agent in second]
        await asyncio.to_thread(web.shell, PUSH_ALL)
        async with asyncio.timeout(120):
            while any(a.count("desired") <= b for a, b in zip(second, before, strict=True)):
                await asyncio.sleep(0.2)
        sizes = (await asyncio.to_thread(web.shell, GROUP_SIZES)).strip().splitlines()[-1].split()
        # And they all drop at once.
        stop_second.set()
        await asyncio.gather(*second_tasks, return_exceptions=True)
        return {"replaced": replaced, "groups": sizes}

    result = asyncio.run(storm())
    print(f"storm of {AGENTS} agents: {result}")
    assert result["replaced"] == AGENTS
    assert result["groups"] == ["1", "1"]  # one live member in every node's group
    time.sleep(3)  # the disconnects are handled
    assert _errors(web.log) == []
