"""The first stage of a request: which endpoint it is for, who sends it, and what it asks.

`ENDPOINTS` names the gateway's own API endpoints (an *endpoint* here is always one of these,
never an engine: those are upstreams). `read_body` bounds the body before holding it,
`parse_body` turns it into JSON the engines can take, and `api_key` finds the caller's key in
the headers. Nothing here touches the tables or the network, so it is tested on its own.

A body is refused with a 400 when it is not JSON, nests deeper than MAX_DEPTH, holds NaN or
Infinity (not JSON, though Python's reader takes them) or a lone UTF-16 surrogate (which no
engine can encode): each would otherwise reach an engine or a database and fail there.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from agent.bounded import TooLarge, inflate
from apps.gateway.errors import Refused
from apps.gateway.jsonbody import MAX_DEPTH, NotAccepted, read_json
from apps.gateway.translate import TranslationError, messages_to_chat, responses_to_chat

if TYPE_CHECKING:
    from apps.gateway.response_store import Kept
    from apps.gateway.slots import Lease
    from apps.gateway.tables import KeyEntry, Upstream
    from apps.gateway.translate.usage import StreamUsage

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "EMBEDDINGS",
    "ENDPOINTS",
    "MAX_DEPTH",
    "MESSAGES",
    "MODELS",
    "RESPONSES",
    "STORED_RESPONSES",
    "BodyBudget",
    "Call",
    "Endpoint",
    "api_key",
    "check_fits",
    "check_messages",
    "check_ranges",
    "check_size",
    "content_encoding",
    "decode_body",
    "engine_json",
    "parse_body",
    "read_body",
    "refused",
    "text_size",
]

Receive = Callable[[], Awaitable[dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One of the gateway's API endpoints as the client calls it."""

    name: str  # as usage records and metrics name it
    protocol: str  # "openai" or "anthropic": the shape of its answers and errors
    translation: str | None  # "messages" or "responses" when it is translated to chat completions
    upstream_path: str  # what it is forwarded to on the engine ("" when it is answered here)
    streams: bool = True  # whether "stream": true is honoured
    path: str = ""  # the path the client calls
    prompt_field: str = "messages"  # the request field that holds the prompt (named by a context overflow)

    def chat(self, call: Call, body: dict[str, Any]) -> dict[str, Any]:
        """What the engine is asked: the body itself, or its translation to chat completions."""
        check_ranges(self, body)
        try:
            if self.translation == "messages" and not self.upstream_path:
                # Counting tokens: no answer is asked for, so neither its length nor thinking matter.
                chat = messages_to_chat({"max_tokens": 1, **{k: v for k, v in body.items() if k != "thinking"}})
            elif self.translation == "messages":
                chat = messages_to_chat(body)
            elif self.translation == "responses":
                chat = responses_to_chat(body)
            else:
                if self.upstream_path == "/v1/chat/completions":
                    check_messages(body.get("messages"))
                chat = dict(body)
        except TranslationError as exc:
            raise Refused(400, str(exc), kind="invalid_request_error", param=exc.param) from None
        chat.pop("_ignored", None)
        if call.stream:
            options = body.get("stream_options")
            call.client_wants_usage = (
                self.translation is None and isinstance(options, dict) and options.get("include_usage") is True
            )
            chat["stream"] = True
            # Always asked for, for the gateway's own accounting; relayed only when the client asked.
            chat["stream_options"] = {**(chat.get("stream_options") or {}), "include_usage": True}
        elif self.translation is None:
            chat.pop("stream_options", None)
        return chat


CHAT = Endpoint("chat.completions", "openai", None, "/v1/chat/completions", path="/v1/chat/completions")
COMPLETIONS = Endpoint("completions", "openai", None, "/v1/completions", path="/v1/completions", prompt_field="prompt")
EMBEDDINGS = Endpoint(
    "embeddings", "openai", None, "/v1/embeddings", streams=False, path="/v1/embeddings", prompt_field="input"
)
MESSAGES = Endpoint("messages", "anthropic", "messages", "/v1/chat/completions", path="/v1/messages")
COUNT_TOKENS = Endpoint(
    "messages.count_tokens", "anthropic", "messages", "", streams=False, path="/v1/messages/count_tokens"
)
RESPONSES = Endpoint(
    "responses", "openai", "responses", "/v1/chat/completions", path="/v1/responses", prompt_field="input"
)
MODELS = Endpoint("models", "openai", None, "", streams=False, path="/v1/models")
STORED_RESPONSES = Endpoint("responses.stored", "openai", None, "", streams=False, path="/v1/responses/{id}")

ENDPOINTS = {("POST", e.path): e for e in (CHAT, COMPLETIONS, EMBEDDINGS, MESSAGES, COUNT_TOKENS, RESPONSES)}


def check_ranges(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Refuse, as the providers do, what an engine would otherwise take silently: a temperature
    outside the API's range (OpenAI's 0 to 2, Anthropic's 0 to 1; an engine clamps it or samples
    with it as given), and embeddings `dimensions` that is not a whole number of at least 1."""
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        most = 1 if endpoint.protocol == "anthropic" else 2
        if temperature > most:
            raise Refused(
                400,
                f"Invalid 'temperature': decimal above maximum value. Expected a value <= {most}, "
                f"but got {temperature} instead.",
                kind="invalid_request_error",
                code="decimal_above_max_value",
                param="temperature",
            )
        if temperature < 0:
            raise Refused(
                400,
                f"Invalid 'temperature': decimal below minimum value. Expected a value >= 0, "
                f"but got {temperature} instead.",
                kind="invalid_request_error",
                code="decimal_below_min_value",
                param="temperature",
            )
    if endpoint.name == "embeddings" and "dimensions" in body:
        dimensions = body["dimensions"]
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or dimensions < 1:
            raise Refused(
                400,
                f"Invalid 'dimensions': expected a whole number of at least 1, got {json.dumps(dimensions)}.",
                kind="invalid_request_error",
                code="invalid_value",
                param="dimensions",
            )


class _RequestIds:
    """Request ids: "req_" and 32 hex digits of the operating system's random bytes, as
    `uuid.uuid4().hex` gave them, read 4 KiB at a time: one system call per 256 requests rather
    than one each, and no UUID object (uuid4 cost some 2.9 us of a request's path, this 0.4 us).
    A child process made by fork() reads its own bytes, never its parent's."""

    SIZE = 4096

    def __init__(self) -> None:
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()  # threads other than the event loop's may ask too
        self._bytes = b""
        self._at = 0

    def next(self) -> str:
        with self._lock:
            at = self._at
            if at >= len(self._bytes):
                self._bytes, at = os.urandom(self.SIZE), 0
            self._at = at + 16
            return "req_" + self._bytes[at : at + 16].hex()


new_request_id = _RequestIds().next


class Call:
    """One request on its way through the gateway, and what its usage record will say."""

    __slots__ = (
        "answer_guard",
        "batch",
        "body",
        "body_bytes",
        "client_wants_usage",
        "completion_tokens",
        "counter",
        "cost",
        "endpoint",
        "band",
        "band_note",
        "entry",
        "error",
        "first_token_at",
        "guard",
        "head",
        "headroom",
        "kept",
        "lease",
        "leased_at",
        "model",
        "original",
        "prompt_tokens",
        "queue_ms",
        "queued_at",
        "request_id",
        "started",
        "status",
        "stream",
        "tokens_estimated",
        "traceparent",
        "waited",
    )

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self.request_id = new_request_id()
        self.started = time.perf_counter()
        self.entry: KeyEntry | None = None
        self.model = ""
        self.body: dict[str, Any] = {}  # what goes to the engine
        self.body_bytes = 0  # of the body, counted in the process's body budget
        self.original: dict[str, Any] = {}  # what the client sent
        self.stream = False
        self.client_wants_usage = False
        self.status = 200
        self.error = ""
        self.first_token_at: float | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.tokens_estimated = False
        self.lease: Lease | None = None  # the slot it holds, while it holds one
        self.counter: StreamUsage | None = None  # a stream's running count of what was relayed
        self.guard: list[dict[str, Any]] = []  # what guardrail rules matched (apps.gateway.guard)
        self.answer_guard: Any = None  # the answer's check as it passes, when a policy watches answers
        self.queued_at: float | None = None  # when it began to ask for a replica's slot (perf_counter)
        self.leased_at: float | None = None  # when it got one
        self.traceparent: str | None = None  # the caller's W3C trace context, when it sent one
        self.band = 0  # its priority band (apps.gateway.fairness: 0 interactive, 1 batch)
        self.band_note: str | None = None  # why it is served in another band than it asked, said to the client
        self.queue_ms: float | None = None  # how long it waited for its slot (0 when one was free)
        self.waited: Any = None  # its place in a fair queue, kept to charge what it really cost
        self.cost: float | None = None  # the tokens the fair queue expects it to take (Admission.cost)
        self.headroom: Any = None  # what its limits leave (apps.quotas.limiter.Headroom), for the headers
        self.kept: Kept | None = None  # a Responses answer to store, and where it goes (apps.gateway.response_store)
        self.batch: str | None = None  # the batch it is a line of (apps.gateway.grants), None for a client's own
        # Its answer's headers, made while the engine works: (for the upstream, guard findings, content type, headers).
        self.head: tuple[Any, int, bytes | None, list[tuple[bytes, bytes]]] | None = None

    @property
    def upstream(self) -> Upstream | None:
        return self.lease.upstream if self.lease is not None else None


class BodyBudget:
    """The bytes of request bodies this process holds at once, across requests: a body is counted
    as it arrives and until its request ends, and one that would take the total past `most` is
    refused (503, try again) rather than held. Eight clients sending 31 MB each took a process
    from 188 MiB to 1 GiB before this."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.held = 0

    def take(self, size: int) -> None:
        if self.held + size > self.most:
            raise Refused(
                503,
                f"The gateway holds {self.held} bytes of request bodies already, and may hold "
                f"{self.most}; try again shortly.",
                kind="overloaded_error",
                headers={"retry-after": "2"},
            )
        self.held += size

    def give(self, size: int) -> None:
        self.held -= size


async def read_body(receive: Receive, limit: int, budget: BodyBudget | None = None, call: Call | None = None) -> bytes:
    """The whole body, refused with a 413 as soon as it passes `limit` (never held past it). With a
    budget, what is read is counted in it (in `call.body_bytes`, given back when the request ends)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise Refused(413, f"The body is over the limit of {limit} bytes.", kind="request_too_large")
        if budget is not None and call is not None and chunk:
            budget.take(len(chunk))
            call.body_bytes += len(chunk)
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


#: The content codings a body may come in: none, or gzip (what HTTP clients that compress send).
GZIP_CODINGS = frozenset({"gzip", "x-gzip"})


def content_encoding(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The body's content codings, in the order they were applied ("identity" left out)."""
    codings: list[str] = []
    for name, value in headers:
        if name == b"content-encoding":
            codings += [c.strip().lower() for c in value.decode("latin-1").split(",") if c.strip()]
    return [c for c in codings if c != "identity"]


def decode_body(
    raw: bytes, codings: list[str], limit: int, budget: BodyBudget | None = None, call: Call | None = None
) -> bytes:
    """The body as sent, or inflated when it came gzip'd: its inflated size is held to the same
    `limit` as a plain body (a zip bomb is refused once `limit` bytes came out, never inflated
    whole) and counted in the budget like one. Any other coding is refused, naming it (415)."""
    if not codings:
        return raw
    if len(codings) > 1 or codings[0] not in GZIP_CODINGS:
        named = ", ".join(codings)
        raise Refused(
            415,
            f"The body's Content-Encoding “{named}” is not supported: send it uncompressed or gzip'd.",
            kind="invalid_request_error",
            code="unsupported_content_encoding",
        )
    try:
        body = inflate(raw, limit=limit, what="the request body")
    except TooLarge:
        raise Refused(
            413, f"The gzip'd body inflates to more than the limit of {limit} bytes.", kind="request_too_large"
        ) from None
    except ValueError as exc:
        raise Refused(
            400, f"The body says Content-Encoding: gzip, but {exc}.", code="invalid_content_encoding"
        ) from None
    if budget is not None and call is not None:
        budget.take(len(body))
        call.body_bytes += len(body)
    return body


def check_messages(messages: object) -> None:
    """Refuse a chat request without a list of message objects as the API does (an engine given
    none answers in a shape of its own, or not at all)."""
    if messages is None:
        raise Refused(
            400,
            "Missing required parameter: 'messages'.",
            kind="invalid_request_error",
            code="missing_required_parameter",
            param="messages",
        )
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        got = "an array holding other values" if isinstance(messages, list) else f"a {_json_type(messages)}"
        raise Refused(
            400,
            f"Invalid type for 'messages': expected an array of objects, but got {got} instead.",
            kind="invalid_request_error",
            code="invalid_type",
            param="messages",
        )
    if not messages:
        raise Refused(
            400,
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.",
            kind="invalid_request_error",
            code="empty_array",
            param="messages",
        )


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object"


def check_size(chat: dict[str, Any], *, most_messages: int, most_parts: int) -> None:
    """Refuse a request with more messages or content parts than an engine should be given: an
    engine's chat template takes time that grows faster than the number of messages (300,000
    one-word messages held one for ten minutes, long after its client had gone)."""
    messages = chat.get("messages")
    if not isinstance(messages, list):
        return
    if len(messages) > most_messages:
        raise Refused(
            400,
            f"The request has {len(messages)} messages; at most {most_messages} are taken.",
            kind="invalid_request_error",
            code="too_many_messages",
            param="messages",
        )
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > most_parts:
        raise Refused(
            400,
            f"The request's messages have {parts} content parts; at most {most_parts} are taken.",
            kind="invalid_request_error",
            code="too_many_parts",
            param="messages",
        )


# Few tokenizers make a token of more than this many bytes of text, so a prompt of N bytes holds at
# least N / BYTES_PER_TOKEN_MOST tokens: a bound to refuse on without counting.
BYTES_PER_TOKEN_MOST = 8


#: Fields whose text is no part of the prompt's length.
_NOT_TEXT = frozenset(("image_url", "type", "role", "input_audio"))


def _utf8_size(text: str) -> int:
    # An ASCII string (most prompts) is as many bytes as characters: no copy to count them.
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


def text_size(value: Any, measure: Callable[[str], int] = len, skip: frozenset[str] = _NOT_TEXT) -> int:
    """`measure` (characters by default) summed over every string in a JSON value but those under
    `skip` keys. A loop over a stack: a recursive sum of generators took twice as long on a
    conversation of a few turns, and this runs for every request."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += measure(item)
        elif isinstance(item, dict):
            for key, field in item.items():
                if key in skip:
                    continue
                if isinstance(field, str):
                    total += measure(field)
                else:
                    stack.append(field)
        elif isinstance(item, list):
            stack.extend(item)
    return total


def check_fits(chat: dict[str, Any], context: int | None, param: str | None = None) -> None:
    """Refuse, before any engine sees it, a prompt that surely cannot fit `context` tokens (judged by
    its length alone; the engine refuses what only its own count shows to be too long). `param`
    names the client's field that holds the prompt."""
    if not context:
        return
    least = (
        text_size(chat.get("messages"), _utf8_size) + text_size(chat.get("prompt"), _utf8_size)
    ) // BYTES_PER_TOKEN_MOST
    if least > context:
        raise Refused(
            400,
            f"The prompt holds at least {least} tokens by its length, more than the model's "
            f"context of {context} tokens.",
            kind="invalid_request_error",
            code="context_length_exceeded",
            param=param,
        )


class ClientLeft(Exception):
    """The client went away before its request was answered."""


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 saying what is wrong with it (apps.gateway.jsonbody)."""
    try:
        return read_json(raw)
    except NotAccepted as exc:
        raise refused(exc) from None


def refused(exc: NotAccepted) -> Refused:
    """The 400 for a body apps.gateway.jsonbody did not accept."""
    return Refused(400, exc.message, code=exc.code) if exc.code else Refused(400, exc.message)


def engine_json(body: Any) -> bytes:
    """A request's body as an engine or provider is sent it: UTF-8 JSON from orjson, which writes a
    megabyte prompt in about 0.1 ms on the event loop where json.dumps took 3.4 ms (its \\u
    escapes also made the body twice as long). What parse_body let in encodes either way (NaN, the
    infinities and lone surrogates are refused there); an integer past 64 bits, which the standard
    parser reads and orjson does not write, goes through json.dumps."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


def api_key(headers: list[tuple[bytes, bytes]]) -> str:
    """The key from `Authorization: Bearer …` (OpenAI SDKs) or `x-api-key` (Anthropic SDKs)."""
    raw = ""
    for name, value in headers:
        if name == b"authorization":
            text = value.decode("latin-1")
            if text[:7].lower() == "bearer ":
                raw = text[7:].strip()
        elif name == b"x-api-key" and not raw:
            raw = value.decode("latin-1").strip()
    if not raw:
        raise Refused(
            401,
            "Send an API key: “Authorization: Bearer llmgw_...” or “x-api-key”.",
            kind="authentication_error",
            code="missing_api_key",
        )
    return raw
