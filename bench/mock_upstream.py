"""A fast mock OpenAI-compatible upstream for bench/gateway.py (raw asyncio + httptools + uvloop).

    .venv/bin/python bench/mock_upstream.py --fast PORT [--slow PORT] [--paced PORT]
                                            [--replica PORT] [--replica-paced PORT]

Answers POST .../chat/completions on every port (keep-alive, HTTP/1.1):

- without "stream": true, one JSON completion with usage;
- with "stream": true, 16 content chunks, a usage chunk and [DONE] as a chunked SSE answer.
  On the fast port each event is written in its own turn of the event loop (as fast as the
  loop goes); on the paced port 1 ms apart, so every chunk reaches the gateway on its own;
  on the slow port one every 0.5 s, the stream lasting about 5 s (11 content chunks).

The replica ports answer as the fast and the paced port do; they are ports of their own so that
what one engine (a replica in llmgw's database) held is counted apart from the rest.

Each port counts the completions it holds: received, and not yet answered (queued behind a
stream on the same connection included). A stream is answered once its [DONE] is written, as an
engine's slot is free once it has sent [DONE] (llmgw gives the slot back on [DONE]; the chunked
body's end follows a loop turn later). On any port:

- GET /__stats: {"in_flight": M, "max_in_flight": N, "requests": R} for that port, where N is
  the most held at once since the port opened or was last reset and R the completions received;
- POST /__stats/reset: sets max_in_flight to the current in_flight and requests to 0 (answers the same).

Prints "ready" on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from functools import partial
from typing import Any

import httptools

CHUNKS = 16
SLOW_CHUNKS = 11  # 10 gaps of 0.5 s: about 5 s open
SLOW_GAP = 0.5
PACED_GAP = 0.001
WORDS = [f" w{i}" for i in range(CHUNKS)]


def completion(model: str) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(WORDS)}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": CHUNKS, "total_tokens": 12 + CHUNKS},
        }
    ).encode()


def stream_events(model: str, count: int) -> list[bytes]:
    events = []
    for i in range(count):
        delta: dict[str, str] = {"content": WORDS[i % CHUNKS]}
        if i == 0:
            delta["role"] = "assistant"
        chunk = {
            "id": "chatcmpl-mock",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if i == count - 1 else None}],
        }
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    usage = {
        "id": "chatcmpl-mock",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": count, "total_tokens": 12 + count},
    }
    events.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return [b"%x\r\n%s\r\n" % (len(e), e) for e in events] + [b"0\r\n\r\n"]


JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: keep-alive\r\n\r\n"
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\nconnection: keep-alive\r\n\r\n"
)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: keep-alive\r\n\r\n"
STATS = b"/__stats"
STATS_RESET = b"/__stats/reset"
COMPLETIONS = b"/chat/completions"


class Stats:
    """The completions one port holds at once, the most it held, and how many it received."""

    __slots__ = ("in_flight", "max_in_flight", "requests")

    def __init__(self) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0

    def enter(self) -> None:
        self.requests += 1
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight

    def leave(self) -> None:
        self.in_flight -= 1

    def reset(self) -> None:
        self.max_in_flight = self.in_flight
        self.requests = 0

    def answer(self) -> bytes:
        body = json.dumps(
            {"in_flight": self.in_flight, "max_in_flight": self.max_in_flight, "requests": self.requests}
        ).encode()
        return JSON_HEAD % len(body) + body


_cache: dict[tuple[str, str], Any] = {}


def cached(kind: str, model: str) -> Any:
    """The whole answer (bytes) for "json", the list of chunked events for a stream."""
    key = (kind, model)
    value = _cache.get(key)
    if value is None:
        if kind == "json":
            body = completion(model)
            value = JSON_HEAD % len(body) + body
        else:
            value = stream_events(model, SLOW_CHUNKS if kind == "slow" else CHUNKS)
        _cache[key] = value
    return value


def is_completion(url: bytes) -> bool:
    return url.split(b"?", 1)[0].endswith(COMPLETIONS)


class Mock(asyncio.Protocol):
    def __init__(self, mode: str, stats: Stats) -> None:
        self.mode = mode
        self.stats = stats
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.queue: list[tuple[bytes, bytes, bytes]] = []
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        # what was queued on this connection will not be answered (a stream cut short gives its own back)
        for _method, url, _raw in self.queue:
            if is_completion(url):
                self.stats.leave()
        self.queue.clear()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if is_completion(self.url):
            self.stats.enter()
        self.queue.append((self.parser.get_method(), self.url, b"".join(self.body)))
        if not self.busy:
            self.next()

    def next(self) -> None:
        """Answer queued requests in order (a stream answers over several loop turns)."""
        while self.queue and self.transport is not None:
            method, url, raw = self.queue.pop(0)
            if not is_completion(url):
                path = url.split(b"?", 1)[0]
                if path == STATS_RESET and method == b"POST":
                    self.stats.reset()
                    self.transport.write(self.stats.answer())
                elif path == STATS and method == b"GET":
                    self.transport.write(self.stats.answer())
                else:
                    self.transport.write(NOT_FOUND)
                continue
            try:
                body = json.loads(raw)
            except ValueError:
                body = {}
            model = str(body.get("model") or "mock")
            if not body.get("stream"):
                self.transport.write(cached("json", model))
                self.stats.leave()
                continue
            self.busy = True
            asyncio.get_running_loop().create_task(self.stream(model))
            return

    async def stream(self, model: str) -> None:
        events = cached("slow" if self.mode == "slow" else "stream", model)
        gap = {"slow": SLOW_GAP, "paced": PACED_GAP}.get(self.mode, 0.0)
        transport = self.transport
        assert transport is not None
        content = SLOW_CHUNKS if self.mode == "slow" else CHUNKS
        done = len(events) - 2  # [DONE]; the chunked body's end follows it
        held = True
        try:
            transport.write(SSE_HEAD + events[0])
            for i, event in enumerate(events[1:], 1):
                # the usage chunk and [DONE] follow the last content chunk at once
                await asyncio.sleep(gap if i < content else 0.0)
                if self.transport is None:
                    return
                transport.write(event)
                if i == done:
                    held = False
                    self.stats.leave()
        finally:
            if held:
                self.stats.leave()
        self.busy = False
        self.next()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--fast", type=int, required=True)
    parser.add_argument("--slow", type=int, default=0)
    parser.add_argument("--paced", type=int, default=0)
    parser.add_argument("--replica", type=int, default=0, help="answers as --fast does, counted on its own")
    parser.add_argument("--replica-paced", type=int, default=0, help="answers as --paced does, counted on its own")
    args = parser.parse_args()
    loop = asyncio.get_running_loop()
    servers = []
    for mode, port in (
        ("fast", args.fast),
        ("slow", args.slow),
        ("paced", args.paced),
        ("fast", args.replica),
        ("paced", args.replica_paced),
    ):
        if port:
            servers.append(
                await loop.create_server(
                    partial(Mock, mode, Stats()), args.host, port, backlog=4096, reuse_address=True
                )
            )
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(main())
    except KeyboardInterrupt:
        sys.exit(0)
