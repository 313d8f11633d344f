"""The /v1 gateway: a plain ASGI application mounted ahead of Django in llmgw/asgi.py.

Nothing here touches the ORM while serving a request. Keys, limits and routes live in memory
(apps.gateway.tables), reloaded in a thread when the table version moves and every
LLMGW_GATEWAY_RELOAD_SECONDS. A request goes through these stages, each in its own module:

1. intake: which endpoint, the API key, the body (apps.gateway.intake);
2. admission: the caller's limits (apps.quotas.limiter), then a slot on an upstream, waiting
   in the model's queue when all are taken (apps.gateway.slots, apps.gateway.routing);
3. forwarding and relaying: the engine is asked in chat completions and its answer, whole or
   streamed, is written in the client's protocol (apps.gateway.relay, apps.gateway.translate);
4. errors in the client's protocol (apps.gateway.errors);
5. accounting: metrics, the token charge and the usage record (apps.gateway.accounting).

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
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from apps.gateway import tracing
from apps.gateway.accounting import CANCELLED, Accountant
from apps.gateway.errors import Refused, send_error
from apps.gateway.guard import (
    OFF_LOOP_CHUNK_BYTES,
    GuardUnavailable,
    answer_text,
    check_request,
    guard_prompt,
    guard_refusal,
    guard_unavailable,
    prompt_chars,
    prompt_text,
    run_checked,
)
from apps.gateway.intake import (
    COUNT_TOKENS,
    ENDPOINTS,
    MESSAGES,
    MODELS,
    BodyBudget,
    Call,
    ClientLeft,
    Endpoint,
    api_key,
    check_fits,
    check_size,
    parse_body,
    read_body,
)
from apps.gateway.relay import StreamRelay, translator_for, whole_answer
from apps.gateway.routing import affinity_key, preference
from apps.gateway.slots import Lease, QueueFull, SharedSlots, SlotKeeper, WaitingRoom
from apps.gateway.tables import (
    KeyEntry,
    ModelRoute,
    Stopped,
    Tables,
    Upstream,
    current_version,
    key_hash,
    load_tables,
    tables_channel,
)
from apps.gateway.tokens import count_prompt_tokens
from apps.gateway.translate import TranslationError, messages_to_chat, responses_to_chat
from apps.gateway.upstream import ConnectError, Disconnected, Pool, ProxyConfig, ReadTimeout, UpstreamError
from apps.quotas.limiter import Refusal

__all__ = ["GatewayApp", "gateway_app"]

log = logging.getLogger("llmgw.gateway")
# How often one gateway process tells the reconciler that every replica of a model is busy.
BUSY_NOTE_INTERVAL_S = 5.0
# A key or model the tables do not know is checked against the database's table version before
# it is refused, at most this often (so a flood of wrong keys costs one small query per interval).
MISS_RECHECK_S = 0.1
# How long an upstream that could not be reached is passed over.
UNREACHABLE_S = 5.0
# How long a replica seen stopping is remembered after it left the tables (its engine gone and its
# row released), so that a request it held is still told why it ended.
STOPPED_MEMORY_S = 600.0
# How long an Anthropic stream's first event waits for the engine to count the prompt.
PROMPT_COUNT_WAIT_S = 2.0
# A guard model judging a streamed answer is asked about it each time this many more characters
# have passed (about 250 tokens), besides its end.
JUDGE_EVERY = 1000

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class GatewayApp:
    def __init__(self) -> None:
        from django.conf import settings

        self.tables = Tables()
        self.upstream: Pool | None = None  # engines on the nodes: never through a proxy
        self.providers: Pool | None = None  # external providers: HTTPS_PROXY/NO_PROXY, LLMGW_PROVIDER_CA_BUNDLE
        self.limiter: Any = None
        self.usage: Any = None
        self.shared: SharedSlots | None = None
        self.keeper = SlotKeeper()
        self.waiting = WaitingRoom(settings.GATEWAY_QUEUE_MAX)
        self.keeper.on_release = self.waiting.released
        self.queue_timeout = settings.GATEWAY_QUEUE_TIMEOUT
        self.cold_start_timeout = settings.GATEWAY_COLD_START_TIMEOUT
        self.max_body = settings.GATEWAY_MAX_BODY_BYTES
        self.bodies = BodyBudget(settings.GATEWAY_BODY_MEMORY_BYTES)
        self.max_messages = settings.GATEWAY_MAX_MESSAGES
        self.max_parts = settings.GATEWAY_MAX_PARTS
        self.refresh_interval = settings.GATEWAY_REFRESH_SECONDS
        self.reload_interval = settings.GATEWAY_RELOAD_SECONDS
        self.accountant = Accountant(
            usage=None, limiter=None, known_model=self.tables_know, count_prompt=self.count_prompt
        )
        self._started: asyncio.Future[None] | None = None
        self._refresh: asyncio.Task[None] | None = None
        self._reload_lock = asyncio.Lock()
        self._busy_noted: dict[str, float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._miss_check: asyncio.Task[None] | None = None
        self._miss_checked_at = -math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._listener: asyncio.Task[None] | None = None
        # Replicas seen stopping, by id, with when they were last seen so (see STOPPED_MEMORY_S).
        self._stopped: dict[str, tuple[Stopped, float]] = {}
        # Set when this process is stopping and the grace of its requests in flight ran out.
        self.closing: str | None = None
        self._stop_timer: asyncio.TimerHandle | None = None

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
        from django.conf import settings

        from apps.quotas.journal import Journal
        from apps.quotas.limiter import make_limiter
        from apps.quotas.usage import UsageWriter

        self.upstream = Pool(
            connect_timeout=5, read_timeout=settings.GATEWAY_READ_TIMEOUT, idle_timeout=60, proxies=ProxyConfig()
        )
        self.providers = Pool(
            connect_timeout=10,
            read_timeout=settings.GATEWAY_READ_TIMEOUT,
            idle_timeout=60,
            ca_bundle=settings.PROVIDER_CA_BUNDLE or None,
            proxies=ProxyConfig.from_env(),
        )
        self.limiter = make_limiter()
        tracing.configure()
        writer_kwargs: dict[str, Any] = {}
        if getattr(settings, "USAGE_WRITER", "worker") == "worker":
            from apps.quotas.usage import write_via_worker

            writer_kwargs["write"] = write_via_worker  # the worker does the ORM work, not this process
            # ... and what it has not written a minute later (a broker that lost it) is written here.
            writer_kwargs["confirm_after"] = 60.0
        # Every record is on local disk before the answer's last byte is sent (apps/quotas/journal.py).
        writer_kwargs["journal"] = Journal(settings.DATA_DIR / "usage-journal")
        self.usage = UsageWriter(**writer_kwargs)
        await self.usage.start()
        self.accountant.usage, self.accountant.limiter = self.usage, self.limiter
        if settings.REDIS_URL:
            self.share_slots(settings.REDIS_URL, settings.GATEWAY_SLOT_LEASE_SECONDS)
        tables = await sync_to_async(load_tables, thread_sensitive=False)()
        self.use(tables)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._refresh = asyncio.create_task(self._refresh_loop(), name="gateway-refresh")
        if settings.REDIS_URL:
            from apps.quotas.resp import subscribe

            self._listener = asyncio.create_task(
                subscribe(settings.REDIS_URL, tables_channel(), lambda _message: self.wake()), name="gateway-tables"
            )

    def wake(self) -> None:
        """The tables changed (a key revoked, a model deleted): read them now."""
        if self._wake is not None:
            self._wake.set()

    def wake_from_thread(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.wake)

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
        shared.on_released = self.waiting.released
        self.shared = self.keeper.shared = self.waiting.shared = shared
        shared.start()

    async def shutdown(self) -> None:
        for task in (self._refresh, self._listener):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._loop = None
        await self.accountant.drain()
        if self.shared is not None:
            await self.shared.stop()
            self.shared = self.keeper.shared = self.waiting.shared = None
        if self.usage is not None:
            await self.usage.stop()
        if self.limiter is not None and hasattr(self.limiter, "close"):
            await self.limiter.close()
        for pool in (self.upstream, self.providers):
            if pool is not None:
                await pool.close()
        self._started = None

    async def _refresh_loop(self) -> None:
        from asgiref.sync import sync_to_async

        last_full = time.monotonic()
        while True:
            wake = self._wake
            if wake is None:
                await asyncio.sleep(self.refresh_interval)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), self.refresh_interval)
            try:
                if wake is not None and wake.is_set():
                    await self.reload_announced()
                version = await sync_to_async(current_version, thread_sensitive=False)()
                if version != self.tables.version or time.monotonic() - last_full > self.reload_interval:
                    await self.reload()
                    last_full = time.monotonic()
            except Exception:
                log.warning("could not refresh the gateway's tables", exc_info=True)

    async def reload(self) -> None:
        from asgiref.sync import sync_to_async

        async with self._reload_lock:
            tables = await sync_to_async(load_tables, thread_sensitive=False)()
            self.use(tables)
        self.waiting.wake_all()  # new upstreams may have come: waiters look again

    async def reload_announced(self) -> None:
        """Read the tables now if a change was announced and no reload has read it yet."""
        wake = self._wake
        if wake is None or not wake.is_set():
            return
        async with self._reload_lock:
            if not wake.is_set():
                return  # another request (or the refresh loop) just read them
            wake.clear()
            tables = await sync_to_async_load()
            self.use(tables)
        self.waiting.wake_all()

    def use(self, tables: Tables) -> None:
        """Route by these tables from now on, and remember the replicas they list as stopping."""
        self.keeper.bind(tables)
        self.tables = tables
        now = time.monotonic()
        for replica_id, stopped in tables.stopping.items():
            self._stopped[replica_id] = (stopped, now)
        for replica_id, (_stopped, seen) in list(self._stopped.items()):
            if now - seen > STOPPED_MEMORY_S:
                del self._stopped[replica_id]

    def stop_reason(self, upstream: Upstream | None) -> str | None:
        """Why a request to this upstream was cut off, when it was by a stop: this process's own
        (its grace ran out) or the replica's (its drain grace ran out); None otherwise."""
        if self.closing is not None:
            return self.closing
        if upstream is None:
            return None
        seen = self._stopped.get(upstream.id)
        return seen[0].message() if seen is not None else None

    def begin_stop(self) -> None:
        """This process is stopping (uvicorn takes no new connection and waits for those open): the
        requests in flight get LLMGW_DRAIN_GRACE_SECONDS; then each still running ends with an error
        naming the reason. Called once per connection open at the stop; the first call counts."""
        from django.conf import settings

        loop = self._loop
        if self._stop_timer is not None or loop is None or loop.is_closed():
            return
        self._stop_timer = loop.call_later(settings.DRAIN_GRACE, self._grace_over, settings.DRAIN_GRACE)

    def _grace_over(self, grace: int) -> None:
        self.closing = (
            f"the gateway was stopped: its drain grace of {grace} s ran out (this llmgw web process is stopping)"
        )
        cut = sum(pool.abort(self.closing) for pool in (self.upstream, self.providers) if pool is not None)
        if cut:
            log.warning("stopping: %s request(s) still in flight after %s s were ended", cut, grace)

    def tables_know(self, model: str) -> bool:
        return model in self.tables.models

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
        if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
            await self.models(scope, send, path[len("/v1/models/") :] if path != "/v1/models" else None)
            return
        endpoint = ENDPOINTS.get((method, path))
        if endpoint is None:
            # Every answer carries a request id, this one too.
            protocol = "anthropic" if path.startswith("/v1/messages") else "openai"
            call = Call(MODELS)
            await send_error(
                send,
                protocol,
                Refused(404, f"No route for {method} {path}", kind="invalid_request_error", code="unknown_url"),
                self.head(call),
            )
            return
        await self.handle(endpoint, scope, receive, send)

    async def handle(self, endpoint: Endpoint, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        call = Call(endpoint)
        accounted = False

        async def answer(message: dict[str, Any]) -> None:
            """The answer's last message goes out only once the request is accounted for: its usage
            record is then in this process's journal, and a kill at any moment after loses nothing."""
            nonlocal accounted
            if not accounted and message["type"] == "http.response.body" and not message.get("more_body"):
                accounted = True
                self.accountant.finish(call)
            await send(message)

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
            with contextlib.suppress(Exception):
                await send_error(
                    answer,
                    endpoint.protocol,
                    Refused(500, "The gateway failed to handle this request."),
                    self.head(call),
                )
        finally:
            if call.lease is not None:
                self.keeper.release(call.lease)
            self.bodies.give(call.body_bytes)
            if not accounted:  # no last byte was sent: the client left, or the answer broke off
                self.accountant.finish(call)

    # Intake and admission ----------------------------------------------------------------------

    async def serve(self, call: Call, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if self._wake is not None and self._wake.is_set():
            await self.reload_announced()  # a change was announced: route by the tables after it
        call.entry = await self.authenticate(scope)
        if tracing.exporter() is not None:
            call.traceparent = next(
                (v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"traceparent"), None
            )
        body = parse_body(await read_body(receive, self.max_body, self.bodies, call))
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise Refused(400, "Name the model in the body's “model” field.", code="missing_model")
        if "\x00" in body["model"]:  # no model's name holds one, and no usage record could keep it
            raise Refused(
                400,
                "The “model” field holds a NUL character (U+0000), which no model name can contain.",
                code="invalid_model",
                param="model",
            )
        endpoint = call.endpoint
        call.model = body["model"]
        call.original = body
        call.stream = endpoint.streams and body.get("stream") is True
        call.body = self.chat_request(call, body)

        route = self.tables.models.get(call.model)
        if route is None:
            await self.confirm_miss()
            route = self.tables.models.get(call.model)
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
        policies = self.tables.guards.for_call(call.entry, call.model) if self.tables.guards else None
        if policies is not None:
            await run_checked(prompt_chars(call.body), check_request, call, policies)
            if policies.guard_prompts:
                await _unless_client_leaves(self.judge_prompt(call, policies.guard_prompts), receive)
        check_size(call.body, most_messages=self.max_messages, most_parts=self.max_parts)
        contexts = [u.context_size for u in route.upstreams if u.context_size]
        check_fits(call.body, min(contexts) if contexts and len(contexts) == len(route.upstreams) else None)
        await self.admit(call)
        if endpoint is COUNT_TOKENS:
            await self.count_tokens(call, route, send)
            return
        call.queued_at = time.perf_counter()
        lease = await self.acquire(call, route, receive)
        if lease is None:  # cannot happen without exclusions; kept for the type checker
            raise Refused(503, f"No replica of “{call.model}” can take the request.", kind="overloaded_error")
        call.lease = lease
        call.leased_at = time.perf_counter()
        await self.forward(call, route, receive, send)

    async def judge_prompt(self, call: Call, rules: list[Any]) -> None:
        """The guard models' verdicts on the prompt, in the rules' order: refused when one holds it."""
        for rule in rules:
            held = await self.judge(call, rule)
            if held is not None:
                finding, unsafe, detail = held
                model = rule.models[0]
                raise guard_refusal(finding, model, detail) if unsafe else guard_unavailable(finding, model, detail)

    async def judge_answer(self, call: Call, answer: str, *, final: bool = True) -> Any:
        """The guard models' verdicts on an answer: the finding that stops it, or None. A check while
        it streams (not `final`) stops it only on an unsafe verdict, and records only that."""
        guard = call.answer_guard
        for rule in guard.policies.guard_answers if guard is not None else ():
            held = await self.judge(call, rule, answer, final=final)
            if held is not None:
                return held[0]
        return None

    async def judge(
        self, call: Call, rule: Any, answer: str | None = None, *, final: bool = True
    ) -> tuple[Any, bool, str] | None:
        """Ask a rule's guard model (a model llmgw serves, hosted or external) for its verdict on the
        prompt, or on the answer when one is given, within the rule's time. None when the request (or
        answer) goes on; else (finding, unsafe, detail): judged unsafe (detail: the model's answer) or
        no verdict from a rule that fails closed (detail: why). Every outcome is on the call's record."""
        from apps.guardrails.engine import GUARD_TIMEOUT_MS, Finding, guard_verdict

        model = rule.models[0]
        holds = rule.action != "log"
        acted = ("stop" if answer is not None else "refuse") if holds else "log"
        finding = Finding(rule.policy, rule.name, rule.kind, acted)
        where = {"where": "answer"} if answer is not None else {}
        timeout = (rule.limit or GUARD_TIMEOUT_MS) / 1000
        try:
            said = await asyncio.wait_for(self._guard_answer(call, model, answer), timeout)
            verdict = guard_verdict(said)
            if verdict is None:
                raise GuardUnavailable(f"it answered neither safe nor unsafe: {said[:60]!r}")
        except (TimeoutError, GuardUnavailable) as exc:
            why = f"no answer within {timeout * 1000:.0f} ms" if isinstance(exc, TimeoutError) else str(exc)
            if not final:
                return None  # a check while the answer streams: its end is judged again, and recorded
            closed = holds and not rule.fail_open
            call.guard.append({**finding.to_dict(), **where, "action": acted if closed else "log", "error": why})
            return (finding, False, why) if closed else None
        if not verdict or (not final and not holds):
            return None  # safe; or a logging rule's verdict while the answer streams (its end is recorded)
        call.guard.append({**finding.to_dict(), **where})
        return (finding, True, said) if holds else None

    async def _guard_answer(self, call: Call, model: str, answer: str | None) -> str:
        route = self.tables.models.get(model)
        if route is None or not route.upstreams:
            raise GuardUnavailable(f"“{model}” has no replica ready" if route else f"“{model}” is not in the catalog")
        lease = await self.keeper.acquire(route.upstreams, None)
        if lease is None:
            raise GuardUnavailable(f"every replica of “{model}” is busy")
        try:
            upstream = lease.upstream
            body = {
                "model": upstream.upstream_model,
                "messages": guard_prompt(prompt_text(call.body), answer),
                "max_tokens": 16,
                "temperature": 0,
            }
            headers = [("Content-Type", "application/json"), ("x-llmgw-request-id", call.request_id)]
            secret = upstream.api_key()
            if secret:
                headers.append(("Authorization", f"Bearer {secret}"))
            try:
                response = await self.pool_for(upstream).post(
                    upstream.url + "/v1/chat/completions", json.dumps(body).encode(), headers
                )
                async with response:
                    raw = await response.read()
            except (ConnectError, Disconnected, UpstreamError) as exc:
                raise GuardUnavailable(f"it could not be asked: {exc}") from None
            if response.status != 200:
                raise GuardUnavailable(f"it answered {response.status}")
            try:
                return str(json.loads(raw)["choices"][0]["message"]["content"] or "")
            except (ValueError, KeyError, IndexError, TypeError):
                raise GuardUnavailable("its answer is not a chat completion") from None
        finally:
            self.keeper.release(lease)

    def chat_request(self, call: Call, body: dict[str, Any]) -> dict[str, Any]:
        """What the engine is asked: the body itself, or its translation to chat completions."""
        endpoint = call.endpoint
        try:
            if endpoint.translation == "messages":
                chat = messages_to_chat(body if endpoint is not COUNT_TOKENS else {"max_tokens": 1, **body})
            elif endpoint.translation == "responses":
                chat = responses_to_chat(body)
            else:
                chat = dict(body)
        except TranslationError as exc:
            raise Refused(400, str(exc), kind="invalid_request_error", param=exc.param) from None
        chat.pop("_ignored", None)
        temperature = chat.get("temperature")
        if isinstance(temperature, int | float) and not isinstance(temperature, bool):
            chat["temperature"] = min(2.0, max(0.0, float(temperature)))
        if call.stream:
            options = body.get("stream_options")
            if not isinstance(options, dict):
                options = {}
            call.client_wants_usage = endpoint.translation is None and options.get("include_usage") is True
            chat["stream"] = True
            # Always asked for, for the gateway's own accounting; relayed only when the client asked.
            chat["stream_options"] = {**(chat.get("stream_options") or {}), "include_usage": True}
        elif endpoint.translation is None:
            chat.pop("stream_options", None)
        return chat

    async def authenticate(self, scope: dict[str, Any]) -> KeyEntry:
        hashed = key_hash(api_key(scope.get("headers", [])))
        entry = self.tables.keys.get(hashed)
        if entry is None:
            await self.confirm_miss()
            entry = self.tables.keys.get(hashed)
        if entry is None:
            raise Refused(
                401, "Invalid, revoked or expired API key.", kind="authentication_error", code="invalid_api_key"
            )
        if entry.expires_at is not None and entry.expires_at <= time.time():
            raise Refused(401, "API key expired.", kind="authentication_error", code="invalid_api_key")
        return entry

    async def admit(self, call: Call) -> None:
        if self.limiter is None or call.entry is None or not call.entry.limits:
            return
        refusal = await self.limiter.admit(list(call.entry.limits), time.time())
        if isinstance(refusal, Refusal):
            raise Refused(
                429,
                refusal.message,
                kind="rate_limit_error",
                code="rate_limited",
                headers={"retry-after": str(max(1, int(refusal.retry_after_s)))},
            )

    async def acquire(
        self, call: Call, route: ModelRoute, receive: Receive | None, *, exclude: frozenset[str] = frozenset()
    ) -> Lease | None:
        """A slot for the model, or for the fallbacks the key may use, in order; wait (bounded)
        when all are full, and start a model kept at zero replicas on demand, even while a
        fallback serves. A model that cannot be placed anywhere, with nothing starting, is refused
        at once with placement's reason. None only when every upstream left is in `exclude`.

        A client that leaves while its request waits gives up its place at once (ClientLeft)."""
        assert call.entry is not None
        key = affinity_key(call.body)
        names = [route.name, *(f for f in route.fallbacks if f != route.name and call.entry.may_use(f))]
        deadline = time.monotonic() + self.queue_timeout
        demanded = False
        ticket: str | None = None
        waiting = False
        watcher: asyncio.Task[None] | None = None
        try:
            while True:
                current = self.tables.models.get(route.name, route)
                if (
                    not demanded
                    and not current.upstreams
                    and not current.starting
                    and current.min_replicas == 0
                    and not current.external
                ):
                    demanded = True
                    self._spawn(self.demand(route.name))
                    deadline = max(deadline, time.monotonic() + self.cold_start_timeout)
                routes = [r for r in (self.tables.models.get(n) for n in names) if r is not None]
                for candidate in routes:
                    if candidate.upstreams:
                        lease = await self.keeper.acquire(candidate.upstreams, key, exclude=exclude, ticket=ticket)
                        if lease is not None:
                            return lease
                if exclude and not any(r.starting or any(u.id not in exclude for u in r.upstreams) for r in routes):
                    return None
                if not any(r.upstreams or r.starting for r in routes) and current.unplaceable:
                    raise Refused(
                        503,
                        f"“{route.name}” cannot be served now: no node can take it ({current.unplaceable}).",
                        kind="overloaded_error",
                        code="model_unplaceable",
                        headers={"retry-after": "30"},
                    )
                if not waiting:
                    if current.upstreams and current.max_replicas > len(current.upstreams):
                        self.note_busy(route.name)
                    try:
                        ticket = await self.waiting.enter(route.name)
                    except QueueFull:
                        raise Refused(
                            503,
                            f"Too many requests are waiting for “{route.name}” (the queue holds "
                            f"{self.waiting.most}); try again shortly.",
                            kind="overloaded_error",
                            headers={"retry-after": "5"},
                        ) from None
                    waiting = True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ready = len(current.upstreams)
                    reason = (
                        (
                            f"every one of the {ready} ready replicas of “{route.name}” stayed busy for "
                            f"{self.queue_timeout:g} s"
                        )
                        if ready
                        else f"“{route.name}” has no ready replica"
                    )
                    raise Refused(
                        503, f"No capacity: {reason}.", kind="overloaded_error", headers={"retry-after": "10"}
                    )
                event = self.waiting.event(route.name)
                if receive is None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(event.wait(), min(remaining, 1.0))
                    continue
                if watcher is None:  # only a request that waits pays for watching its client
                    watcher = asyncio.create_task(_watch_disconnect(receive))
                released = asyncio.create_task(event.wait())
                try:
                    await asyncio.wait(
                        {released, watcher}, timeout=min(remaining, 1.0), return_when=asyncio.FIRST_COMPLETED
                    )
                finally:
                    released.cancel()
                if watcher.done():
                    raise ClientLeft("the client went away while waiting for a replica")
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            if waiting:
                await self.waiting.leave(route.name, ticket)

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

    async def demand(self, model: str) -> None:
        def record() -> None:
            from apps.catalog.services import record_demand

            record_demand(model)

        await _in_thread(record, f"ask for a replica of {model}")

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # Forwarding --------------------------------------------------------------------------------

    async def forward(self, call: Call, route: ModelRoute, receive: Receive, send: Send) -> None:
        """Call the upstream and relay its answer; a client that goes away at any point (waiting for
        the answer, or mid-stream) cancels the upstream request, which ends the engine's work."""
        watcher = asyncio.create_task(_watch_disconnect(receive))
        work = asyncio.create_task(self._forward(call, route, send))
        try:
            done, _pending = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                call.status, call.error = CANCELLED, "the client went away; the upstream request was cancelled"
                return
            work.result()
        finally:
            watcher.cancel()

    def pool_for(self, upstream: Upstream) -> Pool:
        pool = self.providers if upstream.engine == "external" else self.upstream
        assert pool is not None
        return pool

    async def _forward(self, call: Call, route: ModelRoute, send: Send) -> None:
        assert call.lease is not None
        tried: set[str] = set()
        prompt_count: asyncio.Task[int | None] | None = None
        while True:
            upstream = call.lease.upstream
            body = dict(call.body)
            body["model"] = upstream.upstream_model
            if call.endpoint is MESSAGES and upstream.engine == "llama.cpp" and body.get("stop"):
                body["verbose"] = True  # llama-server names the stop string it matched only then
            if call.stream and call.endpoint is MESSAGES and prompt_count is None:
                prompt_count = asyncio.create_task(count_prompt_tokens(self.pool_for(upstream), upstream, call.body))
            headers = [("Content-Type", "application/json"), ("x-llmgw-request-id", call.request_id)]
            secret = upstream.api_key()
            if secret:
                headers.append(("Authorization", f"Bearer {secret}"))
            try:
                response = await self.pool_for(upstream).post(
                    upstream.url + call.endpoint.upstream_path, json.dumps(body).encode(), headers
                )
            except (ConnectError, Disconnected) as exc:
                # A replica that cannot be reached: pass it over for a while and try another (never the same twice).
                self.keeper.mark_failed(upstream, UNREACHABLE_S)
                tried.add(upstream.id)
                log.warning("replica %s of %s unreachable: %s", upstream.id, upstream.model, exc)
                self.keeper.release(call.lease)
                lease = await self.acquire(call, route, None, exclude=frozenset(tried))
                if lease is None:
                    await self.confirm_miss()  # the tables may have moved on (the model deleted a moment ago)
                    if call.model not in self.tables.models:
                        raise Refused(
                            404,
                            f"The model “{call.model}” does not exist.",
                            kind="not_found_error",
                            code="model_not_found",
                        ) from None
                    raise Refused(
                        502, f"The replica of “{call.model}” could not be reached: {exc}", kind="api_error"
                    ) from None
                call.lease = lease
                if prompt_count is not None:
                    prompt_count.cancel()
                    prompt_count = None
                continue
            except UpstreamError as exc:
                raise _read_refusal(call, exc) from None
            break
        async with response:
            if call.stream and response.status == 200:
                await self.relay_stream(call, response, send, prompt_count)
                return
            try:
                raw = await response.read()
            except UpstreamError as exc:
                raise self.read_refusal(call, exc) from None
        # The engine is done with it: its slot is free before the client hears the answer.
        await self.keeper.give_back(call.lease)
        guard = call.answer_guard
        if response.status == 200 and guard is not None and guard.policies.guard_answers:
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            if isinstance(data, dict):
                guard.judged = await self.judge_answer(call, answer_text(data))
        guarded = len(raw) if call.answer_guard is not None else 0
        out = await run_checked(guarded, whole_answer, call, response.status, raw)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*self.head(call, b"application/json"), (b"content-length", str(len(out)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": out})

    async def relay_stream(
        self, call: Call, response: Any, send: Send, prompt_count: asyncio.Task[int | None] | None
    ) -> None:
        relay = StreamRelay(call, translator_for(call))
        if prompt_count is not None:
            call_count = await _result_within(prompt_count, PROMPT_COUNT_WAIT_S)
            if call_count is not None:
                relay.translator.input_tokens = call_count
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    *self.head(call, b"text/event-stream"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),
                ],
            }
        )
        opening = relay.start()
        if opening:
            await send({"type": "http.response.body", "body": opening, "more_body": True})
        error = None
        # A guard model judging the answer is asked again each JUDGE_EVERY characters while it
        # streams (in the background: the stream does not wait), and once more at its end, which is
        # held until the verdict.
        check: asyncio.Task[Any] | None = None
        judge_at = JUDGE_EVERY
        chunks = aiter(response.iter_chunks())
        try:
            while True:
                if check is None:
                    chunk = await anext(chunks, None)
                else:  # the next chunk, or the verdict if it comes first
                    chunk, stop = await _next_or_verdict(chunks, check)
                    if chunk is None and stop is not None:
                        check = None
                        await send({"type": "http.response.body", "body": relay.stop(stop), "more_body": True})
                        break
                    if check.done():
                        check = None
                if chunk is None:
                    break
                guarded = len(chunk) if call.answer_guard is not None else 0
                out = await run_checked(guarded, relay.feed, chunk, least=OFF_LOOP_CHUNK_BYTES)
                if relay.stopped:
                    # A guardrail ended the answer: nothing more is read, and leaving the stream
                    # closes the engine's request, which cancels it.
                    if out:
                        await send({"type": "http.response.body", "body": out, "more_body": True})
                    break
                if relay.finished and call.lease is not None and not call.lease.released:
                    # The engine is done ([DONE]): its slot is free before the client hears so, for a
                    # client that starts its next turn on [DONE] (the engine may close a moment later).
                    await self.keeper.give_back(call.lease)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                if relay.judging and relay.held is None and check is None and relay.answer_chars >= judge_at:
                    judge_at = relay.answer_chars + JUDGE_EVERY
                    check = asyncio.create_task(self.judge_answer(call, "".join(relay.answer), final=False))
        except UpstreamError as exc:  # the upstream died mid-stream
            error = self.stop_reason(call.upstream) or f"the upstream stream broke: {type(exc).__name__}: {exc}"
        finally:
            if check is not None:
                check.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await check
        if call.lease is not None:
            await self.keeper.give_back(call.lease)  # before the client's stream ends
        flushed = relay.flush() if error is None and not relay.stopped else b""
        if flushed:
            await send({"type": "http.response.body", "body": flushed, "more_body": True})
        if relay.held is not None:
            stop = await self.judge_answer(call, "".join(relay.answer))
            out = relay.release(stop)
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})
        tail = relay.end(error)
        usage = relay.counter.usage
        call.prompt_tokens, call.completion_tokens = usage.input_tokens, usage.output_tokens
        call.tokens_estimated = usage.estimated
        if (
            call.prompt_tokens is None
            and prompt_count is not None
            and prompt_count.done()
            and not prompt_count.cancelled()
            and prompt_count.exception() is None
        ):
            call.prompt_tokens = prompt_count.result()
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    def read_refusal(self, call: Call, exc: UpstreamError) -> Refused:
        """The answer for an upstream reached whose answer could not be read: a 503 naming the stop
        that cut it off, else as `_read_refusal` says."""
        reason = self.stop_reason(call.upstream) if isinstance(exc, Disconnected) else None
        if reason is not None:
            return Refused(503, reason[:1].upper() + reason[1:] + ".", kind="api_error", code="replica_stopped")
        return _read_refusal(call, exc)

    async def count_prompt(self, call: Call) -> int | None:
        """The prompt's tokens by the engine of the upstream the call reached (for a cancelled call)."""
        upstream = call.upstream
        if upstream is None or self.upstream is None:
            return None
        return await count_prompt_tokens(self.pool_for(upstream), upstream, call.body)

    async def count_tokens(self, call: Call, route: ModelRoute, send: Send) -> None:
        """/v1/messages/count_tokens: the prompt counted by one of the model's engines."""
        assert self.upstream is not None
        if route.external:
            raise Refused(
                400,
                f"“{route.name}” is served by an external provider, which cannot count tokens here.",
                kind="invalid_request_error",
            )
        if not route.upstreams:
            reason = f": no node can take it ({route.unplaceable})" if route.unplaceable else ""
            raise Refused(
                503,
                f"“{route.name}” has no ready replica to count with{reason}.",
                kind="overloaded_error",
                headers={"retry-after": "10"},
            )
        order, _mode = preference(route.upstreams, affinity_key(call.body))
        try:
            counted = await count_prompt_tokens(self.upstream, order[0], call.body)
        except UpstreamError as exc:
            raise Refused(
                502, f"The replica of “{route.name}” could not count the tokens: {exc}", kind="api_error"
            ) from None
        if counted is None:
            raise Refused(502, f"The replica of “{route.name}” could not count the tokens.", kind="api_error")
        out = json.dumps({"input_tokens": counted}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*self.head(call, b"application/json"), (b"content-length", str(len(out)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": out})

    # Answers ----------------------------------------------------------------------------------------

    def head(self, call: Call, content_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
        headers = [(b"x-llmgw-request-id", call.request_id.encode())]
        if content_type is not None:
            headers.insert(0, (b"content-type", content_type))
        upstream = call.upstream
        if upstream is not None:
            headers.append((b"x-llmgw-replica", f"{upstream.model}/{upstream.id}".encode()))
            headers.append((b"x-llmgw-hardware", upstream.hardware.encode()))
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
            if model_id is None:
                data: dict[str, Any] = {
                    "object": "list",
                    "data": [
                        _model_object(name, route)
                        for name, route in sorted(self.tables.models.items())
                        if entry.may_use(name)
                    ],
                }
            else:
                route = self.tables.models.get(model_id)
                if route is None:
                    await self.confirm_miss()
                    route = self.tables.models.get(model_id)
                if route is None or not entry.may_use(model_id):
                    raise Refused(
                        404,
                        f"The model “{model_id}” does not exist or this key may not use it.",
                        kind="not_found_error",
                        code="model_not_found",
                    )
                data = _model_object(model_id, route)
        except Refused as exc:
            await send_error(send, "openai", exc, self.head(call))
            return
        out = json.dumps(data).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [*self.head(call, b"application/json"), (b"content-length", str(len(out)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": out})


def _model_object(name: str, route: ModelRoute) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "llmgw",
        "llmgw": {"hardware": route.hardware, "ready_replicas": len(route.upstreams)},
    }


async def _next_or_verdict(chunks: Any, check: asyncio.Task[Any]) -> tuple[bytes | None, Any]:
    """(the stream's next chunk, None) when it comes before a stopping verdict; (None, the finding)
    when the verdict stops the answer first (the chunk is not waited for). A safe verdict that comes
    first is taken and the chunk still waited for."""
    if check.done():
        stop = check.result()
        return (None, stop) if stop is not None else (await anext(chunks, None), None)
    following = asyncio.ensure_future(anext(chunks, None))
    try:
        await asyncio.wait({following, check}, return_when=asyncio.FIRST_COMPLETED)
        if check.done() and check.result() is not None:
            return None, check.result()
        return await following, None
    finally:
        if not following.done():  # the verdict came first, or this request was cancelled
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await following


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


async def sync_to_async_load() -> Tables:
    from asgiref.sync import sync_to_async

    return await sync_to_async(load_tables, thread_sensitive=False)()


async def _result_within(task: asyncio.Task[int | None], seconds: float) -> int | None:
    try:
        return await asyncio.wait_for(asyncio.shield(task), seconds)
    except Exception:
        return None


def _read_refusal(call: Call, exc: UpstreamError) -> Refused:
    """The answer for an upstream that was reached but whose answer could not be read."""
    if isinstance(exc, ReadTimeout):
        return Refused(504, f"The replica of “{call.model}” did not answer in time: {exc}.", kind="api_error")
    return Refused(502, f"The replica of “{call.model}” failed to answer: {exc}.", kind="api_error")


gateway_app = GatewayApp()
