"""Anthropic Messages API <-> OpenAI chat completions.

Requests: `messages_to_chat(body)` turns a /v1/messages body into a chat completions body.
- `system` (a string or a list of text blocks) becomes the first, system, message.
- User text and image blocks become content parts (an image's base64 source a data: URL);
  `tool_result` blocks become `tool` messages, placed first (chat wants them right after the
  assistant turn that called the tools), with the rest of the user turn after them. A tool
  result's text is its content (a string, or its text blocks joined by newlines); images in it
  move to the user message after the tool messages, since a tool message holds text only; an
  `is_error` result is prefixed "Error: ", since chat has no error flag.
- Assistant text blocks are joined into `content`, `tool_use` blocks become `tool_calls`
  (input serialised as the arguments string); thinking blocks are dropped.
- Consecutive turns of one role are merged, as Anthropic itself does.
- `tools` become function tools (`input_schema` is the parameters); `tool_choice` auto, any,
  tool and none become "auto", "required", the named function and "none";
  `disable_parallel_tool_use` becomes `parallel_tool_calls: false`.
- `max_tokens`, `temperature`, `top_p` and `top_k` (llama.cpp, vLLM and SGLang take it in chat;
  the gateway leaves it out for an external provider) are kept, `stop_sequences` becomes `stop`,
  `stream` asks for a stream ending in a usage chunk. `metadata` is dropped.
- Structured outputs: `output_config.format` (and the beta's top-level `output_format`), a
  `json_schema` format, becomes chat's `response_format` with that schema (strict), as the
  Responses API's `text.format` does; an engine constrains its answer to the schema.
- `thinking` with a `budget_tokens` not below `max_tokens` is refused, as Anthropic refuses it.
- What has no chat equivalent is ignored and named in the returned dict's "_ignored" list
  (always present: the gateway pops it before sending): `thinking`, `output_config.effort`,
  server tools (web search, code execution, ... any tool with a `type` other than "custom"), and
  unknown top-level fields.
- Malformed input raises `TranslationError(message, param)`, answered as an Anthropic 400.

Responses: `chat_to_message(resp, model, stop_sequences=...)` turns a chat completion into an
Anthropic message.
- The id is "msg_" + the upstream id without its "chatcmpl-" prefix.
- Tool call arguments are parsed into `input`. Arguments that are not a JSON object (invalid
  JSON, or an array, ...) are kept, not dropped: `input` is `{"_raw_arguments": "<text>"}`, so the
  client's schema check fails and tells the model, and nothing the model wrote is lost. Empty
  arguments are `{}`.
- finish_reason stop -> end_turn, length -> max_tokens, tool_calls/function_call -> tool_use (as
  is "stop" with tool calls present), content_filter -> refusal.
- A stop string that matched gives stop_reason "stop_sequence" and the string in `stop_sequence`,
  when it is one of the request's `stop_sequences` (passed in; a stop the engine or its chat
  template added is not one). The engine says which matched in one of two ways: vLLM and SGLang
  in the choice's `stop_reason` (a string; an integer there is a stop token id, never a match),
  llama.cpp's llama-server in a top-level `__verbose` object (`stop_type` "word",
  `stopping_word`) that it adds only when the chat request carries `"verbose": true`.
  `messages_to_chat` does not add `verbose` (an external OpenAI-compatible provider refuses
  fields it does not know): whoever sends the request to a llama.cpp engine adds it. The
  translator reads `__verbose` when it is there and never passes it on.
- usage: input_tokens leaves out cached prompt tokens, reported as cache_read_input_tokens, and
  cache_creation_input_tokens is 0 (`Usage.to_anthropic`). When the response has no `usage`,
  llama.cpp's `timings` give the counts (`usage_from_timings`).

Streams: `ChatToAnthropicStream` turns chat chunks into Anthropic's event sequence (its
docstring says how message_start learns the prompt's size).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from ._common import (
    ChatChunkReader,
    Event,
    ToolCall,
    as_dict,
    finalize_messages,
    first_choice,
    matched_stop,
    push_message,
    require,
    sse,
    stream_fields,
    whole_usage,
)
from .errors import TranslationError, anthropic_error
from .usage import Usage, stream_usage

__all__ = [
    "ChatToAnthropicStream",
    "TranslationError",
    "anthropic_error",
    "chat_to_message",
    "error_event",
    "message_id",
    "messages_to_chat",
    "parse_tool_input",
    "ping_event",
    "requested_stop",
    "sse",
    "stop_reason",
]

# Request fields that are translated, or dropped on purpose without a note.
_KNOWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "metadata",
        "thinking",
        "output_config",
        "output_format",
    }
)


# Requests -----------------------------------------------------------------------------------------------


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as a chat completions request (see the module docstring)."""
    require(body, dict, "body", "a JSON object")
    ignored: list[str] = [key for key in body if key not in _KNOWN_FIELDS]
    chat: dict[str, Any] = {"model": require(body.get("model"), str, "model", "a string")}
    max_tokens = require(body.get("max_tokens"), int, "max_tokens", "an integer")
    if max_tokens < 1:
        raise TranslationError("max_tokens: must be at least 1.", "max_tokens")

    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _system_text(system)
        if text:
            messages.append({"role": "system", "content": text})
    turns = require(body.get("messages"), list, "messages", "an array of messages")
    if not turns:
        raise TranslationError("messages: at least one message is required.", "messages")
    for i, turn in enumerate(turns):
        _add_turn(messages, turn, f"messages[{i}]")
    chat["messages"] = finalize_messages(messages)
    chat["max_tokens"] = max_tokens

    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            chat[key] = require(value, (int, float), key, "a number")
    if body.get("top_k") is not None:
        chat["top_k"] = require(body["top_k"], int, "top_k", "an integer")
    _output_format(body, chat, ignored)
    stop = body.get("stop_sequences")
    if stop is not None:
        require(stop, list, "stop_sequences", "an array of strings")
        for j, item in enumerate(stop):
            require(item, str, f"stop_sequences[{j}]", "a string")
        if stop:
            chat["stop"] = list(stop)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        budget = thinking.get("budget_tokens")
        if isinstance(budget, int) and not isinstance(budget, bool) and budget >= max_tokens:
            raise TranslationError(
                f"max_tokens ({max_tokens}) must be greater than thinking.budget_tokens ({budget}).",
                "thinking.budget_tokens",
            )
        ignored.append("thinking")

    tools = _tools(body.get("tools"), ignored)
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat, bool(tools))

    stream = body.get("stream")
    if stream is not None and require(stream, bool, "stream", "a boolean"):
        stream_fields(chat)
    chat["_ignored"] = ignored
    return chat


def _output_format(body: dict[str, Any], chat: dict[str, Any], ignored: list[str]) -> None:
    """`output_config.format` (or the beta's `output_format`): a JSON schema the answer must follow,
    as chat's `response_format`."""
    config = body.get("output_config")
    form = None
    where = "output_config.format"
    if config is not None:
        require(config, dict, "output_config", "an object")
        form = config.get("format")
        if config.get("effort") is not None:
            ignored.append("output_config.effort")
    if form is None and body.get("output_format") is not None:
        form, where = body["output_format"], "output_format"
    if form is None:
        return
    require(form, dict, where, "an object")
    if form.get("type") != "json_schema":
        raise TranslationError(f'{where}.type: must be "json_schema", got {form.get("type")!r}.', f"{where}.type")
    schema = require(form.get("schema"), dict, f"{where}.schema", "a JSON schema object")
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    require(system, list, "system", "a string or an array of text blocks")
    texts = []
    for j, block in enumerate(system):
        param = f"system[{j}]"
        require(block, dict, param, "a text block")
        if block.get("type") != "text":
            raise TranslationError(f"{param}.type: only text blocks are allowed in system.", f"{param}.type")
        texts.append(require(block.get("text"), str, f"{param}.text", "a string"))
    return "\n\n".join(texts)


def _add_turn(messages: list[dict[str, Any]], turn: Any, param: str) -> None:
    require(turn, dict, param, "a message object")
    role = turn.get("role")
    if role not in ("user", "assistant"):
        raise TranslationError(f'{param}.role: must be "user" or "assistant", got {role!r}.', f"{param}.role")
    content = turn.get("content")
    if isinstance(content, str):
        if role == "user":
            push_message(messages, {"role": "user", "content": [{"type": "text", "text": content}]})
        else:
            push_message(messages, {"role": "assistant", "content": content})
        return
    require(content, list, f"{param}.content", "a string or an array of content blocks")
    if role == "user":
        _add_user_blocks(messages, content, f"{param}.content")
    else:
        _add_assistant_blocks(messages, content, f"{param}.content")


def _add_user_blocks(messages: list[dict[str, Any]], blocks: list[Any], param: str) -> None:
    tool_messages: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    moved_images: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        require(block, dict, where, "a content block")
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": require(block.get("text"), str, f"{where}.text", "a string")})
        elif kind == "image":
            parts.append(_image_part(block, where))
        elif kind == "document":
            parts.append({"type": "text", "text": _document_text(block, where)})
        elif kind == "tool_result":
            tool_messages.append(_tool_result(block, where, moved_images))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise TranslationError(
                f"{where}.type: unsupported content block type {kind!r} in a user turn.", f"{where}.type"
            )
    for message in tool_messages:
        messages.append(message)
    parts = moved_images + parts
    if parts:
        push_message(messages, {"role": "user", "content": parts})


def _add_assistant_blocks(messages: list[dict[str, Any]], blocks: list[Any], param: str) -> None:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"{param}[{j}]"
        require(block, dict, where, "a content block")
        kind = block.get("type")
        if kind == "text":
            texts.append(require(block.get("text"), str, f"{where}.text", "a string"))
        elif kind == "tool_use":
            arguments = block.get("input", {})
            if not isinstance(arguments, dict):
                raise TranslationError(f"{where}.input: expected an object.", f"{where}.input")
            calls.append(
                {
                    "id": require(block.get("id"), str, f"{where}.id", "a string"),
                    "type": "function",
                    "function": {
                        "name": require(block.get("name"), str, f"{where}.name", "a string"),
                        "arguments": json.dumps(arguments, ensure_ascii=False),
                    },
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise TranslationError(
                f"{where}.type: unsupported content block type {kind!r} in an assistant turn.", f"{where}.type"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    push_message(messages, message)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = require(block.get("source"), dict, f"{where}.source", "an image source object")
    kind = source.get("type")
    if kind == "base64":
        media_type = require(source.get("media_type"), str, f"{where}.source.media_type", "a string")
        data = require(source.get("data"), str, f"{where}.source.data", "a string")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = require(source.get("url"), str, f"{where}.source.url", "a string")
    else:
        raise TranslationError(
            f"{where}.source.type: image sources must be base64 or url here, not {kind!r}.", f"{where}.source.type"
        )
    return {"type": "image_url", "image_url": {"url": url}}


def _document_text(block: dict[str, Any], where: str) -> str:
    # Plain-text documents (a text source, or content blocks) read as text; PDFs and files cannot.
    source = require(block.get("source"), dict, f"{where}.source", "a document source object")
    kind = source.get("type")
    if kind == "text":
        text = require(source.get("data"), str, f"{where}.source.data", "a string")
    elif kind == "content":
        content = source.get("content")
        if isinstance(content, str):
            text = content
        else:
            require(content, list, f"{where}.source.content", "a string or an array of text blocks")
            text = "\n".join(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    else:
        raise TranslationError(
            f"{where}.source.type: only text documents can be sent to this model, not {kind!r}.",
            f"{where}.source.type",
        )
    title = block.get("title")
    return f"{title}\n\n{text}" if isinstance(title, str) and title else text


def _tool_result(block: dict[str, Any], where: str, moved_images: list[dict[str, Any]]) -> dict[str, Any]:
    call_id = require(block.get("tool_use_id"), str, f"{where}.tool_use_id", "a string")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        require(content, list, f"{where}.content", "a string or an array of content blocks")
        texts = []
        for k, item in enumerate(content):
            inner = f"{where}.content[{k}]"
            require(item, dict, inner, "a content block")
            kind = item.get("type")
            if kind == "text":
                texts.append(require(item.get("text"), str, f"{inner}.text", "a string"))
            elif kind == "image":
                moved_images.append(_image_part(item, inner))
            elif kind == "document":
                texts.append(_document_text(item, inner))
            else:
                raise TranslationError(
                    f"{inner}.type: unsupported block type {kind!r} in a tool result.", f"{inner}.type"
                )
        text = "\n".join(texts)
    if block.get("is_error") is True:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(tools: Any, ignored: list[str]) -> list[dict[str, Any]]:
    if tools is None:
        return []
    require(tools, list, "tools", "an array of tools")
    out = []
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        require(tool, dict, where, "a tool object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            ignored.append(f"tools:{kind}")
            continue
        function: dict[str, Any] = {"name": require(tool.get("name"), str, f"{where}.name", "a string")}
        description = tool.get("description")
        if isinstance(description, str) and description:
            function["description"] = description
        function["parameters"] = require(
            tool.get("input_schema"), dict, f"{where}.input_schema", "a JSON schema object"
        )
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any], have_tools: bool) -> None:
    if choice is None:
        return
    require(choice, dict, "tool_choice", "an object")
    kind = choice.get("type")
    if kind == "auto":
        mapped: Any = "auto"
    elif kind == "any":
        mapped = "required"
    elif kind == "tool":
        mapped = {
            "type": "function",
            "function": {"name": require(choice.get("name"), str, "tool_choice.name", "a string")},
        }
    elif kind == "none":
        mapped = "none"
    else:
        raise TranslationError(f"tool_choice.type: unknown tool choice {kind!r}.", "tool_choice.type")
    if not have_tools:
        # Engines refuse a tool_choice without tools; with none there is nothing to choose.
        return
    chat["tool_choice"] = mapped
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


# Responses ----------------------------------------------------------------------------------------------


def message_id(upstream_id: Any) -> str:
    """ "msg_" + the upstream id without its "chatcmpl-" prefix; a fresh one when there is none."""
    if isinstance(upstream_id, str) and upstream_id:
        return "msg_" + upstream_id.removeprefix("chatcmpl-")
    return "msg_" + uuid.uuid4().hex


def parse_tool_input(arguments: Any) -> dict[str, Any]:
    """Tool call arguments as an Anthropic `input` object: `{}` when empty, `{"_raw_arguments": text}`
    when they are not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None:
        return {}
    if not isinstance(arguments, str):
        return {"_raw_arguments": json.dumps(arguments, ensure_ascii=False)}
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return {"_raw_arguments": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw_arguments": arguments}


def requested_stop(matched: Any, stop_sequences: Iterable[Any] | None) -> str | None:
    """`matched` (the stop string the engine says it matched) when it is one of the request's
    `stop_sequences`, else None: an empty string, a token id, or a stop the client did not ask
    for is no stop sequence."""
    if not isinstance(matched, str) or not matched or stop_sequences is None or isinstance(stop_sequences, str):
        return None
    return matched if any(isinstance(s, str) and s == matched for s in stop_sequences) else None


def stop_reason(finish_reason: Any, *, tool_use: bool, matched_stop: Any = None) -> str:
    """Anthropic's stop_reason for an OpenAI finish_reason; `matched_stop` is the request's stop
    sequence that matched (`requested_stop`), if any."""
    if finish_reason == "length":
        return "max_tokens"
    if finish_reason in ("tool_calls", "function_call") or tool_use:
        return "tool_use"
    if finish_reason == "content_filter":
        return "refusal"
    if isinstance(matched_stop, str) and matched_stop:
        return "stop_sequence"
    return "end_turn"


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # a few providers answer with content parts
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def chat_to_message(resp: dict[str, Any], model: str, *, stop_sequences: Iterable[str] | None = None) -> dict[str, Any]:
    """A chat completion as an Anthropic message (see the module docstring). `stop_sequences`: the
    request's, so a matched one is reported as such."""
    choice = first_choice(resp)
    message = as_dict(choice.get("message"))
    msg_id = message_id(resp.get("id"))
    content: list[dict[str, Any]] = []
    text = _text_of(message.get("content"))
    refusal = message.get("refusal")
    if not text and isinstance(refusal, str):
        text = refusal
    if text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        calls = []
    legacy = message.get("function_call")
    if not calls and isinstance(legacy, dict):
        calls = [{"function": legacy}]
    for k, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        function = as_dict(call.get("function"))
        content.append(
            {
                "type": "tool_use",
                "id": str(call.get("id") or f"toolu_{msg_id[4:]}_{k}"),
                "name": str(function.get("name") or ""),
                "input": parse_tool_input(function.get("arguments")),
            }
        )
    matched = requested_stop(matched_stop(resp, choice), stop_sequences)
    reason = stop_reason(
        choice.get("finish_reason"), tool_use=any(b["type"] == "tool_use" for b in content), matched_stop=matched
    )
    usage = whole_usage(resp) or Usage()
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": matched if reason == "stop_sequence" else None,
        "usage": usage.to_anthropic(),
    }


# Streams ------------------------------------------------------------------------------------------------


def error_event(message: str, type: str = "api_error") -> Event:
    """The `error` event that ends an Anthropic stream that failed after it started
    (overloaded_error for an overloaded upstream, api_error otherwise)."""
    return ("error", {"type": "error", "error": {"type": type, "message": message}})


def ping_event() -> Event:
    return ("ping", {"type": "ping"})


class ChatToAnthropicStream(ChatChunkReader):
    """OpenAI chat chunks in, Anthropic stream events out.

    `feed(chunk)` takes each parsed chunk (the JSON after "data: ", [DONE] left out) and returns
    the events it makes; `finish()` (once the upstream is done) closes the open block and sends
    message_delta (stop_reason, usage) and message_stop. `fail(message)` ends a stream whose
    upstream died with an `error` event instead; a chunk carrying an "error" object does the same.

    The order is Anthropic's: message_start, ping, then for each block content_block_start,
    content_block_delta (text_delta, or input_json_delta for a tool's input), content_block_stop,
    and last message_delta and message_stop.

    Usage. The engine reports the prompt's size only at the end, but Anthropic puts input_tokens
    in message_start (a required integer there). So whoever counts the prompt first (with the
    engine's tokenizer) gives the count, to the constructor or to `start(input_tokens=n)`, and
    calls `start` before the first `feed`: a `feed` that comes first sends message_start itself,
    with the count known by then. With no count known message_start says 0, the only integer the
    API allows that claims nothing. message_delta's usage is cumulative (clients overwrite
    message_start's counts with it): input_tokens there is the engine's final count, else the
    count given here, else it is left out; output tokens are the engine's count, else
    `tokens_counted` (one per content/argument delta). Without a usage chunk llama.cpp's
    `timings` give both counts. Both events split the prompt the same way, every token of it in
    input_tokens, with cache_creation_input_tokens and cache_read_input_tokens 0: what the
    engine's cache held is known only at the end, after message_start has split the prompt (a
    client adding message_start's input to message_delta's cache reads would count them twice).

    Stop sequences: pass the request's `stop_sequences`; when the engine says one of them matched
    (see the module docstring) message_delta has stop_reason "stop_sequence" and the string.

    A tool call's block opens once its name is known (its arguments so far go in one delta).
    Deltas for a tool call whose block was already closed (an upstream interleaving parallel calls,
    which no engine we know does) are sent with that block's index, after its stop.
    """

    __slots__ = ("_block", "_next_index", "input_tokens", "message_id", "model", "stop_sequences")

    def __init__(
        self,
        model: str,
        *,
        message_id: str | None = None,
        input_tokens: int | None = None,
        stop_sequences: Iterable[str] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.message_id = message_id
        #: The prompt's size as counted before the engine reports it; None while unknown.
        self.input_tokens = input_tokens
        #: The request's stop_sequences: only a match among them is reported as a stop sequence.
        self.stop_sequences: tuple[str, ...] = tuple(s for s in stop_sequences or () if isinstance(s, str))
        self._block: tuple[str, int] | None = None  # the open block: ("text", index) or ("tool", index)
        self._next_index = 0

    def _begin(self, chunk: dict[str, Any]) -> list[Event]:
        return self.start(chunk.get("id"))

    def start(self, upstream_id: Any = None, *, input_tokens: int | None = None) -> list[Event]:
        """message_start and a ping; sent by the first `feed` if not called before. `input_tokens`:
        the prompt's size, when it is known now (kept for message_delta even if the stream had
        started already)."""
        if input_tokens is not None:
            self.input_tokens = input_tokens
        if self._started:
            return []
        self._started = True
        if self.message_id is None:
            self.message_id = message_id(upstream_id)
        message: dict[str, Any] = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": Usage(input_tokens=self.input_tokens, output_tokens=0).to_anthropic(cache_apart=False),
        }
        return [("message_start", {"type": "message_start", "message": message}), ping_event()]

    def _close_block(self, events: list[Event]) -> None:
        if self._block is not None:
            events.append(("content_block_stop", {"type": "content_block_stop", "index": self._block[1]}))
            self._block = None

    def _open_block(self, kind: str, block: dict[str, Any], events: list[Event]) -> int:
        self._close_block(events)
        index = self._next_index
        self._next_index += 1
        self._block = (kind, index)
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": block}))
        return index

    def _on_text(self, text: str, events: list[Event], logprobs: list[dict[str, Any]]) -> None:
        if self._block is not None and self._block[0] == "text":
            index = self._block[1]
        else:
            index = self._open_block("text", {"type": "text", "text": ""}, events)
        delta = {"type": "text_delta", "text": text}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))

    def _on_tool_arguments(self, call: ToolCall, piece: str, events: list[Event]) -> None:
        self._json_delta(call.slot, piece, events)

    def _on_tool_open(self, call: ToolCall, arguments: str, events: list[Event]) -> None:
        if call.call_id is None:
            call.call_id = f"toolu_{(self.message_id or 'msg_')[4:]}_{call.index}"
        block = {"type": "tool_use", "id": call.call_id, "name": call.name or "", "input": {}}
        call.slot = self._open_block("tool", block, events)
        if arguments:
            self._json_delta(call.slot, arguments, events)

    def _json_delta(self, index: int, piece: str, events: list[Event]) -> None:
        delta = {"type": "input_json_delta", "partial_json": piece}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))

    def finish(self) -> list[Event]:
        """The end of the stream: close the open block, message_delta, message_stop."""
        if self._done:
            return []
        events = self.start() if not self._started else []
        for call in self._tools.unopened():
            call.opened = True
            self._on_tool_open(call, call.text, events)
        self._close_block(events)
        self._done = True
        matched = requested_stop(self.matched_stop, self.stop_sequences)
        reason = stop_reason(self.finish_reason, tool_use=bool(self._tools.calls), matched_stop=matched)
        delta = {"stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None}
        events.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": self._final_usage()}))
        events.append(("message_stop", {"type": "message_stop"}))
        return events

    def _known_usage(self) -> Usage | None:
        """The engine's report, its input count (when it gave none) the one given here."""
        reported = self.reported_usage
        if self.input_tokens is not None and (reported is None or reported.input_tokens is None):
            reported = reported or Usage()
            reported.input_tokens = self.input_tokens
        return reported

    def _final_usage(self) -> dict[str, Any]:
        """message_delta's usage: the prompt split as message_start split it (every prompt token an
        input token: the cache's part was not known then); the input parts left out when the
        prompt's size is still unknown (message_start's 0 stands)."""
        known = self._known_usage()
        if known is None:
            return {"output_tokens": self.tokens_counted}
        usage = known.to_anthropic(cache_apart=False)
        if known.output_tokens is None:
            usage["output_tokens"] = self.tokens_counted
        if known.input_tokens is None:
            for part in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"):
                del usage[part]
        return usage

    @property
    def usage(self) -> Usage:
        """This stream's usage for the gateway's records: the engine's counts, the prompt count
        given here when the engine reported none, output estimated when not reported."""
        return stream_usage(self._known_usage(), self.tokens_counted)

    def fail(self, message: str, type: str = "api_error") -> list[Event]:
        """End the stream with an `error` event (nothing follows it)."""
        if self._done:
            return []
        self._done = True
        return [error_event(message, type)]
