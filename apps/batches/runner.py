"""The batch runner: batches' lines run through a gateway of the process, from idle capacity.

It runs in each process of the Celery worker's pool where Redis is configured, and in the web
process without it (apps.batches.host says why and how). Either way a line is sent through a gateway
application's ASGI interface rather than over HTTP: a key's secret is not stored, and a grant in the
ASGI scope (apps.gateway.grants) is a credential no client can forge, so nothing has to be minted,
signed or kept; every stage of the gateway applies to a line as to any request (limits, guardrails,
the fair queue, usage, metrics); and the runner sees the fair queue (its process's, and with Redis
every process's), so it can give way to an interactive request at once.

How a line runs, and why each is answered once:

1. The runner takes lines (apps.batches.services.claim_lines: a lease per line, renewed while it
   holds them) for each model up to the slots its ready replicas have (one line for a model with
   none: the gateway starts a model kept at zero, or says it does not exist), keeping as many more
   in a local buffer so a freed slot is taken again at once.
2. A line is sent as its key, in the batch band, with the request id of its try
   (services.request_id): the usage record of a try run again after its process died is not
   written twice (apps.quotas.usage drops a request id it has). A chat or text completion is sent
   streamed and its answer joined back (apps.batches.streamjoin: an engine stops a streamed answer
   its client left at once, an unstreamed one up to a second later).
3. Giving way: while an interactive request waits for a model's slot (in this process's fair queue,
   or with Redis in any process's), no line of that model is started, and as many of this process's
   lines of it as there are interactive requests waiting are cut off, newest first (the least work
   lost): the gateway cancels the engine's work and frees the slot for the interactive request. A
   line cut off goes back to pending without counting as a failure; its next try has a new request
   id (the cut try's usage, the prompt the engine read, is recorded as any cancelled request's).
4. How a try ended is written in batches (services.finish_lines), only for lines this process still
   holds: a line taken over by another process after a stall is written by that one alone. A try
   that failed on the way (502, 503 from a replica that died, 504) is tried again, on whichever
   replica the gateway picks (one that failed is passed over for a while), up to
   LLMGW_BATCH_LINE_ATTEMPTS tries; a limit's 429 or a full queue waits its Retry-After, uncounted.
5. Every few seconds it takes batches one step on (services.advance: validation, expiry,
   cancellation, the output files).

A process killed at any point loses only the tries it had in flight: their leases run out
(LLMGW_BATCH_LEASE_SECONDS) and another process, or this one started again, takes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from apps.batches import metrics
from apps.batches.services import LineWork, Outcome, advance, claim_lines, finish_lines, release_lines, renew_leases
from apps.batches.streamjoin import STREAMED, join
from apps.gateway.fairness import INTERACTIVE
from apps.gateway.grants import GRANT, BatchGrant

__all__ = ["BatchRunner", "judge"]

log = logging.getLogger("llmgw.batches")

#: Lines taken for a model the gateway has no ready replica of (it may be starting, or unknown).
NO_REPLICA_LINES = 1
#: How long a refused try waits when the refusal says nothing (a full queue, a limit).
DEFAULT_BACKOFF_S = 5.0


async def _thread[T](func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    from asgiref.sync import sync_to_async

    def run() -> T:
        from django.db import close_old_connections

        close_old_connections()
        try:
            return func(*args, **kwargs)
        finally:
            # Back to the pool: an executor thread keeps its connection otherwise, and a few of them
            # hold every connection of the process's pool (LLMGW_DATABASE_POOL_SIZE).
            close_old_connections()

    return await sync_to_async(run, thread_sensitive=False)()


# How a try ended --------------------------------------------------------------------------------------


def _tokens(endpoint: str, body: Any) -> tuple[int | None, int | None]:
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return None, None

    def number(name: str) -> int | None:
        value = usage.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    if endpoint in ("/v1/messages", "/v1/responses"):
        return number("input_tokens"), number("output_tokens")
    if endpoint == "/v1/embeddings":
        prompt = number("prompt_tokens")
        return prompt, 0 if prompt is not None else None  # an embedding produces no tokens
    return number("prompt_tokens"), number("completion_tokens")


def _said_more(body: Any, note: str) -> Any:
    """An error body with a note added to its message (OpenAI's and Anthropic's shapes)."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return {**body, "error": {**error, "message": f"{error['message']} ({note})"}}
    return body


def judge(
    line: LineWork,
    status: int | None,
    raw: bytes,
    headers: dict[str, str],
    *,
    attempts: int,
    too_large: bool = False,
    retry_s: float = 2.0,
) -> Outcome:
    """What a try's answer means for its line (see the module docstring, step 4)."""
    if status is None:  # cut off with no answer: it gave way, or its batch or this process stopped
        return Outcome(line, retry=True)
    if too_large:
        message = f"The answer was over {len(raw)} bytes (LLMGW_BATCH_MAX_RESPONSE_BYTES) and was not kept."
        return Outcome(line, status_code=502, response={"error": {"message": message, "type": "server_error"}})
    try:
        body: Any = json.loads(raw) if raw else None
    except ValueError:
        body = {"error": {"message": raw[:500].decode("utf-8", "replace"), "type": "server_error"}}
    prompt, completion = _tokens(line.endpoint, body)
    if 200 <= status < 300:
        return Outcome(line, status_code=status, response=body, prompt_tokens=prompt, completion_tokens=completion)
    waits = status == 429 or (status == 503 and "retry-after" in headers)
    if waits:  # a limit or a full queue: tried again once it says, not counted as a failure
        try:
            backoff = max(1.0, min(float(headers.get("retry-after", DEFAULT_BACKOFF_S)), 3600.0))
        except ValueError:
            backoff = DEFAULT_BACKOFF_S
        return Outcome(line, retry=True, backoff_s=backoff)
    if status >= 500 or status == 499:
        tried = line.failures + 1
        if tried < attempts:
            return Outcome(line, retry=True, failed=True, backoff_s=min(retry_s * 2 ** (tried - 1), 60.0))
        note = f"tried {tried} times, each failed"
        return Outcome(line, status_code=status, response=_said_more(body, note), failed=True)
    return Outcome(line, status_code=status, response=body, prompt_tokens=prompt, completion_tokens=completion)


class _Capture:
    """The answer the gateway sends for one line, its body kept up to a bound."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.size = 0
        self.too_large = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            self.size += len(chunk)
            if self.size > self.most:
                self.too_large = True
                self.chunks = []
            elif chunk:
                self.chunks.append(chunk)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


@dataclass(eq=False)
class _Running:
    line: LineWork
    started: float
    cut: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


# The runner ------------------------------------------------------------------------------------------


class BatchRunner:
    """One per process that runs lines: started and stopped with its gateway (llmgw/asgi.py's lifespan in
    the web process, apps.batches.host in a worker's)."""

    def __init__(
        self,
        app: Any,
        *,
        tick_s: float = 0.2,
        advance_s: float = 2.0,
        yield_s: float = 0.01,
        shared_yield_s: float = 0.1,
        retry_s: float = 2.0,
    ) -> None:
        from django.conf import settings

        self.app = app  # apps.gateway.asgi.GatewayApp
        self.holder = f"{socket.gethostname()[:60]}:{os.getpid()}:{os.urandom(3).hex()}"
        self.tick_s = tick_s
        self.advance_s = advance_s
        self.yield_s = yield_s
        self.shared_yield_s = shared_yield_s
        self.retry_s = retry_s  # the first wait before a failed try is tried again; doubled each time
        self.attempts = settings.BATCH_LINE_ATTEMPTS
        self.lease_s = settings.BATCH_LEASE_SECONDS
        self.max_response = settings.BATCH_MAX_RESPONSE_BYTES
        self.buffer: dict[str, deque[LineWork]] = {}
        self.running: dict[int, _Running] = {}
        self.outcomes: list[Outcome] = []
        self.yielded = 0  # lines this process cut off for interactive requests
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._shared_waiting: dict[str, int] = {}
        self._idle_until = 0.0  # no line of any model to take: look again after this
        self._others_idle_until = 0.0  # no line of a model without replicas: look for one after this
        self._stopping = False

    # Life cycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._tasks = [
            asyncio.create_task(self._loop(), name="batch-runner"),
            asyncio.create_task(self._yield_loop(), name="batch-yield"),
        ]

    async def stop(self) -> None:
        """Stop: lines in flight are cut off (tried again later, by this process started again or
        another), those taken but not started are given back."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        running = list(self.running.values())
        for item in running:
            item.cut.set()
        await asyncio.gather(*(r.task for r in running if r.task is not None), return_exceptions=True)
        taken = [line.id for lines in self.buffer.values() for line in lines]
        self.buffer.clear()
        with contextlib.suppress(Exception):
            await self._flush()
            if taken:
                await _thread(release_lines, self.holder, taken)

    def wake(self) -> None:
        self._wake.set()

    # The loop ----------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        advanced = renewed = 0.0
        while True:
            moment = time.monotonic()
            try:
                if moment - advanced >= self.advance_s:
                    advanced = moment
                    await _thread(advance, self.holder)
                if moment - renewed >= self.lease_s / 3:
                    renewed = moment
                    await self._renew()
                await self._flush()
                self._start_lines()
                await self._take()
                self._start_lines()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("batch runner: a pass failed; trying again", exc_info=True)
                await asyncio.sleep(1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            self._wake.clear()

    async def _renew(self) -> None:
        held = [r.line.id for r in self.running.values()] + [line.id for q in self.buffer.values() for line in q]
        if held:
            await _thread(renew_leases, self.holder, held)

    async def _flush(self) -> None:
        if not self.outcomes:
            return
        outcomes, self.outcomes = self.outcomes, []
        try:
            await _thread(finish_lines, self.holder, outcomes)
        except Exception:
            self.outcomes = outcomes + self.outcomes  # the database is away: kept, written later
            raise

    # Capacity -------------------------------------------------------------------------------------------

    def _slots(self, model: str) -> int:
        """How many lines of the model may run at once from this process."""
        route = self.app.tables.models.get(model)
        if route is None or not route.upstreams:
            return NO_REPLICA_LINES
        if self._interactive_waiting(model):
            return 0
        return sum(max(1, u.capacity) for u in route.upstreams)

    def _interactive_waiting(self, model: str) -> int:
        local = self.app.admission.queue.waiting(model, INTERACTIVE)
        return max(local, self._shared_waiting.get(model, 0))

    def _running_count(self, model: str) -> int:
        return sum(1 for r in self.running.values() if r.line.model == model)

    async def _take(self) -> None:
        """Take more lines where the buffer holds fewer than a round of slots."""
        if self._stopping or time.monotonic() < self._idle_until:
            return
        wanted: dict[str, int] = {}
        for model, route in self.app.tables.models.items():
            slots = sum(max(1, u.capacity) for u in route.upstreams) if route.upstreams else NO_REPLICA_LINES
            need = 2 * slots - self._running_count(model) - len(self.buffer.get(model, ()))
            wanted[model] = max(0, need)
        held_unknown = sum(len(q) for m, q in self.buffer.items() if m not in wanted)
        unknown = max(
            0, NO_REPLICA_LINES - held_unknown - sum(1 for r in self.running.values() if r.line.model not in wanted)
        )
        if time.monotonic() < self._others_idle_until:
            unknown = 0
        known = any(wanted.values())
        if not unknown and not known:
            return  # a round of lines is held for every model already
        taken = await _thread(claim_lines, self.holder, wanted, others=unknown)
        if not taken:
            # Nothing to run: look again in a while. When only a model without replicas was asked
            # for, only that look waits: the models served still take lines as their slots free.
            moment = time.monotonic() + self.advance_s
            if known:
                self._idle_until = moment
            else:
                self._others_idle_until = moment
            return
        for line in taken:
            self.buffer.setdefault(line.model, deque()).append(line)

    def _start_lines(self) -> None:
        if self._stopping:
            return
        for model, queue in self.buffer.items():
            room = self._slots(model) - self._running_count(model)
            while queue and room > 0:
                self._start(queue.popleft())
                room -= 1

    def _start(self, line: LineWork) -> None:
        item = _Running(line, time.monotonic())
        self.running[line.id] = item
        item.task = asyncio.create_task(self._run(item), name=f"batch-line-{line.id}")
        metrics.in_flight(line.model, 1)

    # One line ------------------------------------------------------------------------------------------

    async def _run(self, item: _Running) -> None:
        line = item.line
        capture = _Capture(self.max_response)
        status: int | None = None
        try:
            await self.app(_scope(line), _receive(line, item.cut), capture.send)
            status, raw = _answer(line, capture, cut=item.cut.is_set())
            outcome = judge(
                line,
                status,
                raw,
                capture.headers,
                attempts=self.attempts,
                too_large=capture.too_large,
                retry_s=self.retry_s,
            )
        except Exception as exc:  # the gateway answers every failure itself; this is a bug, not the line's
            log.exception("batch line %s of %s failed in the gateway", line.number, line.batch_id)
            outcome = Outcome(line, retry=True, failed=True, backoff_s=5.0, error={"message": str(exc)[:300]})
        finally:
            self.running.pop(line.id, None)
            metrics.in_flight(line.model, -1)
        if item.cut.is_set() and status is None:
            outcome.yielded = True
        self.outcomes.append(outcome)
        self._start_lines()  # its slot is free: the next line of the model takes it at once
        self._wake.set()

    # Giving way to interactive requests --------------------------------------------------------------------

    async def _yield_loop(self) -> None:
        checked_shared = 0.0
        while True:
            await asyncio.sleep(self.yield_s)
            try:
                if self.app.shared is not None and time.monotonic() - checked_shared >= self.shared_yield_s:
                    checked_shared = time.monotonic()
                    await self._read_shared()
                self._give_way()
                self._start_lines()  # the interactive requests were served: lines take the slots again
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("batch runner: could not look for interactive requests", exc_info=True)

    def _give_way(self) -> None:
        """Cut off as many of this process's lines of each model as interactive requests wait for it."""
        models = {r.line.model for r in self.running.values()}
        for model in models:
            waiting = self._interactive_waiting(model)
            if not waiting:
                continue
            mine = sorted((r for r in self.running.values() if r.line.model == model), key=lambda r: -r.started)
            cutting = sum(1 for r in mine if r.cut.is_set())
            for item in [r for r in mine if not r.cut.is_set()][: max(0, waiting - cutting)]:
                item.cut.set()
                self.yielded += 1

    async def _read_shared(self) -> None:
        """How many interactive requests wait for each model this process runs lines of, in every
        gateway process (the shared queue's interactive band, in Redis)."""
        shared = self.app.shared
        models = sorted({r.line.model for r in self.running.values()})
        if shared is None or not models or not shared.available():
            self._shared_waiting = {}
            return
        commands = [("ZCARD", shared.queue_keys(model)[0]) for model in models]
        replies = await shared.client.execute(*commands)
        self._shared_waiting = {m: r for m, r in zip(models, replies, strict=True) if isinstance(r, int) and r > 0}

    # Figures (bench/batches.py, the console) -------------------------------------------------------------

    def in_flight(self, model: str | None = None) -> int:
        return sum(1 for r in self.running.values() if model is None or r.line.model == model)


def _scope(line: LineWork) -> dict[str, Any]:
    grant = BatchGrant(key_hash=line.key_hash, batch_id=line.batch_id, request_id=line.request_id)
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": line.endpoint,
        "raw_path": line.endpoint.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-llmgw-priority", b"batch")],
        "client": ("batch", 0),
        "server": None,
        GRANT: grant,
    }


def _sent_body(line: LineWork) -> Any:
    """The line's body as it is sent: chat and text completions streamed, with their usage (why:
    apps.batches.streamjoin), the rest as written."""
    body = line.body
    if line.endpoint in STREAMED and isinstance(body, dict) and not body.get("stream"):
        given = body.get("stream_options")
        options: dict[str, Any] = given if isinstance(given, dict) else {}
        return {**body, "stream": True, "stream_options": {**options, "include_usage": True}}
    return body


def _answer(line: LineWork, capture: _Capture, *, cut: bool) -> tuple[int | None, bytes]:
    """The try's status and answer as an unstreamed request gets them: a streamed answer joined; one
    cut off on the way is no answer (None: it gave way), one that broke off otherwise a 502."""
    status, raw = capture.status, capture.body
    streamed = capture.headers.get("content-type", "").startswith("text/event-stream")
    if status is None or not 200 <= status < 300 or not streamed or capture.too_large:
        return status, raw
    joined, why = join(line.endpoint, raw)
    if joined is not None:
        return status, joined
    if cut:
        return None, b""
    message = f"The engine's answer broke off: {why}."
    return 502, json.dumps({"error": {"message": message, "type": "server_error"}}).encode()


def _receive(line: LineWork, cut: asyncio.Event) -> Callable[[], Awaitable[dict[str, Any]]]:
    body = json.dumps(_sent_body(line)).encode()
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await cut.wait()  # the line is cut off: the gateway sees its client leave
        return {"type": "http.disconnect"}

    return receive
