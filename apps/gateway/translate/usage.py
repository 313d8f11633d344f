"""Token usage, read from any of the three protocols and written in each.

`Usage` is the gateway's own record of one request: `input_tokens` counts every prompt token,
cached ones included (as OpenAI counts them; Anthropic reports cache reads apart, and
`from_anthropic` adds them back), and an unreported count is None, never 0.

Reading:
- `usage_from_response(body)`: a whole (non-stream) chat completion, Anthropic message or
  Response object; the protocol is told or recognised from the body.
- `StreamUsage(protocol)`: fed every parsed event of a stream (chat chunks, Anthropic events,
  Responses events), for streams the gateway passes through untranslated.
- `count_chunk_tokens(chunk)`: the tokens one chat chunk carries, by estimate (below).

Counting when the upstream sends no usage: every chunk (or event) that carries generated text,
reasoning text or tool-call argument text counts as ONE token. It is an estimate. It is exact
for llama.cpp's llama-server and vLLM, which send one chunk per sampled token, except where
several byte tokens make up one UTF-8 character (they are held back and sent as one chunk);
an upstream that batches tokens (some hosted providers send a few per chunk, or a whole tool
call at once) is undercounted. `Usage.estimated` says when output_tokens came from counting.

Writing: `Usage.to_anthropic()` and `Usage.to_responses()` give the usage objects of those
protocols (where a count is unknown there they put 0, since their fields are required).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Protocol",
    "StreamUsage",
    "Usage",
    "count_chunk_tokens",
    "delta_has_tokens",
    "from_anthropic",
    "from_chat",
    "from_responses",
    "stream_usage",
    "usage_from_response",
]

type Protocol = Literal["chat", "anthropic", "responses"]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _get(obj: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


@dataclass(slots=True)
class Usage:
    input_tokens: int | None = None
    output_tokens: int | None = None
    #: Of input_tokens, those read from the engine's prompt cache.
    cached_input_tokens: int | None = None
    #: Of output_tokens, those spent on reasoning (when the upstream says).
    reasoning_tokens: int | None = None
    #: output_tokens were counted from stream deltas, not reported by the upstream.
    estimated: bool = False

    @property
    def total_tokens(self) -> int | None:
        if self.input_tokens is None and self.output_tokens is None:
            return None
        return (self.input_tokens or 0) + (self.output_tokens or 0)

    def to_anthropic(self, *, cache_apart: bool = True) -> dict[str, Any]:
        """Anthropic's usage, the prompt split in its three parts, which add up to it:
        input_tokens, cache_creation_input_tokens (always 0: no engine charges apart for writing
        its prompt cache, so those tokens are input_tokens) and cache_read_input_tokens (what the
        upstream reported its cache held; 0 when it said nothing, those tokens being counted as
        input). `cache_apart=False` counts cache reads as input too: a stream's message_start
        splits the prompt before the engine says what its cache held, and its message_delta must
        split it the same way."""
        cached = (self.cached_input_tokens or 0) if cache_apart else 0
        return {
            "input_tokens": max((self.input_tokens or 0) - cached, 0),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": min(cached, self.input_tokens or 0),
            "output_tokens": self.output_tokens or 0,
        }

    def to_responses(self) -> dict[str, Any]:
        """The Responses API's usage object. `cache_write_tokens` is 0: engines do not report it."""
        input_tokens = self.input_tokens or 0
        output_tokens = self.output_tokens or 0
        return {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_input_tokens or 0, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens or 0},
            "total_tokens": input_tokens + output_tokens,
        }


# Whole responses ----------------------------------------------------------------------------------------


def from_chat(usage: Any) -> Usage | None:
    """A chat completion's (or final chunk's) `usage` object; None when absent."""
    if not isinstance(usage, dict):
        return None
    return Usage(
        input_tokens=_int(usage.get("prompt_tokens")),
        output_tokens=_int(usage.get("completion_tokens")),
        cached_input_tokens=_int(_get(usage, "prompt_tokens_details", "cached_tokens")),
        reasoning_tokens=_int(_get(usage, "completion_tokens_details", "reasoning_tokens")),
    )


def from_anthropic(usage: Any) -> Usage | None:
    """An Anthropic `usage` object: input is input_tokens + cache_creation + cache_read."""
    if not isinstance(usage, dict):
        return None
    base = _int(usage.get("input_tokens"))
    read = _int(usage.get("cache_read_input_tokens"))
    created = _int(usage.get("cache_creation_input_tokens"))
    total = None if base is None and read is None and created is None else (base or 0) + (read or 0) + (created or 0)
    return Usage(input_tokens=total, output_tokens=_int(usage.get("output_tokens")), cached_input_tokens=read)


def from_responses(usage: Any) -> Usage | None:
    """A Response object's `usage`."""
    if not isinstance(usage, dict):
        return None
    return Usage(
        input_tokens=_int(usage.get("input_tokens")),
        output_tokens=_int(usage.get("output_tokens")),
        cached_input_tokens=_int(_get(usage, "input_tokens_details", "cached_tokens")),
        reasoning_tokens=_int(_get(usage, "output_tokens_details", "reasoning_tokens")),
    )


def _protocol_of(body: dict[str, Any]) -> Protocol | None:
    if body.get("object") == "response":
        return "responses"
    if body.get("type") == "message":
        return "anthropic"
    if "choices" in body or str(body.get("object", "")).startswith("chat.completion"):
        return "chat"
    return None


def usage_from_response(body: Any, protocol: Protocol | None = None) -> Usage | None:
    """The usage of a whole response in `protocol` (recognised from the body when not told)."""
    if not isinstance(body, dict):
        return None
    protocol = protocol or _protocol_of(body)
    if protocol == "chat":
        return from_chat(body.get("usage"))
    if protocol == "anthropic":
        return from_anthropic(body.get("usage"))
    if protocol == "responses":
        return from_responses(body.get("usage"))
    return None


# Streams ------------------------------------------------------------------------------------------------


def count_chunk_tokens(chunk: Any) -> int:
    """Tokens in one chat chunk, by the one-token-per-delta estimate: 1 for each choice whose delta
    carries content, reasoning, refusal or tool-call argument text."""
    if not isinstance(chunk, dict):
        return 0
    choices = chunk.get("choices")
    if not isinstance(choices, list):
        return 0
    count = 0
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        # A chat chunk's delta, or a completions chunk's text.
        if (isinstance(delta, dict) and delta_has_tokens(delta)) or (
            isinstance(choice.get("text"), str) and choice["text"]
        ):
            count += 1
    return count


def delta_has_tokens(delta: dict[str, Any]) -> bool:
    """Whether a chat delta carries generated text of any kind."""
    if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or delta.get("refusal"):
        return True
    calls = delta.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and function.get("arguments"):
                return True
    return False


_ANTHROPIC_COUNTED = frozenset({"content_block_delta"})
_RESPONSES_COUNTED = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
        "response.custom_tool_call_input.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
    }
)
_ANTHROPIC_INPUT_PARTS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
_RESPONSES_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


class StreamUsage:
    """Usage read from a stream in `protocol`, event by event. `feed(data)` takes each parsed SSE data
    object (a chat chunk, or an Anthropic/Responses event whose "type" names it); `usage` is what
    the upstream reported, with output_tokens counted from deltas when it reported none."""

    __slots__ = ("_input_parts", "_reported", "counted", "protocol")

    def __init__(self, protocol: Protocol) -> None:
        self.protocol = protocol
        self.counted = 0
        self._reported: Usage | None = None
        self._input_parts: list[int | None] = [None, None, None]

    def feed(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        if self.protocol == "chat":
            self.counted += count_chunk_tokens(data)
            reported = from_chat(data.get("usage"))
            if reported is not None:
                # vLLM's continuous usage stats repeat a cumulative count in every chunk: the last wins.
                self._reported = reported
            return
        kind = data.get("type")
        if self.protocol == "anthropic":
            if kind in _ANTHROPIC_COUNTED:
                self.counted += 1
            elif kind == "message_start":
                usage = _get(data, "message", "usage")
                start = from_anthropic(usage)
                if start is not None:
                    self._input_parts = [_int(usage.get(key)) for key in _ANTHROPIC_INPUT_PARTS]
                    # message_start's output count is a placeholder (Anthropic sends 1); only input counts.
                    start.output_tokens = None
                    self._reported = start
            elif kind == "message_delta":
                self._merge_anthropic_delta(data.get("usage"))
        elif self.protocol == "responses":
            if kind in _RESPONSES_COUNTED:
                self.counted += 1
            elif kind in _RESPONSES_FINAL:
                reported = from_responses(_get(data, "response", "usage"))
                if reported is not None:
                    self._reported = reported

    def _merge_anthropic_delta(self, usage: Any) -> None:
        # message_delta's counts are cumulative; an input count there replaces message_start's, part by part.
        if not isinstance(usage, dict):
            return
        current = self._reported or Usage()
        output = _int(usage.get("output_tokens"))
        if output is not None:
            current.output_tokens = output
        parts = [_int(usage.get(key)) for key in _ANTHROPIC_INPUT_PARTS]
        if any(part is not None for part in parts):
            self._input_parts = [
                new if new is not None else old for new, old in zip(parts, self._input_parts, strict=True)
            ]
            current.input_tokens = sum(part or 0 for part in self._input_parts)
            current.cached_input_tokens = self._input_parts[1]
        self._reported = current

    @property
    def reported(self) -> Usage | None:
        """Exactly what the upstream reported, or None."""
        return self._reported

    @property
    def usage(self) -> Usage:
        return stream_usage(self._reported, self.counted)


def stream_usage(reported: Usage | None, counted: int) -> Usage:
    """A stream's usage: what the upstream reported, with output_tokens = `counted` (and `estimated`)
    when it reported no output count."""
    if reported is not None and reported.output_tokens is not None:
        return reported
    usage = Usage(output_tokens=counted, estimated=True)
    if reported is not None:
        usage.input_tokens = reported.input_tokens
        usage.cached_input_tokens = reported.cached_input_tokens
    return usage
