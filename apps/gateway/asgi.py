"""The /v1 gateway: a plain ASGI application mounted ahead of Django in llmgw/asgi.py.

Nothing here touches the ORM while serving a request. Keys, limits and routes live in
memory (apps.gateway.tables), reloaded in a thread when the table version moves; limits
are counted in Redis or in process (apps.quotas.limiter); usage is queued and written in
batches (apps.quotas.usage). Upstream connections are pooled (apps.gateway.upstream), and streams are
passed on chunk by chunk, read only for usage and the first token's time.

Every engine is spoken to in OpenAI chat completions; Anthropic Messages and Responses
requests are translated there and back (apps.gateway.translate).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from apps.gateway import metrics
from apps.gateway.routing import Admission, affinity_key, choose
from apps.gateway.tables import Endpoint, KeyEntry, ModelRoute, Tables, current_version, key_hash, load_tables
from apps.gateway.translate import (
    ChatToAnthropicStream,
    ChatToResponsesStream,
    TranslationError,
    anthropic_error,
    chat_to_message,
    chat_to_response,
    messages_to_chat,
    openai_error,
    responses_to_chat,
    sse,
)
from apps.gateway.translate.usage import StreamUsage, usage_from_response
from apps.gateway.upstream import ConnectError, Disconnected, Pool, ReadTimeout, UpstreamError

__all__ = ["GatewayApp", "gateway_app"]

log = logging.getLogger("llmgw.gateway")
# How often one gateway process tells the reconciler that every replica of a model is busy.
BUSY_NOTE_INTERVAL_S = 5.0
# A key or model the tables do not know is checked against the database's table version before
# it is refused, at most this often (so a flood of wrong keys costs one small query per interval).
MISS_RECHECK_S = 0.1

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

ROUTES = {
    ("POST", "/v1/chat/completions"): ("chat", "/v1/chat/completions"),
    ("POST", "/v1/completions"): ("completions", "/v1/completions"),
    ("POST", "/v1/embeddings"): ("embeddings", "/v1/embeddings"),
    ("POST", "/v1/messages"): ("messages", "/v1/chat/completions"),
    ("POST", "/v1/responses"): ("responses", "/v1/chat/completions"),
}
OPENAI_KINDS = {"authentication_error": "authentication_error", "rate_limit_error": "rate_limit_error",
                "not_found_error": "invalid_request_error", "permission_error": "permission_error"}
ENDPOINT_NAMES = {"chat": "chat.completions", "completions": "completions", "embeddings": "embeddings",
                  "messages": "messages", "responses": "responses"}


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class ClientGone(Exception):
    """The client went away before its request reached a replica."""


class Refused(Exception):
    def __init__(self, status: int, message: str, *, kind: str | None = None, headers: dict[str, str] | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.headers = headers or {}
        self.code = code


class Call:
    """One request on its way through the gateway, and what its usage record will say."""

    __slots__ = ("body", "completion_tokens", "endpoint", "entry", "error", "first_token_at", "model", "original",
                 "prompt_tokens", "request_id", "started", "status", "stream", "style", "tokens_estimated")

    def __init__(self, style: str) -> None:
        self.style = style
        self.request_id = "req_" + uuid.uuid4().hex
        self.started = time.perf_counter()
        self.entry: KeyEntry | None = None
        self.model = ""
        self.endpoint: Endpoint | None = None
        self.body: dict[str, Any] = {}
        self.original: dict[str, Any] = {}
        self.stream = False
        self.status = 200
        self.error = ""
        self.first_token_at: float | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.tokens_estimated = False


class GatewayApp:
    def __init__(self) -> None:
        self.tables = Tables()
        self.upstream: Pool | None = None
        self.limiter: Any = None
        self.usage: Any = None
        self.admission = Admission(max_waiting=int(_env_float("LLMGW_GATEWAY_QUEUE_MAX", 256)))
        self.queue_timeout = _env_float("LLMGW_GATEWAY_QUEUE_TIMEOUT", 30)
        self.cold_start_timeout = _env_float("LLMGW_GATEWAY_COLD_START_TIMEOUT", 120)
        self.max_body = int(_env_float("LLMGW_GATEWAY_MAX_BODY_BYTES", 32 * 1024 * 1024))
        self.refresh_interval = _env_float("LLMGW_GATEWAY_REFRESH_SECONDS", 1.0)
        self._started: asyncio.Future[None] | None = None
        self._refresh: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()
        self._busy_noted: dict[str, float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._miss_check: asyncio.Task[None] | None = None
        self._miss_checked_at = -math.inf

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
        from asgiref.sync import sync_to_async

        self.upstream = Pool(connect_timeout=5, read_timeout=_env_float("LLMGW_GATEWAY_READ_TIMEOUT", 600),
                             idle_timeout=60)
        self.tables = await sync_to_async(load_tables, thread_sensitive=False)(None)
        from django.conf import settings

        from apps.quotas.limiter import make_limiter
        from apps.quotas.usage import UsageWriter

        self.limiter = make_limiter()
        writer_kwargs: dict[str, Any] = {}
        if getattr(settings, "USAGE_WRITER", "worker") == "worker":
            from apps.quotas.usage import write_via_worker

            writer_kwargs["write"] = write_via_worker  # the worker does the ORM work, not this process
        self.usage = UsageWriter(**writer_kwargs)
        await self.usage.start()
        self._refresh = asyncio.create_task(self._refresh_loop(), name="gateway-refresh")

    async def shutdown(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresh
        if self.usage is not None:
            await self.usage.stop()
        if self.limiter is not None and hasattr(self.limiter, "close"):
            await self.limiter.close()
        if self.upstream is not None:
            await self.upstream.close()
        self._started = None

    async def _refresh_loop(self) -> None:
        from asgiref.sync import sync_to_async

        last_full = time.monotonic()
        while True:
            await asyncio.sleep(self.refresh_interval)
            try:
                version = await sync_to_async(current_version, thread_sensitive=False)()
                if version != self.tables.version or time.monotonic() - last_full > 30:
                    await self.reload()
                    last_full = time.monotonic()
            except Exception:
                log.warning("could not refresh the gateway's tables", exc_info=True)

    async def reload(self) -> None:
        from asgiref.sync import sync_to_async

        async with self._reload_lock:
            self.tables = await sync_to_async(load_tables, thread_sensitive=False)(self.tables)
        for name in self.tables.models:
            self.admission.released(name)

    async def confirm_miss(self) -> None:
        """Before a key or model the tables lack is refused: if the database has moved on since the
        tables were read (a key made, a model applied a moment ago), read them again now rather than
        at the next refresh. Requests that miss together wait on one check."""
        task = self._miss_check
        if task is None:
            if time.monotonic() - self._miss_checked_at < MISS_RECHECK_S:
                return
            task = self._miss_check = asyncio.create_task(self._check_version())
        await asyncio.shield(task)

    async def _check_version(self) -> None:
        from asgiref.sync import sync_to_async

        try:
            if await sync_to_async(current_version, thread_sensitive=False)() != self.tables.version:
                await self.reload()
        except Exception:
            log.warning("could not check the gateway's tables after a miss", exc_info=True)
        finally:
            self._miss_checked_at = time.monotonic()
            self._miss_check = None

    # ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await self.ensure_started()
        method, path = scope["method"], scope["path"].rstrip("/") or "/"
        if method == "GET" and path == "/v1/models":
            await self.list_models(scope, send)
            return
        route = ROUTES.get((method, path))
        if route is None:
            style = "messages" if path.startswith("/v1/messages") else "chat"
            # Every answer carries a request id, this one too (it was sent without one).
            await self.send_error(send, style, 404, f"No route for {method} {path}", request_id=Call(style).request_id)
            return
        await self.handle(route[0], route[1], scope, receive, send)

    async def handle(self, style: str, upstream_path: str, scope: dict[str, Any], receive: Receive,
                     send: Send) -> None:
        call = Call(style)
        metrics.IN_FLIGHT.inc()
        try:
            await self.serve(call, upstream_path, scope, receive, send)
        except Refused as exc:
            call.status, call.error = exc.status, exc.message
            await self.send_error(send, style, exc.status, exc.message, request_id=call.request_id,
                                  headers=exc.headers, kind=exc.kind, code=exc.code, endpoint=call.endpoint)
        except ClientGone:
            call.status, call.error = 499, "the client went away while waiting for a replica"
        except asyncio.CancelledError:
            call.status, call.error = 499, "the client went away"
            raise
        except Exception as exc:
            log.exception("request %s failed", call.request_id)
            call.status, call.error = 500, f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                await self.send_error(send, style, 500, "The gateway failed to handle this request.",
                                      request_id=call.request_id)
        finally:
            metrics.IN_FLIGHT.dec()
            self.finish(call)

    # One request -------------------------------------------------------------------------------

    async def serve(self, call: Call, upstream_path: str, scope: dict[str, Any], receive: Receive,
                    send: Send) -> None:
        call.entry = await self.authenticate(scope)
        raw = await self.read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise Refused(400, f"The body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise Refused(400, "The body must be a JSON object.")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise Refused(400, "Name the model in the body's “model” field.", code="missing_model")
        call.model = body["model"]
        call.original = body
        call.stream = bool(body.get("stream"))
        try:
            if call.style == "messages":
                chat = messages_to_chat(body)
            elif call.style == "responses":
                chat = responses_to_chat(body)
            else:
                chat = dict(body)
        except TranslationError as exc:
            raise Refused(400, str(exc), code=getattr(exc, "param", None)) from None
        chat.pop("_ignored", None)
        if isinstance(chat.get("temperature"), int | float) and not isinstance(chat["temperature"], bool):
            chat["temperature"] = min(2.0, max(0.0, float(chat["temperature"])))
        if call.stream and call.style != "embeddings":
            chat["stream"] = True
            options = chat.get("stream_options") if isinstance(chat.get("stream_options"), dict) else {}
            chat["stream_options"] = {**options, "include_usage": True}
        call.body = chat

        route = self.tables.models.get(call.model)
        if route is None:
            await self.confirm_miss()
            route = self.tables.models.get(call.model)
        if route is None:
            raise Refused(404, f"The model “{call.model}” does not exist.", kind="not_found_error",
                          code="model_not_found")
        assert call.entry is not None
        if call.entry.allowed_models is not None and call.model not in call.entry.allowed_models:
            raise Refused(403, f"This API key may not use the model “{call.model}”.", kind="permission_error",
                          code="model_not_allowed")
        await self.admit(call)
        endpoint = await self.acquire(call, route, receive)
        try:
            await self.forward(call, endpoint, upstream_path, receive, send)
        finally:
            # forward() may move the request to another replica when this one cannot be reached: it gives
            # this one's slot back itself and holds one on the other (call.endpoint), which is the slot to
            # release here. (Releasing `endpoint` again left it at -1 and the other one a slot short for good.)
            endpoint = call.endpoint or endpoint
            endpoint.outstanding -= 1
            self.admission.released(endpoint.model)

    async def authenticate(self, scope: dict[str, Any]) -> KeyEntry:
        raw = ""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                text = value.decode("latin-1")
                if text[:7].lower() == "bearer ":
                    raw = text[7:].strip()
            elif name == b"x-api-key" and not raw:
                raw = value.decode("latin-1").strip()
        if not raw:
            raise Refused(401, "Send an API key: “Authorization: Bearer llmgw_...” or “x-api-key”.",
                          kind="authentication_error", code="missing_api_key")
        hashed = key_hash(raw)
        entry = self.tables.keys.get(hashed)
        if entry is None:
            await self.confirm_miss()
            entry = self.tables.keys.get(hashed)
        if entry is None:
            raise Refused(401, "Invalid, revoked or expired API key.", kind="authentication_error",
                          code="invalid_api_key")
        if entry.expires_at is not None and entry.expires_at <= time.time():
            raise Refused(401, "API key expired.", kind="authentication_error", code="invalid_api_key")
        return entry

    async def read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise Refused(413, f"The body is over the limit of {self.max_body} bytes.",
                              kind="request_too_large")
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)

    async def admit(self, call: Call) -> None:
        if self.limiter is None or call.entry is None or not call.entry.limits:
            return
        refusal = await self.limiter.admit(list(call.entry.limits), time.time())
        if refusal is not None:
            raise Refused(429, refusal.message, kind="rate_limit_error", code="rate_limited",
                          headers={"retry-after": str(max(1, int(refusal.retry_after_s)))})

    async def acquire(self, call: Call, route: ModelRoute, receive: Receive | None = None) -> Endpoint:
        """A replica slot for the model, or for its fallbacks in order; wait (bounded) when all are full,
        and start a model kept at zero replicas on demand. A client that leaves while its request waits
        gives up its place at once (ClientGone), so it never takes a slot nobody will read."""
        key = affinity_key(call.body)
        deadline = time.monotonic() + self.queue_timeout
        demanded = False
        waiting = False
        watcher: asyncio.Task[None] | None = None
        try:
            while True:
                for name in [route.name, *route.fallbacks]:
                    candidate = self.tables.models.get(name)
                    if candidate is None:
                        continue
                    endpoint = choose(candidate.endpoints, key)
                    if endpoint is not None:
                        endpoint.outstanding += 1
                        call.endpoint = endpoint
                        return endpoint
                current = self.tables.models.get(route.name, route)
                if not current.endpoints and not demanded and current.min_replicas == 0 and not current.external:
                    demanded = True
                    await self.demand(route.name)
                    deadline = time.monotonic() + self.cold_start_timeout
                if not waiting:
                    if current.endpoints and current.max_replicas > len(current.endpoints):
                        self.note_busy(route.name)
                    if self.admission.full(route.name):
                        raise Refused(503, f"Too many requests are waiting for “{route.name}”; try again shortly.",
                                      kind="overloaded_error", headers={"retry-after": "5"})
                    self.admission.waiting[route.name] = self.admission.waiting.get(route.name, 0) + 1
                    metrics.QUEUE_DEPTH.labels(model=route.name).inc()
                    waiting = True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ready = len(current.endpoints)
                    reason = (f"every one of the {ready} ready replicas of “{route.name}” stayed busy for "
                              f"{self.queue_timeout:.0f} s") if ready else f"“{route.name}” has no ready replica"
                    raise Refused(503, f"No capacity: {reason}.", kind="overloaded_error",
                                  headers={"retry-after": "10"})
                event = self.admission.event(route.name)
                if receive is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(event.wait(), min(remaining, 1.0))
                    continue
                if watcher is None:  # only a request that waits pays for watching its client
                    watcher = asyncio.create_task(self._watch_disconnect(receive))
                released = asyncio.create_task(event.wait())
                try:
                    await asyncio.wait({released, watcher}, timeout=min(remaining, 1.0),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    released.cancel()
                if watcher.done():
                    raise ClientGone
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            if waiting:
                self.admission.waiting[route.name] -= 1
                metrics.QUEUE_DEPTH.labels(model=route.name).dec()

    def note_busy(self, model: str) -> None:
        """Every replica of a model that may grow is busy: tell the reconciler, at most every few seconds
        per model from this process, in the background (the waiting request does not wait for it)."""
        moment = time.monotonic()
        if moment - self._busy_noted.get(model, -math.inf) < BUSY_NOTE_INTERVAL_S:
            return
        self._busy_noted[model] = moment
        task = asyncio.create_task(self._record_busy(model))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record_busy(self, model: str) -> None:
        def record() -> None:
            from apps.catalog.services import record_busy

            record_busy(model)

        await self._in_thread(record, f"report that {model} is busy")

    async def demand(self, model: str) -> None:
        def record() -> None:
            from apps.catalog.services import record_demand

            record_demand(model)

        await self._in_thread(record, f"ask for a replica of {model}")

    @staticmethod
    async def _in_thread(func: Callable[[], object], what: str) -> None:
        """Run a database service off the event loop; a failure is logged, never the request's."""
        from asgiref.sync import sync_to_async

        try:
            await sync_to_async(func, thread_sensitive=False)()
        except Exception:
            log.warning("could not %s", what, exc_info=True)

    # Upstream ------------------------------------------------------------------------------------

    async def forward(self, call: Call, endpoint: Endpoint, upstream_path: str, receive: Receive, send: Send) -> None:
        """Call the upstream and relay its answer; a client that goes away at any point (waiting for
        the answer, or mid-stream) cancels the upstream request, which ends the engine's work."""
        watcher = asyncio.create_task(self._watch_disconnect(receive))
        work = asyncio.create_task(self._forward(call, endpoint, upstream_path, send))
        try:
            done, _pending = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                call.status, call.error = 499, "the client went away; the upstream request was cancelled"
                return
            work.result()
        finally:
            watcher.cancel()

    async def _forward(self, call: Call, endpoint: Endpoint, upstream_path: str, send: Send) -> None:
        assert self.upstream is not None
        tried: set[str] = set()
        while True:
            body = dict(call.body)
            body["model"] = endpoint.upstream_model
            headers = [("Content-Type", "application/json"), ("x-llmgw-request-id", call.request_id)]
            secret = endpoint.api_key()
            if secret:
                headers.append(("Authorization", f"Bearer {secret}"))
            try:
                response = await self.upstream.post(endpoint.url + upstream_path, json.dumps(body).encode(), headers)
            except (ConnectError, Disconnected) as exc:
                # A replica that cannot be reached: mark it and try another (never the same twice).
                endpoint.failed_until = time.monotonic() + 5
                tried.add(endpoint.id)
                log.warning("replica %s of %s unreachable: %s", endpoint.id, endpoint.model, exc)
                route = self.tables.models.get(call.model)
                other = choose(route.endpoints, None, exclude=tried) if route else None
                if other is None:
                    raise Refused(502, f"The replica of “{call.model}” could not be reached: {exc}",
                                  kind="api_error") from None
                endpoint.outstanding -= 1
                self.admission.released(endpoint.model)
                other.outstanding += 1
                endpoint = other
                call.endpoint = other
                continue
            except UpstreamError as exc:
                raise _upstream_refusal(call, exc) from None
            break
        async with response:
            if call.stream and response.status == 200:
                await self.relay_stream(call, endpoint, response, send)
            else:
                try:
                    raw = await response.read()
                except UpstreamError as exc:
                    raise _upstream_refusal(call, exc) from None
                await self.relay_whole(call, endpoint, response.status, raw, send)

    @staticmethod
    async def _watch_disconnect(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    def headers(self, call: Call, endpoint: Endpoint | None, content_type: bytes) -> list[tuple[bytes, bytes]]:
        headers = [(b"content-type", content_type), (b"x-llmgw-request-id", call.request_id.encode())]
        if endpoint is not None:
            headers.append((b"x-llmgw-replica", f"{endpoint.model}/{endpoint.id}".encode()))
            headers.append((b"x-llmgw-hardware", endpoint.hardware.encode()))
        return headers

    async def relay_whole(self, call: Call, endpoint: Endpoint, status: int, raw: bytes, send: Send) -> None:
        call.first_token_at = time.perf_counter()
        if status != 200:
            call.status = status
            message = _upstream_message(raw) or f"the upstream answered {status}"
            call.error = message
            raise Refused(status, message, kind=None)
        try:
            data = json.loads(raw)
        except ValueError:
            raise Refused(502, "The upstream's answer is not JSON.", kind="api_error") from None
        usage = usage_from_response(data, "chat") if call.style != "embeddings" else None
        if call.style == "embeddings" and isinstance(data.get("usage"), dict):
            call.prompt_tokens = data["usage"].get("prompt_tokens")
        if usage is not None:
            call.prompt_tokens, call.completion_tokens = usage.input_tokens, usage.output_tokens
        if call.style == "messages":
            out = json.dumps(chat_to_message(data, call.model)).encode()
        elif call.style == "responses":
            out = json.dumps(chat_to_response(data, request=call.original, response_id="resp_" + call.request_id[4:],
                                              created_at=int(time.time()))).encode()
        elif isinstance(data, dict) and data.get("model", call.model) != call.model:
            data["model"] = call.model  # the caller's name for the model, not the provider's
            out = json.dumps(data).encode()
        else:
            out = raw
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*self.headers(call, endpoint, b"application/json"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    async def relay_stream(self, call: Call, endpoint: Endpoint, response: Any, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*self.headers(call, endpoint, b"text/event-stream"), (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        translator: Any = None
        if call.style == "messages":
            translator = ChatToAnthropicStream(call.model)
        elif call.style == "responses":
            translator = ChatToResponsesStream(call.original, "resp_" + call.request_id[4:], int(time.time()))
        counter = StreamUsage("chat")
        if translator is not None:
            await send({"type": "http.response.body", "body": _sse_all(translator.start()), "more_body": True})
        buffer = b""
        finished = False
        try:
            async for chunk in response.iter_chunks():
                buffer += chunk
                out: list[bytes] = []
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    payload = _sse_data(event)
                    if payload is None:
                        if translator is None:
                            out.append(event + b"\n\n")
                        continue
                    if payload == b"[DONE]":
                        finished = True
                        if translator is None:
                            out.append(event + b"\n\n")
                        continue
                    try:
                        data = json.loads(payload)
                    except ValueError:
                        continue
                    if call.first_token_at is None and _has_token(data):
                        call.first_token_at = time.perf_counter()
                    counter.feed(data)
                    if translator is None:
                        if isinstance(data, dict) and data.get("model") and data.get("model") != call.model:
                            data["model"] = call.model
                            out.append(b"data: " + json.dumps(data).encode() + b"\n\n")
                        else:
                            out.append(event + b"\n\n")
                    else:
                        out.append(_sse_all(translator.feed(data)))
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        except Exception as exc:  # the upstream died mid-stream
            if isinstance(exc, asyncio.CancelledError):
                raise
            finished = False
            call.error = f"the upstream stream broke: {type(exc).__name__}: {exc}"
        usage = counter.usage
        if usage is not None:
            call.prompt_tokens, call.completion_tokens = usage.input_tokens, usage.output_tokens
            call.tokens_estimated = bool(getattr(usage, "estimated", False))
        if finished or (translator is not None and translator.finish_reason is not None):
            tail = _sse_all(translator.finish()) if translator is not None else b""
        else:
            call.status = 502
            call.error = call.error or "the upstream ended the stream before it finished"
            if translator is not None:
                tail = _sse_all(translator.fail(call.error))
            else:
                tail = b"data: " + json.dumps(openai_error(502, call.error, "api_error")).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    # Answers ----------------------------------------------------------------------------------------

    async def list_models(self, scope: dict[str, Any], send: Send) -> None:
        call = Call("chat")
        try:
            entry = await self.authenticate(scope)
        except Refused as exc:
            await self.send_error(send, "chat", exc.status, exc.message, request_id=call.request_id, code=exc.code)
            return
        data = []
        for name, route in sorted(self.tables.models.items()):
            if entry.allowed_models is not None and name not in entry.allowed_models:
                continue
            data.append({"id": name, "object": "model", "created": 0, "owned_by": "llmgw",
                         "llmgw": {"hardware": route.hardware, "ready_replicas": len(route.endpoints)}})
        out = json.dumps({"object": "list", "data": data}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*self.headers(call, None, b"application/json"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    async def send_error(self, send: Send, style: str, status: int, message: str, *, request_id: str | None,
                         headers: dict[str, str] | None = None, kind: str | None = None, code: str | None = None,
                         endpoint: Endpoint | None = None) -> None:
        if style == "messages":
            body = anthropic_error(status, message, kind)
        else:
            openai_kind = OPENAI_KINDS.get(kind or "")
            body = openai_error(status, message, openai_kind, None, code)
        out = json.dumps(body).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        if request_id:
            head.append((b"x-llmgw-request-id", request_id.encode()))
        if endpoint is not None:
            head.append((b"x-llmgw-replica", f"{endpoint.model}/{endpoint.id}".encode()))
            head.append((b"x-llmgw-hardware", endpoint.hardware.encode()))
        head += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": head})
        await send({"type": "http.response.body", "body": out})

    def finish(self, call: Call) -> None:
        """Count the request and queue its usage record (never written inline)."""
        elapsed = time.perf_counter() - call.started
        first = (call.first_token_at - call.started) if call.first_token_at is not None else None
        # Labelled by the model only when it exists: a name made up by a caller must not make a new series.
        label = call.model if call.model in self.tables.models else "-"
        metrics.observe(label, call.status, elapsed, first, call.prompt_tokens, call.completion_tokens)
        if call.entry is None or self.usage is None:
            return
        tokens = (call.prompt_tokens or 0) + (call.completion_tokens or 0)
        if self.limiter is not None and call.entry.limits and tokens and call.status < 400:
            task = asyncio.get_running_loop().create_task(
                self.limiter.record_tokens(list(call.entry.limits), tokens, time.time()))
            task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
        endpoint = call.endpoint
        if call.status == 429:
            call.prompt_tokens = call.completion_tokens = 0  # refused by a limit: recorded, free of charge
        self.usage.emit({
            "request_id": call.request_id, "created_at": time.time(), "user_id": call.entry.user_id,
            "api_key_id": call.entry.key_id,
            "organization_id": call.entry.org_id, "team_id": call.entry.team_id, "project_id": call.entry.project_id,
            "model": call.model[:128], "endpoint": ENDPOINT_NAMES.get(call.style, call.style),
            "replica": f"{endpoint.node}/{endpoint.id}" if endpoint else "", "hardware": endpoint.hardware if endpoint
            else "", "stream": call.stream, "prompt_tokens": call.prompt_tokens,
            "completion_tokens": call.completion_tokens, "tokens_estimated": call.tokens_estimated,
            "first_token_ms": first * 1000 if first is not None else None, "total_ms": elapsed * 1000,
            "status": call.status, "error": call.error[:2000],
        })


def _sse_data(event: bytes) -> bytes | None:
    data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def _sse_all(events: list[tuple[str, Any]]) -> bytes:
    return b"".join(sse(name, data) for name, data in events)


def _has_token(chunk: Any) -> bool:
    if not isinstance(chunk, dict):
        return False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content") or choice.get("text"):
            return True
    return False


def _upstream_refusal(call: Call, exc: UpstreamError) -> Refused:
    """The answer for an upstream that was reached but whose answer could not be read."""
    if isinstance(exc, ReadTimeout):
        return Refused(504, f"The replica of “{call.model}” did not answer in time: {exc}.", kind="api_error")
    return Refused(502, f"The replica of “{call.model}” failed to answer: {exc}.", kind="api_error")


def _upstream_message(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace")
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict):
            return str(error.get("message") or error)
        if isinstance(error, str):
            return error
        return str(data.get("detail") or data.get("message") or "")[:300]
    return ""


gateway_app = GatewayApp()
