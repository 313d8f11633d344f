"""Forwarding: the engine asked in chat completions, and its answer, whole or streamed, written to
the client in its protocol (apps.gateway.relay). A replica that cannot be reached is passed over
for a while and the request tried on another one, never the same twice; a client that goes away
at any point cancels the upstream request, which ends the engine's work. A request cut off by a
stop (its replica's drain grace, or this process's) is told which stop and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from apps.gateway.accounting import CANCELLED
from apps.gateway.admission import Admission
from apps.gateway.errors import Refused
from apps.gateway.guard import GuardJudge, answer_text, run_checked
from apps.gateway.intake import MESSAGES, Call, engine_json
from apps.gateway.relay import StreamContext, relay_stream, whole_answer
from apps.gateway.routes import Routes
from apps.gateway.routing import affinity_key, preference
from apps.gateway.slots import SlotKeeper
from apps.gateway.tables import ModelRoute, Upstream
from apps.gateway.tokens import count_prompt_tokens
from apps.gateway.upstream import ConnectError, Disconnected, Pool, ReadTimeout, UpstreamError

__all__ = ["Forwarder"]

log = logging.getLogger("llmgw.gateway")

# How long an upstream that could not be reached is passed over.
UNREACHABLE_S = 5.0

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Head = Callable[..., list[tuple[bytes, bytes]]]


class Forwarder:
    """The forwarding stage. `head(call, content_type)` gives an answer's headers; `closing()` why
    this process cut its requests off when it is stopping (None while it is not)."""

    def __init__(
        self, keeper: SlotKeeper, admission: Admission, routes: Routes, head: Head, closing: Callable[[], str | None]
    ) -> None:
        self.keeper = keeper
        self.admission = admission
        self.routes = routes
        self.head = head
        self.closing = closing
        self.upstream: Pool | None = None  # engines on the nodes: never through a proxy
        self.providers: Pool | None = None  # external providers: HTTPS_PROXY/NO_PROXY, LLMGW_PROVIDER_CA_BUNDLE
        self.judge = GuardJudge(lambda model: self.routes.tables.models.get(model), keeper, self.post)
        # Stores a Responses answer once it is complete, before its last byte (apps.gateway.response_store).
        self.keep: Callable[[Call], Awaitable[None]] = _keep_nothing

    def pool_for(self, upstream: Upstream) -> Pool:
        pool = self.providers if upstream.engine == "external" else self.upstream
        assert pool is not None
        return pool

    @staticmethod
    def _headers(upstream: Upstream, request_id: str) -> list[tuple[str, str]]:
        headers = [("Content-Type", "application/json"), ("x-llmgw-request-id", request_id)]
        secret = upstream.api_key()
        if secret:
            headers.append(("Authorization", f"Bearer {secret}"))
        return headers

    async def post(self, upstream: Upstream, path: str, body: dict[str, Any], request_id: str) -> tuple[int, bytes]:
        """One whole answer of an upstream (a guard model's verdict): (status, body)."""
        response = await self.pool_for(upstream).post(
            upstream.url + path, engine_json(body), self._headers(upstream, request_id)
        )
        async with response:
            return response.status, await response.read()

    # A request ------------------------------------------------------------------------------------

    async def forward(self, call: Call, route: ModelRoute, receive: Receive, send: Send) -> None:
        """Call the upstream and relay its answer, watching the client all the while: a client that
        goes away cancels the work (this task), which ends the upstream request.

        The work runs in the request's own task, with one task beside it that watches the client:
        no second task to start and wait on, and the request leaves for the upstream in this turn of
        the loop rather than the next. The watcher is started in the next turn, once the request
        has left (it would first listen then all the same)."""
        task = asyncio.current_task()
        assert task is not None
        state = {"working": True, "left": False}
        watcher: asyncio.Task[None] | None = None

        def client_left(watcher: asyncio.Task[None]) -> None:
            if watcher.cancelled():
                return
            watcher.exception()  # a receive that failed: the client is as good as gone
            if state["working"]:
                state["left"] = True
                task.cancel()

        def watch() -> None:
            nonlocal watcher
            if state["working"]:
                watcher = asyncio.create_task(_watch_disconnect(receive))
                watcher.add_done_callback(client_left)

        watching = asyncio.get_running_loop().call_soon(watch)
        try:
            await self._forward(call, route, send)
        except (asyncio.CancelledError, Exception):
            if not state["left"]:
                raise
            if task.uncancel() > 0:  # cancelled from outside as well: that one goes on
                raise
            call.status, call.error = CANCELLED, "the client went away; the upstream request was cancelled"
        else:
            if state["left"]:  # the client left as the work ended, which took the cancel in its stride
                task.uncancel()
        finally:
            state["working"] = False
            watching.cancel()
            if watcher is not None:
                watcher.cancel()

    async def _forward(self, call: Call, route: ModelRoute, send: Send) -> None:
        prompt_count: asyncio.Task[int | None] | None = None
        tried: set[str] = set()
        loop = asyncio.get_running_loop()
        while True:
            assert call.lease is not None
            upstream = call.lease.upstream
            if call.stream and call.endpoint is MESSAGES and prompt_count is None:
                prompt_count = asyncio.create_task(count_prompt_tokens(self.pool_for(upstream), upstream, call.body))
            loop.call_soon(self._head_ahead, call)  # once the request has left, while the engine works
            try:
                response = await self.pool_for(upstream).post(
                    upstream.url + call.endpoint.upstream_path,
                    engine_json(_engine_body(call, upstream)),
                    self._headers(upstream, call.request_id),
                )
                break
            except (ConnectError, Disconnected) as exc:
                await self._elsewhere(call, route, upstream, tried, exc)
                if prompt_count is not None:
                    prompt_count.cancel()
                    prompt_count = None
            except UpstreamError as exc:
                raise self.refusal(call, exc) from None
        async with response:
            if call.stream and response.status == 200:
                context = StreamContext(
                    head=self.head(call, b"text/event-stream"),
                    judge=lambda text, final: self.judge.answer(call, text, final=final),
                    give_back=lambda: self._give_back(call),
                    broke=lambda exc: self._stopped(call, exc),
                    checked=run_checked,
                    keep=lambda: self.keep(call),
                )
                await relay_stream(call, response, send, context, prompt_count)
                return
            try:
                raw = await response.read()
            except UpstreamError as exc:
                raise self.refusal(call, exc) from None
        await self._give_back(call)  # the engine is done with it: its slot is free before the client hears
        await self._whole(call, response.status, raw, send)

    def _head_ahead(self, call: Call) -> None:
        """The answer's headers, made while the engine works on it (the loop is idle then) instead of
        once it has answered; they are used when nothing they say changed meanwhile (GatewayApp.head).
        Not for an Anthropic answer under limits: its resets are times, read when it is sent."""
        if call.lease is None or (call.headroom is not None and call.endpoint.protocol == "anthropic"):
            return
        content_type = b"text/event-stream" if call.stream else b"application/json"
        with contextlib.suppress(Exception):  # made again, and any failure met, when the answer is sent
            call.head = (call.upstream, len(call.guard), content_type, self.head(call, content_type))

    async def _elsewhere(
        self, call: Call, route: ModelRoute, upstream: Upstream, tried: set[str], exc: BaseException
    ) -> None:
        """A replica that cannot be reached: passed over for a while, and the request given a slot of
        another (never the same twice); Refused when none is left."""
        self.keeper.mark_failed(upstream, UNREACHABLE_S)
        tried.add(upstream.id)
        log.warning("replica %s of %s unreachable: %s", upstream.id, upstream.model, exc)
        assert call.lease is not None
        self.keeper.release(call.lease)
        lease = await self.admission.acquire(call, route, None, exclude=frozenset(tried))
        if lease is not None:
            call.lease = lease
            return
        await self.routes.confirm_miss()  # the tables may have moved on (the model deleted a moment ago)
        if call.model not in self.routes.tables.models:
            raise Refused(
                404, f"The model “{call.model}” does not exist.", kind="not_found_error", code="model_not_found"
            ) from None
        raise Refused(502, f"The replica of “{call.model}” could not be reached: {exc}", kind="api_error") from None

    async def _give_back(self, call: Call) -> None:
        if call.lease is not None:
            await self.keeper.give_back(call.lease)

    async def _whole(self, call: Call, status: int, raw: bytes, send: Send) -> None:
        guard = call.answer_guard
        if status == 200 and guard is not None and guard.policies.guard_answers:
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            if isinstance(data, dict):
                guard.judged = await self.judge.answer(call, answer_text(data))
        guarded = len(raw) if guard is not None else 0
        out = await run_checked(guarded, whole_answer, call, status, raw)
        if call.kept is not None:
            await self.keep(call)
        headers = [*self.head(call, b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})

    # Why an answer broke off ---------------------------------------------------------------------

    def _stopped(self, call: Call, exc: BaseException) -> str | None:
        """Why a request was cut off, when it was by a stop: this process's own (its grace ran out)
        or its replica's (its drain grace ran out); None otherwise."""
        return self.closing() or self.routes.stopped(call.upstream)

    def refusal(self, call: Call, exc: UpstreamError) -> Refused:
        """The answer for an upstream reached whose answer could not be read: a 503 naming the stop
        that cut it off, a 504 when it took too long, else a 502 with the reason."""
        reason = self._stopped(call, exc) if isinstance(exc, Disconnected) else None
        if reason is not None:
            return Refused(503, reason[:1].upper() + reason[1:] + ".", kind="api_error", code="replica_stopped")
        if isinstance(exc, ReadTimeout):
            return Refused(504, f"The replica of “{call.model}” did not answer in time: {exc}.", kind="api_error")
        return Refused(502, f"The replica of “{call.model}” failed to answer: {exc}.", kind="api_error")

    # Counting ---------------------------------------------------------------------------------------

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
        headers = [*self.head(call, b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


#: Fields the Anthropic translation passes to engines that an external (OpenAI-compatible)
#: provider refuses as unknown.
ENGINE_ONLY_FIELDS = ("top_k",)


async def _keep_nothing(_call: Call) -> None:
    return None


def _engine_body(call: Call, upstream: Upstream) -> dict[str, Any]:
    body = dict(call.body)
    body["model"] = upstream.upstream_model
    if upstream.engine == "external" and call.endpoint.translation is not None:
        for field in ENGINE_ONLY_FIELDS:
            body.pop(field, None)
    if call.endpoint is MESSAGES and upstream.engine == "llama.cpp" and body.get("stop"):
        body["verbose"] = True  # llama-server names the stop string it matched only then
    return body


async def _watch_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
