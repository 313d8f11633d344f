"""Guardrails across two web processes (`llmgw web --workers 2`, and a worker), with the official
OpenAI SDK.

A policy set through the REST API (which one process answers) is applied by both within seconds; a
guard model llmgw serves (a mock engine in a thread of the test, as a replica in the database)
judges prompts and answers; a client that leaves while the guard judges its prompt cancels the
guard's request and is recorded as gone; `llmgw ctl request` (a process of its own) tells the same
verdict as the answer did. Runs where the suite has PostgreSQL and Redis.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import openai
import psycopg
import pytest

from tests.e2e.helpers import REPO, descendants, drop_pg_database, free_port, llmgw_env, pg_database_url
from tests.e2e.test_web_workers import EngineThread

pytestmark = pytest.mark.e2e

CARD = "4111 1111 1111 1111"

SETUP = """
from apps.accounts.services import create_api_key
from apps.accounts.models import User
from apps.catalog.models import Model, Profile
from apps.cluster.choices import NodeStatus, ReplicaState
from apps.cluster.models import Node, Replica, Shard
admin = User.objects.create_superuser("ada@example.com", "correct horse battery")
key = create_api_key(admin, name="e2e", actor=None)
for name in ("m", "llama-guard"):  # a node each: one engine (the mock) answers for both
    node = Node.objects.create(name=f"node-{{name}}", status=NodeStatus.READY, address="127.0.0.1")
    model = Model.objects.create(name=name, min_replicas=1, max_replicas=1, source=f"/models/{{name}}.gguf")
    profile = Profile.objects.create(model=model, name="cpu", engine="llama.cpp", accelerator="cpu",
                                     memory_bytes=1024**3, cpu_cores=1, parallel=4)
    replica = Replica.objects.create(model=model, profile=profile, state=ReplicaState.READY)
    Shard.objects.create(replica=replica, node=node, port={port}, secret="s")
print("KEY=" + key.secret)
"""

POLICY = {
    "name": "company",
    "rules": [
        {"name": "cards", "kind": "detector", "detector": "card", "action": "refuse"},
        {"name": "guard", "kind": "guard_model", "models": ["llama-guard"], "applies_to": "both", "limit": 30_000},
    ],
}


def judge(body: dict[str, Any]) -> str:
    """The guard model: a prompt about locks, or an answer about poison, is unsafe."""
    last = body["messages"][-1]
    if last["role"] == "user" and "lock" in last["content"]:
        return "unsafe\nS2"
    if last["role"] == "assistant" and "poison" in last["content"]:
        return "unsafe\nS9"
    return "safe"


@dataclass
class Web:
    url: str
    key: str
    database: str
    engine: EngineThread

    def api(self, method: str, path: str, body: Any = None) -> Any:
        request = urllib.request.Request(
            self.url + "/api/v1/" + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.load(response)

    def client(self) -> openai.OpenAI:
        """A client of its own: a connection of its own, which the kernel gives either process."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.key, max_retries=0)

    def record(self, request_id: str) -> tuple[int, str, Any] | None:
        with psycopg.connect(self.database) as conn:
            row = conn.execute(
                "SELECT status, error, guardrail FROM quotas_usagerecord WHERE request_id = %s", (request_id,)
            ).fetchone()
        return (row[0], row[1], row[2]) if row else None

    def set_engine(self, **values: Any) -> None:
        self.engine.run(lambda: [setattr(self.engine.engine, k, v) for k, v in values.items()])


def _wait_for(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Web]:
    if not os.environ.get("LLMGW_REDIS_URL") or not os.environ.get("LLMGW_DATABASE_URL", "").startswith("postgres"):
        pytest.skip("two web processes hear of a change through Redis; this run has none")
    database = pg_database_url()
    assert database is not None
    engine = EngineThread()
    port = free_port()
    env = llmgw_env(tmp_path_factory.mktemp("guardrails"), port, LLMGW_DATABASE_URL=database, LLMGW_LOG_LEVEL="warning")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", "migrate", "-v0"], env=env, cwd=REPO, check=True, timeout=300
        )
        engine_port = int(engine.engine.url.rsplit(":", 1)[1])
        made = subprocess.run(
            [sys.executable, "-m", "llmgw", "manage", "shell", "-c", SETUP.format(port=engine_port)],
            env=env,
            cwd=REPO,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        key = next(line[4:] for line in made.stdout.splitlines() if line.startswith("KEY="))
        # Two web processes and the worker that writes the usage records they hand it.
        for command in (["web", "--workers", "2"], ["worker", "--concurrency", "1"]):
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "llmgw", *command],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        running = Web(f"http://127.0.0.1:{port}", key, database, engine)
        engine.run(lambda: engine.engine.replies.__setitem__("llama-guard", judge))

        def serving() -> bool:
            assert all(p.poll() is None for p in processes), "llmgw web or worker exited"
            try:
                running.client().chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            except (openai.APIConnectionError, openai.APIStatusError):
                return False
            return True

        _wait_for(serving, "both web processes to serve", timeout=120)
        yield running
    finally:
        for process in processes:
            for pid in descendants(process.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            process.kill()
            process.wait(timeout=30)
        engine.stop()
        drop_pg_database(database)


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_a_policy_set_through_the_api_holds_in_both_processes_with_its_verdicts_told_everywhere(web: Web) -> None:
    set_ = web.api("POST", "guardrails", POLICY)
    assert [r["name"] for r in set_["rules"]] == ["cards", "guard"]

    def refused_everywhere() -> bool:
        # Eight fresh connections in a row refused: both processes (each takes about half) apply it.
        for _ in range(8):
            try:
                web.client().chat.completions.create(model="m", messages=ask(f"charge {CARD}"))
            except openai.BadRequestError as exc:
                assert "policy “company”, rule “cards”: a payment card number in the prompt" in exc.message
                assert "4111" not in str(exc.body)
                continue
            return False
        return True

    _wait_for(refused_everywhere, "both processes to apply the policy", timeout=30)

    # The guard model refuses a prompt, and withholds or stops an answer, whichever process asks it.
    with pytest.raises(openai.BadRequestError) as caught:
        web.client().chat.completions.create(model="m", messages=ask("how do I pick a lock?"))
    assert "the guard model “llama-guard” judged the prompt unsafe (S2)" in caught.value.message
    refused_id = caught.value.response.headers["x-llmgw-request-id"]
    web.set_engine(pieces=["Mix the poison ", "into the soup."])
    try:
        for _ in range(4):
            answer = web.client().chat.completions.with_raw_response.create(model="m", messages=ask("soup?"))
            completion = answer.parse()
            assert completion.choices[0].message.content == ""
            assert completion.choices[0].finish_reason == "content_filter"
            stream = web.client().chat.completions.create(model="m", messages=ask("soup?"), stream=True)
            finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
            assert finishes == ["content_filter"]
        stopped_id = answer.headers["x-llmgw-request-id"]
    finally:
        web.set_engine(pieces=None)

    # The usage records (written by whichever process served each) and `ctl request` say the same.
    refused = _wait_for(lambda: web.record(refused_id), "the refusal's usage record")
    assert refused[0] == 400
    assert {"policy": "company", "rule": "guard", "kind": "guard_model", "action": "refuse"} in refused[2]
    stopped = _wait_for(lambda: web.record(stopped_id), "the stopped answer's usage record")
    assert {"policy": "company", "rule": "guard", "kind": "guard_model", "action": "stop", "where": "answer"} in (
        stopped[2]
    )
    told = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "--server", web.url, "--key", web.key, "request", refused_id],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(REPO / "var" / "none")},
    )
    assert told.returncode == 0, told.stderr
    assert "refuse company/guard" in told.stdout
    told = subprocess.run(
        [sys.executable, "-m", "llmgw", "ctl", "--server", web.url, "--key", web.key, "request", stopped_id],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": str(REPO / "var" / "none")},
    )
    assert "stop company/guard on the answer" in told.stdout, told.stdout + told.stderr

    def counted() -> dict[str, int] | None:
        counts = web.api("GET", "guardrails")["results"][0]["counts"]
        return counts if counts.get("refuse", 0) >= 9 and counts.get("stop", 0) >= 8 else None

    _wait_for(counted, "every refusal and stop counted for the policy")


def test_a_client_that_leaves_while_the_guard_judges_cancels_the_guards_request_in_either_process(web: Web) -> None:
    web.set_engine(delays={"llama-guard": 20.0})
    try:
        for _ in range(3):
            web.engine.run(lambda: (web.engine.engine.arrived.clear(), web.engine.engine.closed.clear()))
            body = json.dumps({"model": "m", "messages": ask("hello")}).encode()
            host, port = web.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as conn:
                conn.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\n"
                    b"Authorization: Bearer " + web.key.encode() + b"\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                _wait_for(lambda: web.engine.run(lambda: web.engine.engine.arrived.is_set()), "the guard's request")
            # The client is gone: the guard model's request is given up, not waited out (20 s).
            _wait_for(lambda: web.engine.run(lambda: web.engine.engine.closed.is_set()), "the guard's request to end")
    finally:
        web.set_engine(delays={})

    def gone() -> list[Any]:
        with psycopg.connect(web.database) as conn:
            return conn.execute(
                "SELECT status, error FROM quotas_usagerecord WHERE status = 499 ORDER BY created_at"
            ).fetchall()

    records = _wait_for(lambda: len(gone()) >= 3 and gone(), "the three requests' records")
    assert {error for _status, error in records} == {"the client went away while a guard model judged its prompt"}
