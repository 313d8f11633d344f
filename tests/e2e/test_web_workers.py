"""`llmgw web --workers 2`: two gateway processes share one replica's slots and one queue.

A mock engine (in a thread of the test) stands for a replica with 4 parallel slots and counts the
requests it holds at once; the two web processes find it in the database as any replica. However
the kernel spreads connections between the processes, the engine must never hold more than 4,
the queue must never hold more than LLMGW_GATEWAY_QUEUE_MAX from both together, and its timeout and
503s behave as with one process. Runs where the suite has PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.helpers import REPO, descendants, drop_pg_database, free_port, llmgw_env, pg_database_url
from tests.gateway.mock_engine import MockEngine

pytestmark = pytest.mark.e2e

SLOTS = 4
QUEUE_MAX = 3

SETUP = """
from apps.accounts.models import User
from apps.accounts.services import create_api_key
from apps.catalog.models import Model, Profile
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.cluster.models import Node, Replica, Shard
user = User.objects.create_user(email="ops@example.com", password="correct horse battery")
key = create_api_key(user, name="workers", actor=None)
node = Node.objects.create(name="n1", status=NodeStatus.READY, address="127.0.0.1")
model = Model.objects.create(name="m", min_replicas=1, max_replicas=1, source="/models/m.gguf")
profile = Profile.objects.create(model=model, name="cpu", engine="llama.cpp", accelerator="cpu",
                                 memory_bytes=1024**3, cpu_cores=1, parallel={slots})
replica = Replica.objects.create(model=model, profile=profile, state=ReplicaState.READY)
Shard.objects.create(replica=replica, node=node, port={port}, secret="s")
print("KEY=" + key.secret)
"""


class EngineThread:
    """The mock engine on its own event loop in a thread, so the test can stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.engine = MockEngine()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.call(self.engine.start)

    def call(self, coroutine: Callable[[], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine(), self.loop).result(timeout=30)

    def run(self, func: Callable[[], Any]) -> Any:
        async def inside() -> Any:
            return func()

        return self.call(inside)

    def close_gate(self) -> None:
        self.run(lambda: setattr(self.engine, "gate", asyncio.Event()))

    def open_gate(self) -> None:
        self.run(lambda: self.engine.gate.set() if self.engine.gate else None)

    def stop(self) -> None:
        self.open_gate()
        self.call(self.engine.stop)
        self.loop.call_soon_threadsafe(self.loop.stop)


@dataclass
class Answer:
    status: int
    body: dict[str, Any]


@dataclass
class Workers:
    url: str
    key: str
    engine: EngineThread

    def chat(self, timeout: float = 60) -> Answer:
        data = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
        request = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=data,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return Answer(response.status, json.load(response))
        except urllib.error.HTTPError as exc:
            return Answer(exc.code, json.loads(exc.read() or b"{}"))


def _wait_for(check: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    if not os.environ.get("LLMGW_REDIS_URL") or not os.environ.get("LLMGW_DATABASE_URL", "").startswith("postgres"):
        pytest.skip("several web processes share their counts through Redis; this run has no Redis")
    database = pg_database_url()
    assert database is not None
    engine = EngineThread()
    engine.run(lambda: setattr(engine.engine, "delay", 0.2))
    port = free_port()
    env = llmgw_env(
        tmp_path_factory.mktemp("workers"),
        port,
        LLMGW_DATABASE_URL=database,
        LLMGW_GATEWAY_QUEUE_MAX=str(QUEUE_MAX),
        LLMGW_GATEWAY_QUEUE_TIMEOUT="3",
        LLMGW_LOG_LEVEL="warning",
    )
    web: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, cwd=REPO, check=True, timeout=300
        )
        engine_port = int(engine.engine.url.rsplit(":", 1)[1])
        made = subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", "shell", "-c", SETUP.format(slots=SLOTS, port=engine_port)],
            env=env,
            cwd=REPO,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        key = next(line[4:] for line in made.stdout.splitlines() if line.startswith("KEY="))
        web = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "web", "--workers", "2"],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        running = Workers(f"http://127.0.0.1:{port}", key, engine)

        def serving() -> bool:
            assert web is not None and web.poll() is None, "llmgw web exited"
            try:
                return running.chat(timeout=10).status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        _wait_for(serving, "both web processes to serve")
        yield running
    finally:
        if web is not None:
            for pid in descendants(web.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            web.kill()
            web.wait(timeout=30)
        engine.stop()
        drop_pg_database(database)


def test_two_web_processes_never_put_more_requests_on_a_replica_than_its_slots(workers: Workers) -> None:
    workers.engine.run(lambda: setattr(workers.engine.engine, "max_active", 0))
    # As many clients at once as the slots and the queue hold together: none is refused.
    with ThreadPoolExecutor(max_workers=SLOTS + QUEUE_MAX) as pool:
        answers = list(pool.map(lambda _i: workers.chat(), range(42)))
    assert [a.status for a in answers] == [200] * 42, [a.body for a in answers if a.status != 200][:3]
    most = workers.engine.run(lambda: workers.engine.engine.max_active)
    assert 1 < most <= SLOTS


def test_the_queue_holds_its_maximum_across_both_processes_and_refuses_the_rest(workers: Workers) -> None:
    workers.engine.close_gate()  # every slot stays taken until the gate opens
    with ThreadPoolExecutor(max_workers=16) as pool:
        holding = [pool.submit(workers.chat) for _ in range(SLOTS)]
        _wait_for(lambda: workers.engine.run(lambda: workers.engine.engine.active) == SLOTS, "the slots to fill")
        queued = [pool.submit(workers.chat) for _ in range(QUEUE_MAX + 4)]
        # Those the queue cannot hold are refused at once, whichever process they reached.
        _wait_for(lambda: sum(f.done() for f in queued) >= 4, "the refusals beyond the queue", timeout=30)
        workers.engine.open_gate()
        results = [f.result() for f in holding + queued]
    refused = [a for a in results if a.status == 503]
    assert len(refused) == 4
    # With one key, the fair queue refuses the newest: the refusal names the queue's numbers.
    assert all(a.body["error"]["code"] == "queue_full" for a in refused), [a.body for a in refused]
    assert all(f"is full ({QUEUE_MAX} of {QUEUE_MAX} waiting" in a.body["error"]["message"] for a in refused), [
        a.body["error"]["message"] for a in refused
    ]
    assert sum(a.status == 200 for a in results) == SLOTS + QUEUE_MAX


def test_a_request_that_waits_past_the_queue_timeout_in_either_process_gets_503(workers: Workers) -> None:
    workers.engine.close_gate()
    try:
        with ThreadPoolExecutor(max_workers=8) as pool:
            holding = [pool.submit(workers.chat) for _ in range(SLOTS)]
            _wait_for(lambda: workers.engine.run(lambda: workers.engine.engine.active) == SLOTS, "the slots to fill")
            waiting = [pool.submit(workers.chat) for _ in range(2)]
            late = [f.result() for f in waiting]
            workers.engine.open_gate()
            assert all(f.result().status == 200 for f in holding)
    finally:
        workers.engine.open_gate()
    assert [a.status for a in late] == [503, 503]
    assert all("stayed busy for 3 s" in a.body["error"]["message"] for a in late)
    # Nothing was leaked: the replica serves again at once.
    assert workers.chat().status == 200
