"""What the Anthropic and Responses translators share: building chat messages, SSE framing,
assembling streamed tool calls, and reading what engines report beyond the chat schema.
Pure and stdlib-only, like the rest of the package.

Beyond the chat schema, engines report:
- the stop string that ended a completion: vLLM (and SGLang) in the choice's `stop_reason` (a
  string; an integer there is a stop token id, not a string), llama.cpp's llama-server, when the
  request carries `"verbose": true`, in a top-level `__verbose` object (`stop_type` "word" and
  `stopping_word`; "eos" or "limit" otherwise) on the last stream chunk or the whole response.
  `matched_stop` reads either. The translators never copy `__verbose` into what they build.
- token counts in llama-server's `timings` (`cache_n + prompt_n` prompt tokens, `predicted_n`
  output tokens), on the last chunk or the whole response: `usage_from_timings` reads them, and
  the translators use them when no `usage` came.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from .errors import TranslationError
from .usage import Usage, delta_has_tokens, from_chat

__all__ = [
    "ChatChunkReader",
    "Event",
    "ToolCall",
    "ToolCallTracker",
    "as_dict",
    "dumps",
    "finalize_messages",
    "first_choice",
    "matched_stop",
    "push_message",
    "require",
    "sse",
    "stream_fields",
    "token_logprobs",
    "usage_from_timings",
    "whole_usage",
    "with_timings",
]

#: One server-sent event: (event name, JSON data). The event name is the data's "type".
type Event = tuple[str, dict[str, Any]]

_encoder = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(value: Any) -> str:
    """Compact JSON, UTF-8 kept as is (what the upstream APIs send)."""
    return _encoder.encode(value)


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: `event: X\\ndata: {...}\\n\\n`."""
    return f"event: {event}\ndata: {_encoder.encode(data)}\n\n".encode()


def require(value: Any, kind: type | tuple[type, ...], param: str, what: str) -> Any:
    """`value` if it is of `kind` (a bool is never an int here), else a TranslationError naming `param`."""
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    if value is None:
        raise TranslationError(f"{param}: {what} is required.", param)
    raise TranslationError(f"{param}: expected {what}, got {_json_type(value)}.", param)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def stream_fields(chat: dict[str, Any]) -> None:
    """Ask for a stream that ends with a usage chunk, so tokens are the engine's own count."""
    chat["stream"] = True
    chat["stream_options"] = {"include_usage": True}


# Messages -----------------------------------------------------------------------------------------------
#
# While a conversation is built, a user message's content is a list of chat content parts and an
# assistant's a string; `finalize_messages` turns text-only user content into one string, the form
# every engine and chat template accepts.


def push_message(messages: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Append `message`, merging it into the previous one when both are user turns, both assistant
    turns, or both system turns. Chat templates that insist on alternating roles (Gemma, Mistral)
    refuse two user turns in a row; Anthropic merges consecutive turns of one role itself, and an
    assistant's text and the tool calls that follow it are one chat turn."""
    if messages:
        last = messages[-1]
        role = message["role"]
        if last["role"] == role:
            if role == "user":
                last["content"].extend(message["content"])
                return
            if role == "assistant" and not last.get("tool_calls"):
                # Text after tool calls stays a turn of its own: nothing in chat puts it after them.
                text = message.get("content")
                if text:
                    last["content"] = (last.get("content") or "") + text
                if message.get("tool_calls"):
                    last["tool_calls"] = message["tool_calls"]
                return
            if role == "assistant" and not message.get("content") and message.get("tool_calls"):
                last["tool_calls"].extend(message["tool_calls"])
                return
            if role == "system":
                last["content"] = f"{last['content']}\n\n{message['content']}"
                return
    messages.append(message)


def finalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text-only user content becomes one string (parts joined by newlines); content with images
    stays a list of parts. An assistant turn with tool calls and no text gets `content: null`."""
    for message in messages:
        role = message["role"]
        if role == "user":
            parts = message["content"]
            if all(part.get("type") == "text" for part in parts):
                message["content"] = "\n".join(part["text"] for part in parts)
        elif role == "assistant" and not message.get("content") and message.get("tool_calls"):
            message["content"] = None
    return messages


def as_dict(value: Any) -> dict[str, Any]:
    """`value` if it is an object, else an empty one."""
    return value if isinstance(value, dict) else {}


def _token(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        "token": str(entry.get("token", "")),
        "bytes": entry["bytes"] if isinstance(entry.get("bytes"), list) else [],
        "logprob": entry["logprob"] if isinstance(entry.get("logprob"), int | float) else 0.0,
    }


def token_logprobs(choice: Any) -> list[dict[str, Any]]:
    """A chat choice's (or chunk choice's) `logprobs.content` in the Responses API's shape: each
    token with its bytes, log probability and `top_logprobs`; [] when the engine sent none."""
    logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return []
    out = []
    for entry in content:
        if not isinstance(entry, dict):
            continue
        tops = entry.get("top_logprobs")
        top = [_token(t) for t in tops if isinstance(t, dict)] if isinstance(tops, list) else []
        out.append({**_token(entry), "top_logprobs": top})
    return out


def first_choice(resp: dict[str, Any]) -> dict[str, Any]:
    """Choice 0 of a chat completion (or of a chunk); `{}` when there is none. Only choice 0 is
    translated: neither Anthropic nor Responses has `n`."""
    choices = resp.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                return choice
    return {}


# What engines report beyond the chat schema ---------------------------------------------------------------


def _count(value: Any) -> int | None:
    """A token count: a non-negative int (never a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def usage_from_timings(chunk: Any) -> tuple[int | None, int | None]:
    """(prompt tokens, output tokens) from llama.cpp's `timings` object in a chunk or a whole
    response: the prompt is `cache_n + prompt_n` (tokens read from the prompt cache plus those
    evaluated), the output `predicted_n`. (None, None) when there is no `timings`; a count that is
    missing or not a non-negative integer is None."""
    timings = chunk.get("timings") if isinstance(chunk, dict) else None
    if not isinstance(timings, dict):
        return None, None
    evaluated = _count(timings.get("prompt_n"))
    cached = _count(timings.get("cache_n"))
    prompt = None if evaluated is None else evaluated + (cached or 0)
    return prompt, _count(timings.get("predicted_n"))


def with_timings(reported: Usage | None, timings: tuple[int | None, int | None]) -> Usage | None:
    """The upstream's `usage`, its missing counts taken from `timings` (`usage_from_timings`); a new
    object, or None when neither says anything."""
    prompt, output = timings
    if reported is None:
        if prompt is None and output is None:
            return None
        return Usage(input_tokens=prompt, output_tokens=output)
    merged = replace(reported)
    if merged.input_tokens is None:
        merged.input_tokens = prompt
    if merged.output_tokens is None:
        merged.output_tokens = output
    return merged


def whole_usage(resp: dict[str, Any]) -> Usage | None:
    """A whole chat completion's usage: its `usage`, else llama.cpp's `timings`."""
    return with_timings(from_chat(resp.get("usage")), usage_from_timings(resp))


def matched_stop(body: Any, choice: Any = None) -> str | None:
    """The stop string the engine says ended the completion, or None: the choice's `stop_reason`
    when it is a string (vLLM, SGLang), else the body's `__verbose.stopping_word` when
    `__verbose.stop_type` is "word" (llama.cpp's llama-server asked with `"verbose": true`).
    An empty string is no match. Whether it is one the client asked for is the caller's check."""
    reason = choice.get("stop_reason") if isinstance(choice, dict) else None
    if isinstance(reason, str) and reason:
        return reason
    verbose = body.get("__verbose") if isinstance(body, dict) else None
    if isinstance(verbose, dict) and verbose.get("stop_type") == "word":
        word = verbose.get("stopping_word")
        if isinstance(word, str) and word:
            return word
    return None


# Streamed tool calls ------------------------------------------------------------------------------------


class ToolCall:
    """One tool call as it streams in: OpenAI sends `id` and `function.name` in its first delta and
    `function.arguments` in pieces after; some engines send the name later, or repeat it."""

    __slots__ = ("arguments", "call_id", "index", "name", "opened", "slot")

    def __init__(self, index: int) -> None:
        self.index = index
        self.call_id: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []
        self.opened = False
        #: Where the client-side protocol put it: an Anthropic block index, a Responses output index.
        self.slot = -1

    @property
    def text(self) -> str:
        return "".join(self.arguments)


class ToolCallTracker:
    """Assembles `delta.tool_calls` across chunks. `update` returns what happened, in order:
    `("open", call, arguments so far)` once the call's name is known, then `("args", call, piece)`."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls: dict[int, ToolCall] = {}

    def update(self, deltas: Any) -> list[tuple[str, ToolCall, str]]:
        happened: list[tuple[str, ToolCall, str]] = []
        if not isinstance(deltas, list):
            return happened
        for delta in deltas:
            if not isinstance(delta, dict):
                continue
            index = delta.get("index")
            if not isinstance(index, int):
                # No index (a few providers): a new id starts a call, anything else continues the last.
                if delta.get("id") and all(c.call_id != delta["id"] for c in self.calls.values()):
                    index = len(self.calls)
                else:
                    index = max(self.calls, default=0)
            call = self.calls.get(index)
            if call is None:
                call = self.calls[index] = ToolCall(index)
            if delta.get("id") and call.call_id is None:
                call.call_id = str(delta["id"])
            function = delta.get("function")
            if not isinstance(function, dict):
                continue
            name = function.get("name")
            if name and call.name is None:
                call.name = str(name)
            piece = function.get("arguments")
            if not isinstance(piece, str):
                piece = dumps(piece) if isinstance(piece, dict) else ""
            if piece:
                call.arguments.append(piece)
            if not call.opened:
                if call.name is not None:
                    call.opened = True
                    happened.append(("open", call, call.text))
            elif piece:
                happened.append(("args", call, piece))
        return happened

    def unopened(self) -> list[ToolCall]:
        """Calls whose name never came, in index order: opened anyway at the end, with an empty name."""
        return [self.calls[i] for i in sorted(self.calls) if not self.calls[i].opened]


class ChatChunkReader:
    """Reads a chat-completion stream chunk by chunk, for the translations into other streams.

    `feed(chunk)` (each parsed chunk, [DONE] left out) keeps the upstream's usage (or llama.cpp's
    `timings`), finish_reason and matched stop, counts the deltas that carry tokens (the output
    estimate when the upstream reports no usage) and hands text and tool-call pieces to the
    subclass, which returns the events they make. A chunk carrying an "error" object ends the
    stream through `fail`.
    """

    __slots__ = (
        "_done",
        "_started",
        "_timings",
        "_tools",
        "finish_reason",
        "matched_stop",
        "tokens_counted",
        "upstream_usage",
    )

    def __init__(self) -> None:
        #: Content and tool-argument deltas seen: the output estimate when the upstream reports no usage.
        self.tokens_counted = 0
        #: The upstream's usage (from its include_usage chunk), when it sent one.
        self.upstream_usage: Usage | None = None
        #: The upstream's finish_reason, None until it sends one (a stream cut short never does).
        self.finish_reason: str | None = None
        #: The stop string the engine says it matched (`matched_stop`), whether the client asked for it or not.
        self.matched_stop: str | None = None
        #: llama.cpp's counts from the latest `timings` (`usage_from_timings`).
        self._timings: tuple[int | None, int | None] = (None, None)
        self._started = False
        self._done = False
        self._tools = ToolCallTracker()

    @property
    def done(self) -> bool:
        return self._done

    @property
    def reported_usage(self) -> Usage | None:
        """What the upstream reported: its usage chunk, with the counts it left out taken from
        llama.cpp's `timings`; a new object each time, None when it reported nothing."""
        return with_timings(self.upstream_usage, self._timings)

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        if self._done or not isinstance(chunk, dict):
            return []
        events = self._begin(chunk)
        error = chunk.get("error")
        if error:
            message = as_dict(error).get("message")
            events.extend(self.fail(str(message or error)))
            return events
        usage = from_chat(chunk.get("usage"))
        if usage is not None:
            self.upstream_usage = usage
        timings = usage_from_timings(chunk)
        if timings != (None, None):
            self._timings = timings
        choice = first_choice(chunk)
        stop = matched_stop(chunk, choice)
        if stop is not None:
            self.matched_stop = stop
        if not choice:
            return events
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta_has_tokens(delta):
                self.tokens_counted += 1
            text = delta.get("content")
            if isinstance(text, str) and text:
                self._on_text(text, events, token_logprobs(choice))
            if delta.get("tool_calls"):
                for what, call, piece in self._tools.update(delta["tool_calls"]):
                    if what == "open":
                        self._on_tool_open(call, piece, events)
                    else:
                        self._on_tool_arguments(call, piece, events)
        finish = choice.get("finish_reason")
        if finish:
            self.finish_reason = str(finish)
        return events

    # What each translation makes of the pieces.

    def _begin(self, chunk: dict[str, Any]) -> list[Event]:
        """The events that open the stream, on the first chunk; [] after."""
        raise NotImplementedError

    def _on_text(self, text: str, events: list[Event], logprobs: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _on_tool_open(self, call: ToolCall, arguments: str, events: list[Event]) -> None:
        raise NotImplementedError

    def _on_tool_arguments(self, call: ToolCall, piece: str, events: list[Event]) -> None:
        raise NotImplementedError

    def fail(self, message: str) -> list[Event]:
        raise NotImplementedError
