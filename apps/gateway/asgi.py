"""The /v1 gateway: a plain ASGI application mounted ahead of Django in llmgw/asgi.py.

Nothing here touches the ORM while serving a request. Keys, limits and routes live in memory
(apps.gateway.tables), kept current by apps.gateway.routes. A request goes through these
stages, each in its own module, in this order:

0. a browser's preflight is answered, and answers to an allowed origin carry the CORS headers
   (apps.gateway.cors);
1. intake: which endpoint, the API key, the body, its translation to chat completions
   (apps.gateway.intake);
2. the prompt's guardrails (apps.gateway.guard);
3. admission: the caller's limits, its band, then a slot on an upstream, waiting in the model's
   fair queue when all are taken (apps.gateway.admission, apps.gateway.fairness,
   apps.gateway.slots, apps.gateway.routing);
4. forwarding and relaying: the engine is asked and its answer, whole or streamed, is written in
   the client's protocol (apps.gateway.forward, apps.gateway.relay, apps.gateway.translate); a
   Responses answer is stored before its last byte (apps.gateway.response_store), and the stored
   ones are served by their own routes (apps.gateway.stored);
5. errors in the client's protocol (apps.gateway.errors);
6. accounting: the usage record before the answer's last byte, its token charge, metrics and
   trace right after it (apps.gateway.accounting), and the fair queue's charge corrected by what
   it really cost.

This module holds the application's life cycle and the order of the stages.

Stopping: a replica being stopped is out of the routes at once (the tables), and a request it
still holds when its engine goes at the end of its drain grace ends with an error that says so
(a stream with an error event, a whole answer with a 503). When this process itself is stopped,
uvicorn takes no new connection and waits for the requests in flight; `begin_stop` ends those
still running after LLMGW_DRAIN_GRACE_SECONDS the same way, before uvicorn would cut them off.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from apps.gateway import tracing
from apps.gateway.accounting import CANCELLED, Accountant
from apps.gateway.admission import Admission, limit_headers
from apps.gateway.cors import Cors
from apps.gateway.errors import Refused, send_error
from apps.gateway.forward import Forwarder
from apps.gateway.grants import GRANT, BatchGrant
from apps.gateway.guard import READ_ELSEWHERE_BYTES, check_prompt, offload, read_large_body
from apps.gateway.intake import (
    COUNT_TOKENS,
    ENDPOINTS,
    MODELS,
    RESPONSES,
    STORED_RESPONSES,
    BodyBudget,
    Call,
    ClientLeft,
    Endpoint,
    api_key,
    check_fits,
    check_size,
    content_encoding,
    decode_body,
    parse_body,
    read_body,
)
from apps.gateway.response_store import ResponseStore
from apps.gateway.routes import Routes
from apps.gateway.slots import SharedSlots, SlotKeeper
from apps.gateway.stored import StoredRoutes
from apps.gateway.tables import KeyEntry, ModelRoute, Tables, key_hash, tables_channel
from apps.gateway.upstream import Pool, ProxyConfig

__all__ = ["GatewayApp", "gateway_app"]

log = logging.getLogger("llmgw.gateway")
# How often one gateway process tells the reconciler that every replica of a model is busy.
BUSY_NOTE_INTERVAL_S = 5.0

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class GatewayApp:
    def __init__(self) -> None:
        from django.conf import settings

        self.keeper = SlotKeeper()
        self.admission = Admission(
            self.keeper,
            most=settings.GATEWAY_QUEUE_MAX,
            timeouts=(settings.GATEWAY_QUEUE_TIMEOUT, settings.GATEWAY_BATCH_QUEUE_TIMEOUT),
            cold_start_timeout=settings.GATEWAY_COLD_START_TIMEOUT,
            batch_every=settings.GATEWAY_BATCH_EVERY,
            tables=lambda: self.routes.tables,
            busy=self.note_busy,
            demand=self.demand,
        )
        self.routes = Routes(
            self.keeper,
            self.admission.wake_all,
            refresh_s=settings.GATEWAY_REFRESH_SECONDS,
            reload_s=settings.GATEWAY_RELOAD_SECONDS,
        )
        self.forwarder = Forwarder(self.keeper, self.admission, self.routes, self.head, lambda: self.closing)
        self.accountant = Accountant(
            usage=None, limiter=None, known_model=self.routes.knows, count_prompt=self.forwarder.count_prompt
        )
        self.limiter: Any = None
        self.usage: Any = None
        self.shared: SharedSlots | None = None
        self.cors = Cors(settings.GATEWAY_CORS_ORIGINS)
        self.responses = ResponseStore(
            enabled=settings.RESPONSES_STORE,
            retention_days=settings.RESPONSES_RETENTION_DAYS,
            most_bytes=settings.GATEWAY_MAX_BODY_BYTES,
        )
        self.stored = StoredRoutes(self.responses, self.authenticate)
        self.forwarder.keep = self.responses.keep
        self.max_body = settings.GATEWAY_MAX_BODY_BYTES
        self.bodies = BodyBudget(settings.GATEWAY_BODY_MEMORY_BYTES)
        self.max_messages = settings.GATEWAY_MAX_MESSAGES
        self.max_parts = settings.GATEWAY_MAX_PARTS
        self._started: asyncio.Future[None] | None = None
        self._refresh: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._busy_noted: dict[str, float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        # Set when this process is stopping and the grace of its requests in flight ran out.
        self.closing: str | None = None
        self._stop_timer: asyncio.TimerHandle | None = None

    @property
    def tables(self) -> Tables:
        return self.routes.tables

    @tables.setter
    def tables(self, tables: Tables) -> None:
        self.routes.tables = tables

    # Life cycle ---------------------------------------------------------------------------

    async def startup(self) -> None:
        await self.ensure_started()

    async def ensure_started(self) -> None:
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                await self._start()
                self._started.set_result(None)
            except BaseException as exc:
                self._started.set_exception(exc)
                self._started = None
                raise
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        from django.conf import settings

        from apps.quotas.limiter import make_limiter

        self.forwarder.upstream = Pool(
            connect_timeout=5, read_timeout=settings.GATEWAY_READ_TIMEOUT, idle_timeout=60, proxies=ProxyConfig()
        )
        self.forwarder.providers = Pool(
            connect_timeout=10,
            read_timeout=settings.GATEWAY_READ_TIMEOUT,
            idle_timeout=60,
            ca_bundle=settings.PROVIDER_CA_BUNDLE or None,
            proxies=ProxyConfig.from_env(),
        )
        self.limiter = self.admission.limiter = make_limiter()
        tracing.configure()
        self.usage = _usage_writer(settings)
        await self.usage.start()
        self.accountant.usage, self.accountant.limiter = self.usage, self.limiter
        if settings.REDIS_URL:
            self.share_slots(settings.REDIS_URL, settings.GATEWAY_SLOT_LEASE_SECONDS)
        await self.routes.start()
        self._refresh = asyncio.create_task(self._refresh_loop(), name="gateway-refresh")
        if settings.REDIS_URL:
            from apps.quotas.resp import subscribe

            self._listener = asyncio.create_task(
                subscribe(settings.REDIS_URL, tables_channel(), lambda _message: self.routes.wake()),
                name="gateway-tables",
            )
        _freeze_startup_objects()

    async def _refresh_loop(self) -> None:
        await self.routes.refresh_loop()

    async def reload(self) -> None:
        await self.routes.reload()

    def wake_from_thread(self) -> None:
        """The tables changed (a key revoked, a model deleted): read them now."""
        self.routes.wake_from_thread()

    def share_slots(self, url: str, lease_s: float) -> None:
        """Count slots and the queue in Redis with every other gateway process."""
        from django.conf import settings

        from apps.quotas.resp import RedisClient, subscribe

        shared = SharedSlots(
            RedisClient(url, timeout=0.5),
            prefix=getattr(settings, "REDIS_PREFIX", "llmgw"),
            lease_s=lease_s,
            subscribe=partial(subscribe, url),
        )
        shared.on_released = self.admission.released
        self.shared = self.keeper.shared = self.admission.shared = shared
        shared.start()

    async def shutdown(self) -> None:
        for task in (self._refresh, self._listener):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self.routes.stop()
        await self.accountant.drain()
        if self.shared is not None:
            await self.shared.stop()
            self.shared = self.keeper.shared = self.admission.shared = None
        if self.usage is not None:
            await self.usage.stop()
        if self.limiter is not None and hasattr(self.limiter, "close"):
            await self.limiter.close()
        for pool in (self.forwarder.upstream, self.forwarder.providers):
            if pool is not None:
                await pool.close()
        await asyncio.to_thread(offload.shutdown)  # the guard's worker processes, when long prompts started them
        self._started = None

    def begin_stop(self) -> None:
        """This process is stopping (uvicorn takes no new connection and waits for those open): the
        requests in flight get LLMGW_DRAIN_GRACE_SECONDS; then each still running ends with an error
        naming the reason. Called once per connection open at the stop; the first call counts."""
        from django.conf import settings

        loop = self.routes._loop
        if self._stop_timer is not None or loop is None or loop.is_closed():
            return
        self._stop_timer = loop.call_later(settings.DRAIN_GRACE, self._grace_over, settings.DRAIN_GRACE)

    def _grace_over(self, grace: int) -> None:
        self.closing = (
            f"the gateway was stopped: its drain grace of {grace} s ran out (this llmgw web process is stopping)"
        )
        pools = (self.forwarder.upstream, self.forwarder.providers)
        cut = sum(pool.abort(self.closing) for pool in pools if pool is not None)
        if cut:
            log.warning("stopping: %s request(s) still in flight after %s s were ended", cut, grace)

    # ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "OPTIONS":  # a browser's preflight, on any /v1 path: no key, no body
            await self.cors.answer_preflight(scope, send)
            return
        send = self.cors.wrap(scope, send)
        started = self._started
        if started is None or not started.done():  # once started, no shield and future to wait on
            await self.ensure_started()
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
            await self.models(scope, send, path[len("/v1/models/") :] if path != "/v1/models" else None)
            return
        stored = StoredRoutes.route(method, path)
        if stored is not None:
            await self.stored_response(scope, send, *stored)
            return
        endpoint = ENDPOINTS.get((method, path))
        if endpoint is None:
            # Every answer carries a request id, this one too.
            protocol = "anthropic" if path.startswith("/v1/messages") else "openai"
            refusal = Refused(404, f"No route for {method} {path}", kind="not_found_error", code="unknown_url")
            await send_error(send, protocol, refusal, self.head(Call(MODELS)))
            return
        await self.handle(endpoint, scope, receive, send)

    async def handle(self, endpoint: Endpoint, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        call = Call(endpoint)
        accounted = False

        async def answer(message: dict[str, Any]) -> None:
            """The answer's last message goes out only once the request's usage record is made: it is
            then in this process's journal, and a kill at any moment after loses nothing. Its token
            charge, metrics and trace are counted once that message is out, off the answer's path."""
            nonlocal accounted
            if accounted or message["type"] != "http.response.body" or message.get("more_body"):
                await send(message)
                return
            accounted = True
            settle = self.accountant.record(call)
            try:
                await send(message)
            finally:
                settle()

        try:
            await self.serve(call, scope, receive, answer)
        except Refused as exc:
            call.status, call.error = exc.status, exc.message
            with contextlib.suppress(Exception):
                await send_error(answer, endpoint.protocol, exc, self.head(call))
        except ClientLeft as exc:
            call.status, call.error = CANCELLED, str(exc) or "the client went away before its request was answered"
        except asyncio.CancelledError:
            call.status, call.error = CANCELLED, "the client went away"
            raise
        except Exception as exc:
            log.exception("request %s failed", call.request_id)
            call.status, call.error = 500, f"{type(exc).__name__}: {exc}"
            refusal = Refused(500, "The gateway failed to handle this request.")
            with contextlib.suppress(Exception):
                await send_error(answer, endpoint.protocol, refusal, self.head(call))
        finally:
            if call.lease is not None:
                self.keeper.release(call.lease)
            self.bodies.give(call.body_bytes)
            if not accounted:  # no last byte was sent: the client left, or the answer broke off
                self.accountant.finish(call)
            self.admission.settle(call)

    # The stages -------------------------------------------------------------------------------

    async def serve(self, call: Call, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await self.routes.reload_announced()  # a change was announced: route by the tables after it
        grant: BatchGrant | None = scope.get(GRANT)
        if grant is not None:  # a batch's line, run in this process (apps.gateway.grants)
            call.request_id, call.batch = grant.request_id, grant.batch_id
        call.entry = await self.authenticate(scope)
        if tracing.exporter() is not None:
            call.traceparent = next(
                (v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"traceparent"), None
            )
        await self.read(call, scope, receive)
        route = await self.route(call)
        await self.check_prompt(call, route, receive)
        call.headroom = await self.admission.check_limits(call)
        self.admission.choose_band(call, scope.get("headers", []))
        if call.endpoint is COUNT_TOKENS:
            await self.forwarder.count_tokens(call, route, send)
            return
        call.queued_at = time.perf_counter()
        lease = await self.admission.acquire(call, route, receive)
        if lease is None:  # cannot happen without exclusions; kept for the type checker
            raise Refused(503, f"No replica of “{call.model}” can take the request.", kind="overloaded_error")
        call.lease = lease
        call.leased_at = time.perf_counter()
        await self.forwarder.forward(call, route, receive, send)

    async def authenticate(self, scope: dict[str, Any]) -> KeyEntry:
        grant: BatchGrant | None = scope.get(GRANT)
        hashed = grant.key_hash if grant is not None else key_hash(api_key(scope.get("headers", [])))
        entry = self.routes.tables.keys.get(hashed)
        if entry is None:
            await self.routes.confirm_miss()
            entry = self.routes.tables.keys.get(hashed)
        if entry is None:
            raise Refused(
                401, "Invalid, revoked or expired API key.", kind="authentication_error", code="invalid_api_key"
            )
        if entry.expires_at is not None and entry.expires_at <= time.time():
            raise Refused(401, "API key expired.", kind="authentication_error", code="invalid_api_key")
        return entry

    async def read(self, call: Call, scope: dict[str, Any], receive: Receive) -> None:
        """The body (inflated, when it came gzip'd): its model named, and what the engine is asked made of it."""
        raw = await read_body(receive, self.max_body, self.bodies, call)
        codings = content_encoding(scope.get("headers", []))
        decoded = decode_body(raw, codings, self.max_body, self.bodies, call)
        if len(decoded) >= READ_ELSEWHERE_BYTES:
            body = await read_large_body(decoded, getattr(call.entry, "key_id", None))
        else:
            body = parse_body(decoded)
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise Refused(400, "Name the model in the body's “model” field.", code="missing_model")
        if "\x00" in body["model"]:  # no model's name holds one, and no usage record could keep it
            raise Refused(
                400,
                "The “model” field holds a NUL character (U+0000), which no model name can contain.",
                code="invalid_model",
                param="model",
            )
        call.model = body["model"]
        call.original = body
        call.stream = call.endpoint.streams and body.get("stream") is True
        if call.endpoint is RESPONSES:  # stored or not, and the conversation previous_response_id continues
            body = await self.responses.prepare(call, body, partial(call.endpoint.chat, call))
        call.body = call.endpoint.chat(call, body)

    async def route(self, call: Call) -> ModelRoute:
        """The model's route, when it exists and the key may use it."""
        assert call.entry is not None
        route = self.routes.tables.models.get(call.model)
        if route is None:
            await self.routes.confirm_miss()
            route = self.routes.tables.models.get(call.model)
        if route is None:
            raise Refused(
                404, f"The model “{call.model}” does not exist.", kind="not_found_error", code="model_not_found"
            )
        if not call.entry.may_use(call.model):
            raise Refused(
                403,
                f"This API key may not use the model “{call.model}”.",
                kind="permission_error",
                code="model_not_allowed",
            )
        return route

    async def check_prompt(self, call: Call, route: ModelRoute, receive: Receive) -> None:
        """The prompt's guardrails, its size, and whether it can fit the model's context."""
        assert call.entry is not None
        tables = self.routes.tables
        policies = tables.guards.for_call(call.entry, call.model) if tables.guards else None
        if policies is not None:
            await check_prompt(call, policies)
            if policies.guard_prompts:
                await _unless_client_leaves(self.forwarder.judge.prompt(call, policies.guard_prompts), receive)
        check_size(call.body, most_messages=self.max_messages, most_parts=self.max_parts)
        contexts = [u.context_size for u in route.upstreams if u.context_size]
        context = min(contexts) if contexts and len(contexts) == len(route.upstreams) else None
        check_fits(call.body, context, call.endpoint.prompt_field)

    # The reconciler's hints ----------------------------------------------------------------------

    def note_busy(self, model: str) -> None:
        """Every replica of a model that may grow is busy: tell the reconciler, at most every few seconds
        per model from this process, in the background (the waiting request does not wait for it)."""
        moment = time.monotonic()
        if moment - self._busy_noted.get(model, -math.inf) < BUSY_NOTE_INTERVAL_S:
            return
        self._busy_noted[model] = moment

        def record() -> None:
            from apps.catalog.services import record_busy

            record_busy(model)

        self._spawn(_in_thread(record, f"report that {model} is busy"))

    def demand(self, model: str) -> None:
        """A model kept at zero replicas was asked for: the reconciler starts one."""

        def record() -> None:
            from apps.catalog.services import record_demand

            record_demand(model)

        self._spawn(_in_thread(record, f"ask for a replica of {model}"))

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # Answers ----------------------------------------------------------------------------------------

    def head(self, call: Call, content_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """The answer's headers; those made while the engine worked (Forwarder) when nothing they
        say has changed since."""
        made, call.head = call.head, None
        if made is not None and made[0] is call.upstream and made[1] == len(call.guard) and made[2] == content_type:
            return made[3]
        return self._head(call, content_type)

    def _head(self, call: Call, content_type: bytes | None) -> list[tuple[bytes, bytes]]:
        # The gateway's own name for the request id, and the names the SDKs read it from (the OpenAI
        # SDKs' `_request_id` from x-request-id, Anthropic's from request-id).
        request_id = call.request_id.encode()
        headers = [(b"x-llmgw-request-id", request_id), (b"x-request-id", request_id), (b"request-id", request_id)]
        if content_type is not None:
            headers.insert(0, (b"content-type", content_type))
        upstream = call.upstream
        if upstream is not None:
            headers.append((b"x-llmgw-replica", f"{upstream.model}/{upstream.id}".encode()))
            headers.append((b"x-llmgw-hardware", upstream.hardware.encode()))
        if call.queue_ms is not None:
            headers.append((b"x-llmgw-queue-ms", str(round(call.queue_ms)).encode()))
            headers.append((b"x-llmgw-priority", (call.band_note or BAND_NAMES[call.band]).encode()))
        if call.headroom is not None:
            headers += limit_headers(call.endpoint.protocol, call.headroom)
        if call.guard:
            # What guardrails did to the prompt, said to the client: "redact; pii/cards" and the like.
            done = sorted({f"{f['action']}; {f['policy']}/{f['rule']}" for f in call.guard if f.get("action") != "log"})
            if done:
                headers.append((b"x-llmgw-guardrail", ", ".join(done).encode("utf-8", "replace")[:1000]))
        return headers

    async def models(self, scope: dict[str, Any], send: Send, model_id: str | None) -> None:
        """GET /v1/models (those the key may use) and GET /v1/models/{id}."""
        call = Call(MODELS)
        try:
            entry = await self.authenticate(scope)
            data = await self._models(entry, model_id)
        except Refused as exc:
            await send_error(send, "openai", exc, self.head(call))
            return
        await self._json(send, call, data)

    async def stored_response(self, scope: dict[str, Any], send: Send, response_id: str, what: str) -> None:
        """A stored response's route (apps.gateway.stored)."""
        call = Call(STORED_RESPONSES)
        try:
            data = await self.stored.answer(scope, response_id, what)
        except Refused as exc:
            await send_error(send, "openai", exc, self.head(call))
            return
        await self._json(send, call, data)

    async def _json(self, send: Send, call: Call, data: dict[str, Any]) -> None:
        out = json.dumps(data, ensure_ascii=False).encode()
        headers = [*self.head(call, b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    async def _models(self, entry: KeyEntry, model_id: str | None) -> dict[str, Any]:
        tables = self.routes.tables
        if model_id is None:
            names = sorted(tables.models.items())
            return {"object": "list", "data": [_model_object(n, r) for n, r in names if entry.may_use(n)]}
        route = tables.models.get(model_id)
        if route is None:
            await self.routes.confirm_miss()
            route = self.routes.tables.models.get(model_id)
        if route is None or not entry.may_use(model_id):
            raise Refused(
                404,
                f"The model “{model_id}” does not exist or this key may not use it.",
                kind="not_found_error",
                code="model_not_found",
            )
        return _model_object(model_id, route)


BAND_NAMES = ("interactive", "batch")


_frozen = False


def _freeze_startup_objects() -> None:
    """Leave what the process holds once started (Django, its apps, the tables) out of every
    garbage collection to come. A full collection walked all of it, 50-150 ms with the event loop
    stopped (about once a second at 1,000 requests a second), and the requests that waited on it
    had that added; now it walks only what was made since (under 1 ms). Once per process."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


def _usage_writer(settings: Any) -> Any:
    """The usage writer: every record journaled on local disk before the answer's last byte
    (apps/quotas/journal.py), then written by a worker (web processes stay out of the ORM) or here."""
    from apps.quotas.journal import Journal
    from apps.quotas.usage import UsageWriter

    options: dict[str, Any] = {"journal": Journal(settings.DATA_DIR / "usage-journal")}
    if getattr(settings, "USAGE_WRITER", "worker") == "worker":
        from apps.quotas.usage import write_via_worker

        options["write"] = write_via_worker
        # ... and what it has not written a minute later (a broker that lost it) is written here.
        options["confirm_after"] = 60.0
    return UsageWriter(**options)


def _model_object(name: str, route: ModelRoute) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "llmgw",
        "llmgw": {"hardware": route.hardware, "ready_replicas": len(route.upstreams)},
    }


async def _unless_client_leaves(work: Awaitable[None], receive: Receive) -> None:
    """Await work (a guard model's verdict) while watching the client: one that goes away ends it
    (the guard model's request is cancelled) with ClientLeft."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_watch_disconnect(receive))
    try:
        done, _pending = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            raise ClientLeft("the client went away while a guard model judged its prompt")
        task.result()
    finally:
        if not task.done():  # the client left, or this request was cancelled
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


async def _watch_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _in_thread(func: Callable[[], object], what: str) -> None:
    """Run a database service off the event loop; a failure is logged, never the request's."""
    from asgiref.sync import sync_to_async

    try:
        await sync_to_async(func, thread_sensitive=False)()
    except Exception:
        log.warning("could not %s", what, exc_info=True)


gateway_app = GatewayApp()
