"""The gateway's upstream HTTP client against aiohttp and httpx, on the same mock upstream.

    .venv/bin/python bench/upstream_client.py [--requests 3000]

Starts bench/mock_upstream.py and, in this one process (uvloop), sends the same non-streamed
chat request through each client: one at a time, then 32 in flight, and reads 16-chunk
streams 32 at a time. Prints the p50 latency at concurrency 1, requests/s at 32 and the CPU
time of this process per request, with each client's ratio to aiohttp measured in the same
run. The gateway's choice (apps.gateway.upstream) is what it is because of these numbers.
No assertions: a script.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gateway import free_port  # noqa: E402

BODY = json.dumps({"model": "mock", "messages": [{"role": "user", "content": "Say hello in a few words."}]}).encode()
STREAM_BODY = json.dumps(
    {"model": "mock", "stream": True, "messages": [{"role": "user", "content": "Say hello in a few words."}]}
).encode()
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer sk-mock"}

Send = Callable[[bytes, bool], Awaitable[int]]


async def clients(url: str) -> list[tuple[str, Send, Callable[[], Awaitable[None]]]]:
    import aiohttp

    from apps.gateway.upstream import Pool

    try:
        import httpx
    except ImportError:  # the SDKs' newer releases ship it as httpx2
        try:
            import httpx2 as httpx  # type: ignore[no-redef]
        except ImportError:
            httpx = None  # type: ignore[assignment]

    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
        auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=600),
    )

    async def via_aiohttp(body: bytes, stream: bool) -> int:
        async with session.post(url, data=body, headers=HEADERS) as response:
            if stream:
                async for _chunk in response.content.iter_any():
                    pass
            else:
                await response.read()
            return response.status

    found: list[tuple[str, Send, Callable[[], Awaitable[None]]]] = [("aiohttp", via_aiohttp, session.close)]
    if httpx is not None:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(600, connect=5),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

        async def via_httpx(body: bytes, stream: bool) -> int:
            async with client.stream("POST", url, content=body, headers=HEADERS) as response:
                async for _chunk in response.aiter_raw():
                    pass
                return response.status_code

        found.append(("httpx", via_httpx, client.aclose))
    else:
        print("httpx: not installed, left out")

    pool = Pool(connect_timeout=5, read_timeout=600)
    pairs = list(HEADERS.items())

    async def via_pool(body: bytes, stream: bool) -> int:
        async with await pool.post(url, body, pairs) as response:
            if stream:
                async for _chunk in response.iter_chunks():
                    pass
            else:
                await response.read()
            return response.status

    return [*found, ("llmgw upstream", via_pool, pool.close)]


async def measure(send: Send, requests: int) -> dict[str, float]:
    for _ in range(50):
        await send(BODY, False)
    latencies = []
    for _ in range(requests // 4):
        started = time.perf_counter()
        assert await send(BODY, False) == 200
        latencies.append(time.perf_counter() - started)
    out = {"p50_ms": statistics.median(latencies) * 1000}

    async def flood(body: bytes, stream: bool) -> tuple[float, float]:
        queue = iter(range(requests))

        async def worker() -> None:
            for _ in queue:
                assert await send(body, stream) == 200

        cpu = time.process_time()
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        return requests / (time.perf_counter() - started), (time.process_time() - cpu) / requests * 1000

    out["rps"], out["cpu_ms"] = await flood(BODY, False)
    out["streams_s"], out["cpu_stream_ms"] = await flood(STREAM_BODY, True)
    return out


async def run(url: str, requests: int) -> list[tuple[str, dict[str, float]]]:
    results = []
    for name, send, close in await clients(url):
        try:
            results.append((name, await measure(send, requests)))
        finally:
            await close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=3000)
    args = parser.parse_args()
    ports = [free_port() for _ in range(3)]
    mock = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench" / "mock_upstream.py"),
            "--fast",
            str(ports[0]),
            "--slow",
            str(ports[1]),
            "--paced",
            str(ports[2]),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert mock.stdout is not None
        if mock.stdout.readline().strip() != "ready":
            raise SystemExit("the mock upstream did not start")
        import uvloop

        results = uvloop.run(run(f"http://127.0.0.1:{ports[0]}/v1/chat/completions", args.requests))
    finally:
        mock.kill()
        mock.wait()
    base = dict(results)["aiohttp"]
    print(
        f"{'client':<16}{'c=1 p50 ms':>12}{'req/s c=32':>12}{'CPU ms/req':>12}{'streams/s':>12}"
        f"{'CPU ms/stream':>15}   ratio to aiohttp (req/s, CPU)"
    )
    for name, r in results:
        print(
            f"{name:<16}{r['p50_ms']:>12.3f}{r['rps']:>12.0f}{r['cpu_ms']:>12.3f}{r['streams_s']:>12.0f}"
            f"{r['cpu_stream_ms']:>15.3f}   {r['rps'] / base['rps']:.2f}x, {r['cpu_ms'] / base['cpu_ms']:.2f}x"
        )


if __name__ == "__main__":
    main()
