"""Relaying an engine's answer to the client, in the protocol the client spoke.

`StreamRelay` takes the engine's chat-completions stream as it arrives (bytes, split anywhere)
and gives the bytes to send on: the chunks themselves for an OpenAI client, Anthropic or
Responses events for the others. It reads usage and the first token's time on the way, and
keeps its running count in `call.counter`, so a stream the client leaves is charged for what
was relayed. It does no I/O: tests feed it chunks directly.

The gateway always asks the engine for a usage chunk (`stream_options.include_usage`), for
its own accounting. The client sees it only when it asked too; then, as the API reference
says, every other chunk carries `"usage": null`. An OpenAI client that did not ask sees no
`choices: []` chunk (the quickstart's `chunk.choices[0]` would fail on it).

`whole_answer` does the same for an answer that is not streamed, and `relay_stream` runs a
stream from the engine's first byte to the client's last.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from apps.gateway.errors import Refused, upstream_refusal
from apps.gateway.guard import chunk_text
from apps.gateway.intake import EMBEDDINGS, MESSAGES, RESPONSES, Call
from apps.gateway.tokens import estimate_prompt_tokens
from apps.gateway.translate import (
    ChatToAnthropicStream,
    ChatToResponsesStream,
    chat_to_message,
    chat_to_response,
    openai_error,
    sse,
)
from apps.gateway.translate.usage import StreamUsage, usage_from_response
from apps.gateway.upstream import UpstreamError

__all__ = [
    "JUDGE_EVERY",
    "StreamContext",
    "StreamRelay",
    "check_dimensions",
    "has_token",
    "relay_stream",
    "translator_for",
    "whole_answer",
]

_USAGE_NULL = b',"usage":null}'
#: json.dumps(value, ensure_ascii=False), without building an encoder for every call (any argument
#: to json.dumps does): a stream's chunks go through it one by one.
_dumps = json.JSONEncoder(ensure_ascii=False).encode


def has_token(chunk: Any) -> bool:
    if not isinstance(chunk, dict):
        return False
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") or {}
        if choice.get("text") or (
            isinstance(delta, dict)
            and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"))
        ):
            return True
    return False


def _sse_data(event: bytes) -> bytes | None:
    data = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def _data(chunk: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(chunk).encode() + b"\n\n"


def _events(events: list[tuple[str, Any]]) -> bytes:
    return b"".join(sse(name, data) for name, data in events)


def translator_for(call: Call) -> Any:
    """The stream translator for the client's protocol, None when the chunks go on as they are."""
    if call.endpoint is MESSAGES:
        return ChatToAnthropicStream(call.model, stop_sequences=call.original.get("stop_sequences"))
    if call.endpoint is RESPONSES:
        return ChatToResponsesStream(call.original, "resp_" + call.request_id[4:], int(time.time()))
    return None


class StreamRelay:
    """One stream from the engine to the client (see the module docstring)."""

    __slots__ = (
        "_buffer",
        "answer",
        "answer_chars",
        "call",
        "counter",
        "finished",
        "held",
        "judging",
        "stopped",
        "translator",
    )

    def __init__(self, call: Call, translator: Any = None) -> None:
        self.call = call
        self.translator = translator
        self.counter = call.counter = StreamUsage("chat")
        self._buffer = b""
        self.finished = False  # the engine ended the stream properly ([DONE])
        self.stopped = False  # a guardrail ended the answer: the rest of the engine's stream is not read
        # A guard model judges the answer: its end (the finishing chunk, the usage, [DONE]) is held
        # until the verdict (`release`), and its text is kept to be judged.
        guard = call.answer_guard
        self.judging = guard is not None and bool(guard.policies.guard_answers)
        self.held: list[bytes] | None = None
        self.answer: list[str] = []
        self.answer_chars = 0

    def start(self) -> bytes:
        """What opens the client's stream before any chunk (Anthropic's message_start, …)."""
        return _events(self.translator.start()) if self.translator is not None else b""

    def feed(self, data: bytes) -> bytes:
        if self.stopped:
            return b""
        self._buffer += data
        if b"\n\n" not in self._buffer:
            return b""
        *events, self._buffer = self._buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        out: list[bytes] = []
        for event in events:
            self._event(event, out)
            if self.stopped:
                break
        return b"".join(out)

    def _event(self, event: bytes, out: list[bytes]) -> None:
        if self.held is not None:
            self.held.append(event)
            return
        payload = _sse_data(event)
        if payload is None:
            if self.translator is None and event.strip():
                out.append(event + b"\n\n")  # comments and keep-alives go on as they are
            return
        if payload == b"[DONE]":
            self._done(event, out)
            return
        try:
            data = json.loads(payload)
        except ValueError:
            return
        if not isinstance(data, dict):
            return
        call = self.call
        if call.first_token_at is None and has_token(data):
            call.first_token_at = time.perf_counter()
        if self.judging and self._judged_chunk(data, event):
            return
        self.counter.feed(data)
        guard = call.answer_guard
        if guard is not None:
            data = guard.chunk(data)
            payload = _dumps(data).encode()
            if guard.stopped is not None:
                self.stopped = self.finished = True
        if self.translator is not None:
            out.append(_events(self.translator.feed(data)))
            return
        out.append(self._passed_on(data, payload))
        if self.stopped:
            out.append(self._stopped_tail())

    def _done(self, event: bytes, out: list[bytes]) -> None:
        """The engine's [DONE]: held while a guard model is still to judge the answer."""
        self.finished = True
        if self.judging:
            self.held = [event]
        elif self.translator is None:
            out.append(b"data: [DONE]\n\n")

    def _judged_chunk(self, data: dict[str, Any], event: bytes) -> bool:
        """Keep the answer's text for the guard models; True when this chunk ends it (it is then held
        with what follows until their verdict)."""
        text = chunk_text(data)
        if text:
            self.answer.append(text)
            self.answer_chars += len(text)
        if any(isinstance(c, dict) and c.get("finish_reason") is not None for c in data.get("choices") or []):
            self.held = [event]
            return True
        return False

    def release(self, stop: Any = None) -> bytes:
        """The held end of a judged answer, as the engine sent it (`stop` None), or the answer
        stopped there by the guard model's finding (what was held back is not sent)."""
        held, self.held, self.judging = self.held or [], None, False
        if stop is None:
            out: list[bytes] = []
            for i, event in enumerate(held):
                self._event(event, out)
                if self.stopped:  # a text rule stopped it in the held tail: the rest only counts
                    self._count(held[i + 1 :])
                    break
            return b"".join(out)
        return self.stop(stop, held)

    def _count(self, events: list[bytes]) -> None:
        """Feed held events' chunks to the usage count only (the usage the engine reported)."""
        for event in events:
            payload = _sse_data(event)
            if payload is not None and payload != b"[DONE]":
                try:
                    data = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(data, dict):
                    self.counter.feed(data)

    def flush(self) -> bytes:
        """What a last event without its closing blank line gives, once the engine's stream ended."""
        return self.feed(b"\n\n") if self._buffer.strip() else b""

    def stop(self, finding: Any, held: list[bytes] | None = None) -> bytes:
        """End the answer here, for a guard model's finding: the stopping chunk in the client's protocol
        and, for an OpenAI client, the usage it asked for and [DONE]. What was held is only counted."""
        guard = self.call.answer_guard
        assert guard is not None
        self._count(held if held is not None else self.held or [])
        data = guard.stopping_chunk(finding)
        self.held, self.judging = None, False
        self.stopped = self.finished = True
        if self.translator is not None:
            return _events(self.translator.feed(data))
        return self._passed_on(data, _dumps(data).encode()) + self._stopped_tail()

    def _stopped_tail(self) -> bytes:
        """After an OpenAI stream a guardrail stopped: the usage chunk the client asked for (what was
        sent), and [DONE]."""
        call = self.call
        tail = b""
        if call.client_wants_usage:
            usage = self.counter.usage
            prompt = usage.input_tokens if usage.input_tokens is not None else estimate_prompt_tokens(call.body)
            tail += _data(
                {
                    "id": call.request_id,
                    "object": "chat.completion.chunk" if call.endpoint.name != "completions" else "text_completion",
                    "model": call.model,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": prompt,
                        "completion_tokens": usage.output_tokens or 0,
                        "total_tokens": prompt + (usage.output_tokens or 0),
                    },
                }
            )
        return tail + b"data: [DONE]\n\n"

    def _passed_on(self, data: dict[str, Any], payload: bytes) -> bytes:
        call = self.call
        changed = False
        has_usage = "usage" in data
        if has_usage and data["usage"] is not None and data.get("choices"):
            # A chunk with both its last choices and the usage (llama.cpp's /v1/completions): the API
            # sends the usage in a chunk of its own, with no choices, after the others.
            usage = data.pop("usage")
            if data.get("model") and data["model"] != call.model:
                data["model"] = call.model
            if not call.client_wants_usage:
                return _data(data)
            return _data({**data, "usage": None}) + _data({**data, "choices": [], "usage": usage})
        if has_usage and data["usage"] is not None and not call.client_wants_usage:
            return b""  # the usage chunk the gateway asked for itself
        if data.get("model") and data["model"] != call.model:
            data["model"] = call.model  # the caller's name for the model, not the provider's
            changed = True
        if changed:
            if call.client_wants_usage and not has_usage:
                data["usage"] = None
            return _data(data)
        if call.client_wants_usage and not has_usage:
            body = payload.rstrip()
            if body.endswith(b"}"):
                return b"data: " + body[:-1] + _USAGE_NULL + b"\n\n"
        return b"data: " + payload + b"\n\n"

    def end(self, error: str | None) -> bytes:
        """The stream's last bytes: its proper end, or an error event when the engine broke off."""
        translator = self.translator
        if self._buffer.strip():
            tail = self.feed(b"\n\n")
        else:
            tail = b""
        if self.finished or (translator is not None and translator.finish_reason is not None):
            return tail + (_events(translator.finish()) if translator is not None else b"")
        message = error or "the upstream ended the stream before it finished"
        self.call.status = 502
        self.call.error = message
        if translator is not None:
            return tail + _events(translator.fail(message))
        return tail + b"data: " + json.dumps(openai_error(502, message, "api_error")).encode() + b"\n\n"


def _vector_size(embedding: Any) -> int | None:
    """How many numbers an embedding holds: a list's length, or a base64 string's bytes over 4
    (little-endian float32s, as encoding_format "base64" gives them)."""
    if isinstance(embedding, list):
        return len(embedding)
    if isinstance(embedding, str):
        padding = len(embedding) - len(embedding.rstrip("="))
        return (len(embedding) * 3 // 4 - padding) // 4
    return None


def check_dimensions(call: Call, data: dict[str, Any]) -> None:
    """An embeddings request's `dimensions` against the vectors the engine gave: an engine that
    cannot shorten them (llama.cpp ignores the field) is not to hand the client a vector of
    another size than it asked for, which its index would refuse or, worse, take."""
    asked = call.original.get("dimensions")
    if not isinstance(asked, int) or isinstance(asked, bool):
        return
    items = data.get("data")
    for item in items if isinstance(items, list) else ():
        size = _vector_size(item.get("embedding")) if isinstance(item, dict) else None
        if size is not None and size != asked:
            raise Refused(
                400,
                f"“{call.model}” gives embeddings of {size} dimensions and cannot give {asked}, as "
                f"“dimensions” asks: leave it out, or ask for {size}.",
                kind="invalid_request_error",
                code="unsupported_dimensions",
                param="dimensions",
            )


def whole_answer(call: Call, status: int, raw: bytes) -> bytes:
    """The client's answer made from the engine's whole (not streamed) answer; Refused when the
    engine refused."""
    call.first_token_at = time.perf_counter()
    if status != 200:
        endpoint = call.endpoint
        refusal = upstream_refusal(status, raw, call.model, prompt_param=endpoint.prompt_field, path=endpoint.path)
        call.status, call.error = refusal.status, refusal.message
        raise refusal
    try:
        data = json.loads(raw)
    except ValueError:
        raise Refused(502, "The upstream's answer is not JSON.", kind="api_error") from None
    if not isinstance(data, dict):
        raise Refused(502, "The upstream's answer is not a JSON object.", kind="api_error")
    if call.endpoint is EMBEDDINGS:
        check_dimensions(call, data)
        if isinstance(data.get("usage"), dict):
            tokens = data["usage"].get("prompt_tokens")
            call.prompt_tokens = tokens if isinstance(tokens, int) else None
    else:
        usage = usage_from_response(data, "chat")
        if usage is not None:
            call.prompt_tokens, call.completion_tokens = usage.input_tokens, usage.output_tokens
    if call.answer_guard is not None:
        data = call.answer_guard.whole(data)
        raw = _dumps(data).encode()
    if call.endpoint is MESSAGES:
        return json.dumps(
            chat_to_message(data, call.model, stop_sequences=call.original.get("stop_sequences"))
        ).encode()
    if call.endpoint is RESPONSES:
        response = chat_to_response(
            data, request=call.original, response_id="resp_" + call.request_id[4:], created_at=int(time.time())
        )
        if call.kept is not None:
            call.kept.response = response
        return json.dumps(response).encode()
    changed = False
    if data.get("model", call.model) != call.model:
        data["model"] = call.model
        changed = True
    if "__verbose" in data:
        del data["__verbose"]
        changed = True
    return _dumps(data).encode() if changed else raw


# Relaying a stream ---------------------------------------------------------------------------------

#: A guard model judging a streamed answer is asked about it each time this many more characters
#: have passed (about 250 tokens), besides its end.
JUDGE_EVERY = 1000
#: How long an Anthropic stream's first event waits for the engine to count the prompt.
PROMPT_COUNT_WAIT_S = 2.0

Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class StreamContext:
    """What relaying a stream needs of the gateway: the answer's headers, the guard models' verdict
    on the answer so far (None: it goes on), giving the slot back, and why the stream broke when a
    replica was stopped under it (None: it broke by itself)."""

    head: list[tuple[bytes, bytes]]
    judge: Callable[[str, bool], Coroutine[Any, Any, Any]]
    give_back: Callable[[], Awaitable[None]]
    broke: Callable[[BaseException], str | None]
    checked: Callable[..., Awaitable[Any]]  # apps.gateway.guard.run_checked
    keep: Callable[[], Awaitable[None]]  # stores a Responses answer (call.kept) before its last event


async def relay_stream(
    call: Call, response: Any, send: Send, context: StreamContext, prompt_count: asyncio.Task[int | None] | None
) -> None:
    """The engine's stream relayed to the client in its protocol, checked by the answer guard as it
    passes, until its end (or a guard's stop, or the engine breaking off), then its last event
    with the usage (a Responses answer stored first, when it is to be). The slot is given back
    before the client's stream ends."""
    relay = StreamRelay(call, translator_for(call))
    if prompt_count is not None:
        counted = await _result_within(prompt_count, PROMPT_COUNT_WAIT_S)
        if counted is not None:
            relay.translator.input_tokens = counted
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [*context.head, (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")],
        }
    )
    await _body(send, relay.start())
    error = await _pump(relay, aiter(response.iter_chunks()), send, context)
    await context.give_back()
    await _finish(relay, call, send, context, error, prompt_count)


async def _body(send: Send, data: bytes) -> None:
    if data:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _pump(relay: StreamRelay, chunks: Any, send: Send, context: StreamContext) -> str | None:
    """Relay chunks until the stream ends or a guard stops it; why the engine broke off, or None.

    A guard model judging the answer is asked again each JUDGE_EVERY characters while it streams
    (in the background: the stream does not wait), and once more at its end."""
    check: asyncio.Task[Any] | None = None
    judge_at = JUDGE_EVERY
    try:
        while True:
            chunk, stop = await _next(chunks, check)
            if stop is not None:
                await _body(send, relay.stop(stop))
                return None
            if check is not None and check.done():
                check = None
            if chunk is None:
                return None
            size = len(chunk) if relay.call.answer_guard is not None else 0
            out = await context.checked(size, relay.feed, chunk)
            if relay.stopped:  # a guardrail ended the answer: leaving the stream cancels the engine's request
                await _body(send, out)
                return None
            if relay.finished:
                await context.give_back()  # [DONE]: the slot is free before the client hears so
            await _body(send, out)
            if relay.judging and relay.held is None and check is None and relay.answer_chars >= judge_at:
                judge_at = relay.answer_chars + JUDGE_EVERY
                check = asyncio.create_task(context.judge("".join(relay.answer), False))
    except UpstreamError as exc:  # the upstream died mid-stream
        return context.broke(exc) or f"the upstream stream broke: {type(exc).__name__}: {exc}"
    finally:
        if check is not None:
            check.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await check


async def _next(chunks: Any, check: asyncio.Task[Any] | None) -> tuple[bytes | None, Any]:
    """The stream's next chunk, or a guard model's stopping verdict if it comes first."""
    if check is None:
        return await anext(chunks, None), None
    return await _next_or_verdict(chunks, check)


async def _finish(
    relay: StreamRelay,
    call: Call,
    send: Send,
    context: StreamContext,
    error: str | None,
    prompt_count: asyncio.Task[int | None] | None,
) -> None:
    if error is None and not relay.stopped:
        await _body(send, relay.flush())
    if relay.held is not None:
        await _body(send, relay.release(await context.judge("".join(relay.answer), True)))
    tail = relay.end(error)
    if call.kept is not None and isinstance(relay.translator, ChatToResponsesStream):
        call.kept.response = relay.translator.final
        await context.keep()  # before the last event: a client that continues at once finds it
    usage = relay.counter.usage
    call.prompt_tokens, call.completion_tokens = usage.input_tokens, usage.output_tokens
    call.tokens_estimated = usage.estimated
    if call.prompt_tokens is None and prompt_count is not None:
        call.prompt_tokens = _counted(prompt_count)
    await send({"type": "http.response.body", "body": tail, "more_body": False})


def _counted(task: asyncio.Task[int | None]) -> int | None:
    """What the engine counted of the prompt, when it answered in time."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None
    return task.result()


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


async def _result_within(task: asyncio.Task[int | None], seconds: float) -> int | None:
    try:
        return await asyncio.wait_for(asyncio.shield(task), seconds)
    except Exception:
        return None
