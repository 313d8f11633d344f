"""OpenAI Responses API (as Codex speaks it) <-> OpenAI chat completions.

Requests: `responses_to_chat(body)` turns a /v1/responses body into a chat completions body.
- `instructions` becomes the system message; leading system/developer input messages merge into
  it, later ones stay system messages where they are. An `input` string is one user message.
- Message items: input_text/output_text parts are text, input_image parts image_url parts
  (input_file parts, and images given only by file_id, are refused: there is no Files API here).
- `function_call` items become assistant `tool_calls` (an assistant message followed by calls,
  or consecutive calls, make one assistant turn); `function_call_output` items become `tool`
  messages (an output given as content parts gives its text; its images go to a user message
  after the tool messages, as a tool message holds text only).
- Custom (free-form) tools, Codex's `apply_patch` for one: chat has only JSON-schema functions,
  so a custom tool is offered as a function with ONE required string parameter, "input", whose
  description carries the tool's grammar when it has one. `custom_tool_call` items become calls
  with arguments `{"input": <input>}`, `custom_tool_call_output` items tool messages; on the way
  back a call to a custom tool's name becomes a `custom_tool_call` whose input is that string.
- Namespace tools (Codex's "collaboration", holding spawn_agent, ...): each function or custom
  tool inside is offered as the chat function `<namespace>__<name>` (made valid for chat's
  ^[a-zA-Z0-9_-]{1,64}$ deterministically when it would not be: `ToolNames`), its description
  after the namespace's. `function_call` and `custom_tool_call` items carrying a `namespace`
  become calls to that name; a tool_choice or allowed_tools entry naming a tool with its
  `namespace` (or by its own name, when only one namespace has it and no top-level tool does),
  or a whole namespace in allowed_tools, chooses those names. On the way back a call to such a
  name is an item with the tool's own `name` and its `namespace`.
- `local_shell_call` items (older Codex history) become calls to a "local_shell" function whose
  arguments are the action, so their outputs still follow a call.
- Consecutive user turns are merged (chat templates that want alternating roles refuse them).
- `include: ["message.output_text.logprobs"]` and `top_logprobs` -> chat's `logprobs` and
  `top_logprobs`; the tokens' log probabilities come back in each output_text's `logprobs` (and
  in the stream's output_text.delta and .done events), as chat's `logprobs.content` gives them.
- `max_output_tokens` -> `max_tokens`; `temperature`, `top_p`, `parallel_tool_calls` kept;
  `tool_choice` auto/none/required kept, a named function or custom tool becomes the named
  function, `allowed_tools` keeps only the allowed tools under its mode; `text.format`
  json_schema/json_object -> `response_format`; `stream` asks for a stream ending in a usage chunk.
- Refused with a TranslationError (a 400): `conversation` (no Conversations API), `prompt` (no
  prompt templates), `background: true` and `item_reference` items. `previous_response_id` is the
  gateway's to follow before translating (apps.gateway.response_store replays the stored
  conversation into `input`): this translation takes whole conversations only. The Response's
  `store` and `previous_response_id` are the request's as the gateway decided them.
- Input items of a type not translated and not ignored (below) are refused, naming the type:
  an unknown type, and items that carry what an engine could use but cannot be given here:
  `shell_call`/`shell_call_output` and `apply_patch_call`/`apply_patch_call_output` (built-in
  tools, not offered to engines), `tool_search_call`/`tool_search_output` and
  `additional_tools` (tools loaded mid-conversation), `configuration_update`,
  `compaction_trigger`.
- Ignored, and named in the returned dict's "_ignored" list (always present: the gateway pops
  it before sending): `reasoning`, `include` entries other than logprobs, server-side and built-in tools
  ("tools:web_search", ...) and a tool_choice naming one, `text.verbosity`, unknown top-level
  fields, and the input items in `IGNORED_INPUT_ITEMS` ("input:reasoning", ...), each the
  trace of something that ran on OpenAI's servers or carrying nothing an engine can read:
  `reasoning` (the model's earlier reasoning, encrypted or summarised: chat has no place for
  it), `compaction` (OpenAI's encrypted summary of earlier turns), `web_search_call`,
  `file_search_call`, `image_generation_call`, `code_interpreter_call`, `program` and
  `program_output` (hosted tools, their results kept by OpenAI), `mcp_list_tools`, `mcp_call`,
  `mcp_approval_request` and `mcp_approval_response` (remote MCP, called by OpenAI), and
  `computer_call` with `computer_call_output` (the built-in computer tool is not offered, and a
  call and its output are dropped together, so no tool message is left without its call).
  `metadata`, `user`, `prompt_cache_key`, `safety_identifier`, `service_tier`, `truncation` and
  `stream_options` are dropped without a note.

Responses: `chat_to_response(resp, request=..., response_id=..., created_at=...)` and the stream
`ChatToResponsesStream` build the Response object. Output items get ids derived from the
response id: msg_<id>_<n>, fc_<id>_<n>, ctc_<id>_<n> (n the output index). A length finish is
status "incomplete" with incomplete_details.reason "max_output_tokens" (content_filter likewise),
and a stream then ends in `response.incomplete`, as the OpenAI API's does; otherwise "completed"
and `response.completed`. Usage is the engine's `usage`, else llama.cpp's `timings`.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from ._common import (
    ChatChunkReader,
    Event,
    ToolCall,
    as_dict,
    dumps,
    finalize_messages,
    first_choice,
    push_message,
    require,
    sse,
    stream_fields,
    token_logprobs,
    whole_usage,
)
from .errors import TranslationError, openai_error
from .usage import Usage, stream_usage

__all__ = [
    "CUSTOM_TOOL_INPUT",
    "IGNORED_INPUT_ITEMS",
    "ChatToResponsesStream",
    "ToolNames",
    "TranslationError",
    "chat_to_response",
    "custom_tool_input",
    "custom_tool_names",
    "openai_error",
    "responses_to_chat",
    "sse",
]

#: The one string parameter a custom tool is offered with, as a chat function.
CUSTOM_TOOL_INPUT = "input"

_SILENTLY_DROPPED = frozenset(
    {
        "metadata",
        "user",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "service_tier",
        "truncation",
        "stream_options",
    }
)
_HANDLED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "store",
        "text",
        "reasoning",
        "include",
        "previous_response_id",
        "conversation",
        "prompt",
        "background",
        "top_logprobs",
    }
)
#: Why each request field that refers to something kept elsewhere is refused here.
_NOT_HERE = {
    "previous_response_id": "the gateway replays the stored conversation before translating; "
    "this translation takes the whole conversation in input",
    "conversation": "this gateway has no Conversations API; continue a conversation with "
    "previous_response_id, or send it whole in input",
    "prompt": "this gateway keeps no prompt templates; send the instructions and input themselves",
}

#: Input item types dropped (and noted as "input:<type>"): each is either the trace of something
#: that ran on OpenAI's servers, or carries nothing an engine here could read.
IGNORED_INPUT_ITEMS = frozenset(
    {
        # The model's earlier reasoning: encrypted for OpenAI's models, or summaries of it; chat has
        # no place for past reasoning (Codex sends these back every turn).
        "reasoning",
        # OpenAI's encrypted summary of the turns it replaced (from /responses/compact).
        "compaction",
        # Built-in tools that run on OpenAI's servers; their results stay there.
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "program",
        "program_output",
        # Remote MCP servers called by OpenAI, and their approvals.
        "mcp_list_tools",
        "mcp_call",
        "mcp_approval_request",
        "mcp_approval_response",
        # The built-in computer tool is not offered to an engine (it is one of the ignored tools):
        # its calls and their screenshots go together, so no tool message is left without its call.
        "computer_call",
        "computer_call_output",
    }
)
#: Input item types refused, with why; any type neither handled, ignored nor here is refused too.
_REFUSED_INPUT_ITEMS = {
    "item_reference": "send the item itself, or continue the conversation with previous_response_id",
    "shell_call": "the built-in shell tool is not offered to this model; use a function tool",
    "shell_call_output": "the built-in shell tool is not offered to this model; use a function tool",
    "apply_patch_call": "the built-in apply_patch tool is not offered to this model; use a custom tool",
    "apply_patch_call_output": "the built-in apply_patch tool is not offered to this model; use a custom tool",
    "tool_search_call": "tool search is not supported; send the tools in tools",
    "tool_search_output": "tool search is not supported; send the tools in tools",
    "additional_tools": "send every tool in tools",
    "configuration_update": "send the configuration in the request's own fields",
    "compaction_trigger": "this gateway does not compact conversations",
}


# Requests -----------------------------------------------------------------------------------------------


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API request as a chat completions request (see the module docstring)."""
    require(body, dict, "body", "a JSON object")
    for key, why in _NOT_HERE.items():
        if body.get(key):
            raise TranslationError(f"{key} is not supported: {why}.", key)
    if body.get("background") is True:
        raise TranslationError(
            "background is not supported: this gateway answers at once; leave it out and wait for the answer.",
            "background",
        )
    ignored = [key for key in body if key not in _HANDLED and key not in _SILENTLY_DROPPED]
    if body.get("reasoning"):
        ignored.append("reasoning")

    chat: dict[str, Any] = {"model": require(body.get("model"), str, "model", "a string")}
    _logprobs(body, chat, ignored)
    names = ToolNames(body.get("tools"))
    conversation = _Conversation()
    instructions = body.get("instructions")
    if instructions is not None:
        require(instructions, str, "instructions", "a string")
        if instructions:
            conversation.add({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        conversation.add({"role": "user", "content": [{"type": "text", "text": items}]})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _add_item(conversation, item, f"input[{i}]", ignored, names)
    elif items is not None or instructions is None:
        require(items, (str, list), "input", "a string or an array of input items")
    chat["messages"] = finalize_messages(conversation.done())

    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None:
        require(max_tokens, int, "max_output_tokens", "an integer")
        if max_tokens < 1:
            raise TranslationError("max_output_tokens: must be at least 1.", "max_output_tokens")
        chat["max_tokens"] = max_tokens
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            chat[key] = require(value, (int, float), key, "a number")
    _text_format(body.get("text"), chat, ignored)

    tools = _tools(body.get("tools"), ignored, names)
    tools = _tool_choice(body.get("tool_choice"), tools, chat, ignored, names)
    if tools:
        chat["tools"] = tools
        parallel = body.get("parallel_tool_calls")
        if parallel is not None:
            chat["parallel_tool_calls"] = require(parallel, bool, "parallel_tool_calls", "a boolean")
    else:
        chat.pop("tool_choice", None)

    stream = body.get("stream")
    if stream is not None and require(stream, bool, "stream", "a boolean"):
        stream_fields(chat)
    chat["_ignored"] = ignored
    return chat


class _Conversation:
    """Chat messages as they are built; images out of tool outputs wait for the tool messages to end."""

    __slots__ = ("messages", "waiting_images")

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.waiting_images: list[dict[str, Any]] = []

    def add(self, message: dict[str, Any]) -> None:
        self._flush()
        push_message(self.messages, message)

    def add_tool(self, message: dict[str, Any], images: list[dict[str, Any]]) -> None:
        self.messages.append(message)
        self.waiting_images.extend(images)

    def _flush(self) -> None:
        if self.waiting_images:
            images, self.waiting_images = self.waiting_images, []
            push_message(self.messages, {"role": "user", "content": images})

    def done(self) -> list[dict[str, Any]]:
        self._flush()
        return self.messages


def _add_item(conversation: _Conversation, item: Any, where: str, ignored: list[str], names: ToolNames) -> None:
    require(item, dict, where, "an input item object")
    kind = item.get("type")
    if kind is None or kind == "message":
        _add_message(conversation, item, where)
    elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
        call = _tool_call(item, kind, where, names)
        conversation.add({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
        call_id = item.get("call_id") if kind != "local_shell_call_output" else item.get("call_id") or item.get("id")
        call_id = require(call_id, str, f"{where}.call_id", "a string")
        text, images = _output_content(item.get("output"), f"{where}.output")
        conversation.add_tool({"role": "tool", "tool_call_id": call_id, "content": text}, images)
    elif isinstance(kind, str) and kind in IGNORED_INPUT_ITEMS:
        note = f"input:{kind}"
        if note not in ignored:
            ignored.append(note)
    elif isinstance(kind, str) and kind in _REFUSED_INPUT_ITEMS:
        raise TranslationError(
            f"{where}.type: {kind} items are not supported: {_REFUSED_INPUT_ITEMS[kind]}.", f"{where}.type"
        )
    else:
        raise TranslationError(
            f"{where}.type: unsupported input item type {kind!r}; this gateway translates messages, "
            "function and custom tool calls and their outputs.",
            f"{where}.type",
        )


def _add_message(conversation: _Conversation, item: dict[str, Any], where: str) -> None:
    role = item.get("role")
    content = item.get("content")
    if role == "user":
        conversation.add({"role": "user", "content": _user_parts(content, f"{where}.content")})
    elif role == "assistant":
        conversation.add({"role": "assistant", "content": _plain_text(content, f"{where}.content", "")})
    elif role in ("system", "developer"):
        text = _plain_text(content, f"{where}.content", "\n")
        if text:
            conversation.add({"role": "system", "content": text})
    else:
        raise TranslationError(
            f'{where}.role: must be "user", "assistant", "system" or "developer", got {role!r}.', f"{where}.role"
        )


_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


def _user_parts(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    require(content, list, where, "a string or an array of content parts")
    parts = []
    for j, part in enumerate(content):
        inner = f"{where}[{j}]"
        require(part, dict, inner, "a content part")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": require(part.get("text"), str, f"{inner}.text", "a string")})
        elif kind == "input_image":
            parts.append(_image_part(part, inner))
        elif kind == "input_file":
            raise TranslationError(f"{inner}: input_file parts are not supported; send the file's text.", inner)
        else:
            raise TranslationError(f"{inner}.type: unsupported content part type {kind!r}.", f"{inner}.type")
    return parts


def _plain_text(content: Any, where: str, joiner: str) -> str:
    if isinstance(content, str):
        return content
    require(content, list, where, "a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        inner = f"{where}[{j}]"
        require(part, dict, inner, "a content part")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            texts.append(require(part.get("text"), str, f"{inner}.text", "a string"))
        elif kind == "refusal":
            texts.append(require(part.get("refusal"), str, f"{inner}.refusal", "a string"))
        else:
            raise TranslationError(f"{inner}.type: {kind!r} parts are not allowed here.", f"{inner}.type")
    return joiner.join(texts)


def _image_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise TranslationError(f"{where}.file_id: images by file_id are not supported; send image_url.", where)
    image: dict[str, Any] = {"url": require(url, str, f"{where}.image_url", "a URL string")}
    detail = part.get("detail")
    if detail in ("low", "high", "auto"):
        image["detail"] = detail
    return {"type": "image_url", "image_url": image}


def _tool_call(item: dict[str, Any], kind: str, where: str, names: ToolNames) -> dict[str, Any]:
    if kind == "local_shell_call":
        call_id = require(item.get("call_id") or item.get("id"), str, f"{where}.call_id", "a string")
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "local_shell", "arguments": dumps(item.get("action") or {})},
        }
    call_id = require(item.get("call_id"), str, f"{where}.call_id", "a string")
    name = require(item.get("name"), str, f"{where}.name", "a string")
    namespace = item.get("namespace")
    if namespace is not None:
        name = names.flat(require(namespace, str, f"{where}.namespace", "a string"), name)
    if kind == "custom_tool_call":
        text = require(item.get("input"), str, f"{where}.input", "a string")
        arguments = dumps({CUSTOM_TOOL_INPUT: text})
    else:
        given = item.get("arguments")
        arguments = require(dumps(given) if isinstance(given, dict) else given, str, f"{where}.arguments", "a string")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _output_content(output: Any, where: str) -> tuple[str, list[dict[str, Any]]]:
    if isinstance(output, str):
        return output, []
    if output is None:
        return "", []
    require(output, list, where, "a string or an array of content parts")
    texts: list[str] = []
    images: list[dict[str, Any]] = []
    for j, part in enumerate(output):
        inner = f"{where}[{j}]"
        require(part, dict, inner, "a content part")
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            texts.append(require(part.get("text"), str, f"{inner}.text", "a string"))
        elif kind == "input_image":
            images.append(_image_part(part, inner))
        else:
            raise TranslationError(f"{inner}.type: unsupported tool output part {kind!r}.", f"{inner}.type")
    return "\n".join(texts), images


def _tools(tools: Any, ignored: list[str], names: ToolNames) -> list[dict[str, Any]]:
    if tools is None:
        return []
    require(tools, list, "tools", "an array of tools")
    out = []
    for j, tool in enumerate(tools):
        where = f"tools[{j}]"
        require(tool, dict, where, "a tool object")
        kind = tool.get("type")
        if kind == "function":
            out.append(_function_tool(tool, where))
        elif kind == "custom":
            out.append(_custom_tool(tool, where))
        elif kind == "namespace":
            out.extend(_namespace_tools(tool, where, names))
        else:
            ignored.append(f"tools:{kind}")
    return out


def _namespace_tools(tool: dict[str, Any], where: str, names: ToolNames) -> list[dict[str, Any]]:
    """A namespace's function and custom tools, each a chat function named by `names.flat`, its
    description after the namespace's (the namespace exists only in that name, and there)."""
    namespace = require(tool.get("name"), str, f"{where}.name", "a string")
    about = tool.get("description")
    about = about.strip() if isinstance(about, str) else ""
    children = require(tool.get("tools"), list, f"{where}.tools", "an array of function or custom tools")
    out = []
    for k, child in enumerate(children):
        inner = f"{where}.tools[{k}]"
        require(child, dict, inner, "a tool object")
        kind = child.get("type")
        if kind == "function":
            made = _function_tool(child, inner)
        elif kind == "custom":
            made = _custom_tool(child, inner)
        else:
            raise TranslationError(
                f"{inner}.type: a namespace holds function and custom tools, not {kind!r}.", f"{inner}.type"
            )
        function = made["function"]
        function["name"] = names.flat(namespace, function["name"])
        description = function.get("description") or ""
        if about and about not in description:
            function["description"] = f"{about}\n\n{description}" if description else about
        if "description" in function:
            # Keep the key order of a plain function: name, description, parameters.
            made["function"] = {"name": function.pop("name"), "description": function.pop("description"), **function}
        out.append(made)
    return out


def _function_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": require(tool.get("name"), str, f"{where}.name", "a string")}
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    function["parameters"] = require(parameters, dict, f"{where}.parameters", "a JSON schema object")
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _custom_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": require(tool.get("name"), str, f"{where}.name", "a string")}
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    about = "The tool's whole input, as free-form text (not JSON)."
    form = tool.get("format")
    if isinstance(form, dict) and form.get("type") == "grammar" and isinstance(form.get("definition"), str):
        syntax = form.get("syntax") if isinstance(form.get("syntax"), str) else "grammar"
        about += f" It must match this {syntax} grammar:\n{form['definition']}"
    function["parameters"] = {
        "type": "object",
        "properties": {CUSTOM_TOOL_INPUT: {"type": "string", "description": about}},
        "required": [CUSTOM_TOOL_INPUT],
        "additionalProperties": False,
    }
    return {"type": "function", "function": function}


def _tool_choice(
    choice: Any, tools: list[dict[str, Any]], chat: dict[str, Any], ignored: list[str], names: ToolNames
) -> list[dict[str, Any]]:
    """Set chat's tool_choice; returns the tools to offer (allowed_tools narrows them). A tool of a
    namespace is named by its `namespace` field, or by its own name alone when no top-level tool
    has that name and one namespace does."""
    if choice is None:
        return tools
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise TranslationError(f'tool_choice: must be "auto", "none" or "required", got {choice!r}.', "tool_choice")
        chat["tool_choice"] = choice
        return tools
    require(choice, dict, "tool_choice", "a string or an object")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = require(choice.get("name"), str, "tool_choice.name", "a string")
        namespace = choice.get("namespace")
        if namespace is not None:
            require(namespace, str, "tool_choice.namespace", "a string")
        chat["tool_choice"] = {"type": "function", "function": {"name": names.chosen(name, namespace)}}
    elif kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise TranslationError(f'tool_choice.mode: must be "auto" or "required", got {mode!r}.', "tool_choice.mode")
        allowed = require(choice.get("tools"), list, "tool_choice.tools", "an array of tools")
        offered: set[str] = set()
        for entry in allowed:
            if isinstance(entry, dict):
                offered.update(names.allowed(entry))
        tools = [t for t in tools if t["function"]["name"] in offered]
        chat["tool_choice"] = mode
    else:
        ignored.append(f"tool_choice:{kind}")
    return tools


#: The `include` entry that asks for the answer's token log probabilities.
LOGPROBS = "message.output_text.logprobs"


def _logprobs(body: dict[str, Any], chat: dict[str, Any], ignored: list[str]) -> None:
    """`include: ["message.output_text.logprobs"]` and `top_logprobs` ask chat for `logprobs` (and
    `top_logprobs`); what else `include` asks for is ignored."""
    include = body.get("include")
    wanted = False
    if include is not None:
        require(include, list, "include", "an array of strings")
        wanted = LOGPROBS in include
        if any(entry != LOGPROBS for entry in include):
            ignored.append("include")
    top = body.get("top_logprobs")
    if top is not None:
        require(top, int, "top_logprobs", "an integer")
        if not 0 <= top <= 20:
            raise TranslationError(f"top_logprobs: must be between 0 and 20, got {top}.", "top_logprobs")
    if wanted or top is not None:
        chat["logprobs"] = True
        if top is not None:
            chat["top_logprobs"] = top


def _text_format(text: Any, chat: dict[str, Any], ignored: list[str]) -> None:
    if not isinstance(text, dict):
        return
    if text.get("verbosity") is not None:
        ignored.append("text.verbosity")
    form = text.get("format")
    if not isinstance(form, dict):
        return
    kind = form.get("type")
    if kind == "json_schema":
        schema: dict[str, Any] = {
            "name": require(form.get("name"), str, "text.format.name", "a string"),
            "schema": require(form.get("schema"), dict, "text.format.schema", "a JSON schema object"),
        }
        for key in ("description", "strict"):
            if form.get(key) is not None:
                schema[key] = form[key]
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind not in (None, "text"):
        raise TranslationError(f"text.format.type: unknown format {kind!r}.", "text.format.type")


# Responses ----------------------------------------------------------------------------------------------


_CHAT_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NAME_SEPARATOR = "__"


class ToolNames:
    """How a request's tools are named to the engine, and how the engine's calls are named back.

    Top-level function and custom tools keep their names. A tool inside a namespace tool (Codex's
    "collaboration" holds spawn_agent, ...) is offered as the chat function `<namespace>__<name>`;
    chat function names must match ^[a-zA-Z0-9_-]{1,64}$, so when that joined name would not (too
    long, other characters), or would be a top-level tool's name or another child's, it is made
    valid: the joined name with every other character an underscore, cut to 55 characters, "_"
    and the first 8 hex digits of the SHA-256 of namespace + NUL + name. The same request always
    gives the same names, so a request's history (`flat`) and the calls in its answer (`back`)
    agree with what was offered.
    """

    __slots__ = ("_children", "_flat", "_pairs", "custom", "top_level")

    def __init__(self, tools: Any) -> None:
        #: Names of the top-level function and custom tools.
        self.top_level: set[str] = set()
        #: Names of the top-level custom tools: calls to them go back as custom_tool_call.
        self.custom: set[str] = set()
        self._flat: dict[str, tuple[str, str, bool]] = {}  # chat name -> (name, namespace, custom)
        self._pairs: dict[tuple[str, str], str] = {}  # (namespace, name) -> chat name
        self._children: dict[str, list[str]] = {}  # a tool's own name -> the chat names of namespaced ones
        namespaces = []
        for tool in tools if isinstance(tools, list) else ():
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                continue
            kind = tool.get("type")
            if kind in ("function", "custom"):
                self.top_level.add(tool["name"])
                if kind == "custom":
                    self.custom.add(tool["name"])
            elif kind == "namespace" and isinstance(tool.get("tools"), list):
                namespaces.append(tool)
        for tool in namespaces:
            for child in tool["tools"]:
                if not isinstance(child, dict) or not isinstance(child.get("name"), str):
                    continue
                namespace, name = tool["name"], child["name"]
                if (namespace, name) in self._pairs:
                    continue
                flat = self._make(namespace, name)
                self._pairs[namespace, name] = flat
                self._flat[flat] = (name, namespace, child.get("type") == "custom")
                self._children.setdefault(name, []).append(flat)

    def _make(self, namespace: str, name: str) -> str:
        joined = f"{namespace}{_NAME_SEPARATOR}{name}"
        if _CHAT_NAME.fullmatch(joined) and joined not in self.top_level and joined not in self._flat:
            return joined
        digest = hashlib.sha256(f"{namespace}\0{name}".encode()).hexdigest()[:8]
        return f"{re.sub(r'[^a-zA-Z0-9_-]', '_', joined)[:55]}_{digest}"

    def flat(self, namespace: str, name: str) -> str:
        """The chat name of `name` in `namespace` (for a namespace the request no longer offers, the
        name it would have)."""
        return self._pairs.get((namespace, name)) or self._make(namespace, name)

    def back(self, chat_name: str) -> tuple[str, str | None, bool]:
        """(name, namespace or None, custom?) of the tool a chat call names."""
        found = self._flat.get(chat_name)
        if found is not None and chat_name not in self.top_level:
            return found
        return chat_name, None, chat_name in self.custom

    def chosen(self, name: str, namespace: str | None) -> str:
        """The chat name a tool_choice (or an allowed_tools entry) means."""
        if namespace is not None:
            return self.flat(namespace, name)
        children = self._children.get(name, [])
        if name not in self.top_level and len(children) == 1:
            return children[0]
        return name

    def allowed(self, entry: dict[str, Any]) -> list[str]:
        """The chat names an allowed_tools entry allows: a namespace entry allows its tools (those it
        lists, or all of them)."""
        name = entry.get("name")
        if not isinstance(name, str):
            return []
        if entry.get("type") == "namespace":
            listed = entry.get("tools")
            if isinstance(listed, list):
                return [
                    self.flat(name, t["name"]) for t in listed if isinstance(t, dict) and isinstance(t.get("name"), str)
                ]
            return [flat for flat, (_, namespace, _) in self._flat.items() if namespace == name]
        namespace = entry.get("namespace")
        return [self.chosen(name, namespace if isinstance(namespace, str) else None)]


def custom_tool_names(request: dict[str, Any]) -> frozenset[str]:
    """The names of the custom tools the request offered: calls to them go back as custom_tool_call."""
    tools = request.get("tools")
    if not isinstance(tools, list):
        return frozenset()
    return frozenset(
        t["name"] for t in tools if isinstance(t, dict) and t.get("type") == "custom" and isinstance(t.get("name"), str)
    )


def custom_tool_input(arguments: str) -> str:
    """A custom tool's input out of the function arguments the model wrote: the "input" string; the
    only string value when the model named it otherwise; the arguments as they are when they are
    not such an object (a model that wrote the raw input straight away)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(parsed, dict):
        value = parsed.get(CUSTOM_TOOL_INPUT)
        if isinstance(value, str):
            return value
        strings = [v for v in parsed.values() if isinstance(v, str)]
        if len(parsed) == 1 and len(strings) == 1:
            return strings[0]
    return arguments


def _served_tools(request: dict[str, Any]) -> list[dict[str, Any]]:
    tools = request.get("tools")
    if not isinstance(tools, list):
        return []
    return [t for t in tools if isinstance(t, dict) and t.get("type") in ("function", "custom", "namespace")]


def _status(finish_reason: Any) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _envelope(
    request: dict[str, Any],
    response_id: str,
    created_at: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    *,
    incomplete_details: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    model: Any = None,
) -> dict[str, Any]:
    instructions = request.get("instructions")
    text = request.get("text")
    if not isinstance(text, dict) or not isinstance(text.get("format"), dict):
        text = {"format": {"type": "text"}, **(text if isinstance(text, dict) else {})}
    metadata = request.get("metadata")
    previous = request.get("previous_response_id")
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete_details,
        "instructions": instructions if isinstance(instructions, str) else None,
        "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model") or model or "",
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": previous if isinstance(previous, str) else None,
        "reasoning": {"effort": None, "summary": None},
        "store": request.get("store") is True,
        "temperature": request.get("temperature"),
        "text": text,
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": _served_tools(request),
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": None,
        "metadata": metadata if isinstance(metadata, dict) else {},
    }


def _item_base(response_id: str) -> str:
    return response_id.removeprefix("resp_")


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def chat_to_response(
    resp: dict[str, Any], *, request: dict[str, Any], response_id: str, created_at: int
) -> dict[str, Any]:
    """A chat completion as a Response object (see the module docstring)."""
    choice = first_choice(resp)
    message = as_dict(choice.get("message"))
    status, incomplete = _status(choice.get("finish_reason"))
    base = _item_base(response_id)
    names = ToolNames(request.get("tools"))
    output: list[dict[str, Any]] = []
    text = _text_of(message.get("content"))
    refusal = message.get("refusal")
    if text:
        output.append(
            {
                "id": f"msg_{base}_0",
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [_output_text(text, token_logprobs(choice))],
            }
        )
    elif isinstance(refusal, str) and refusal:
        output.append(
            {
                "id": f"msg_{base}_0",
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": refusal}],
            }
        )
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else ():
        if not isinstance(call, dict):
            continue
        function = as_dict(call.get("function"))
        index = len(output)
        name = str(function.get("name") or "")
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = dumps(arguments) if isinstance(arguments, dict) else ""
        call_id = str(call.get("id") or f"call_{base}_{index}")
        name, namespace, custom = names.back(name)
        output.append(_call_item(custom, f"{base}_{index}", call_id, name, arguments, "completed", namespace))
    usage = whole_usage(resp)
    return _envelope(
        request,
        response_id,
        created_at,
        status,
        output,
        usage.to_responses() if usage is not None else None,
        incomplete_details=incomplete,
        model=resp.get("model"),
    )


def _call_item(
    custom: bool, suffix: str, call_id: str, name: str, arguments: str, status: str, namespace: str | None = None
) -> dict[str, Any]:
    """A function_call or custom_tool_call item; `namespace` (when the tool is in one) goes after the name."""
    if custom:
        item: dict[str, Any] = {"id": f"ctc_{suffix}", "type": "custom_tool_call", "call_id": call_id, "name": name}
        if namespace is not None:
            item["namespace"] = namespace
        item["input"] = custom_tool_input(arguments)
        return item
    item = {"id": f"fc_{suffix}", "type": "function_call", "status": status, "call_id": call_id, "name": name}
    if namespace is not None:
        item["namespace"] = namespace
    item["arguments"] = arguments
    return item


# Streams ------------------------------------------------------------------------------------------------


class ChatToResponsesStream(ChatChunkReader):
    """OpenAI chat chunks in, Responses API stream events out, each with its sequence_number.

    `feed(chunk)` takes each parsed chunk and returns the events it makes; `finish()` closes the
    open item and sends `response.completed` (or `response.incomplete`) with the whole response
    and its usage; `fail(message)` ends a stream whose upstream died with `response.failed`; a
    chunk carrying an "error" object does the same.

    The stream opens with response.created and response.in_progress. Text is one message item:
    output_item.added, content_part.added, output_text.delta..., output_text.done,
    content_part.done, output_item.done. A function call is output_item.added,
    function_call_arguments.delta..., function_call_arguments.done, output_item.done. A custom
    tool call's input is a string inside the JSON arguments the model writes, so it is known only
    when the call ends: its custom_tool_call_input.delta comes once, whole, before
    custom_tool_call_input.done and output_item.done (Codex takes calls from output_item.done).
    An item closes when the next opens, or at the end.

    A call to a tool of a namespace is an item with the tool's own name and its `namespace`, in
    output_item.added as in output_item.done and the final response.

    Usage is the upstream's (from its include_usage chunk, else llama.cpp's `timings`); without
    either, output_tokens is `tokens_counted` (one per content/argument delta) and input_tokens 0.
    """

    __slots__ = (
        "_base",
        "_logprobs",
        "_names",
        "_open",
        "_seq",
        "_text",
        "created_at",
        "final",
        "items",
        "request",
        "response_id",
        "upstream_model",
    )

    def __init__(self, request: dict[str, Any], response_id: str, created_at: int) -> None:
        super().__init__()
        self.request = request
        self.response_id = response_id
        self.created_at = created_at
        self.upstream_model: Any = None
        #: The output items so far (each closed item final, the open one in progress).
        self.items: list[dict[str, Any]] = []
        self._base = _item_base(response_id)
        self._names = ToolNames(request.get("tools"))
        self._seq = 0
        self._open: int | None = None  # output index of the open item
        self._text: list[str] = []  # the open message's text so far
        self._logprobs: list[dict[str, Any]] = []  # and its tokens' log probabilities, when asked for
        #: The whole response the stream ended with (response.completed, .incomplete or .failed).
        self.final: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> Event:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return (kind, data)

    def _response(self, status: str, **extra: Any) -> dict[str, Any]:
        output = [_copy_item(item) for item in self.items]
        return _envelope(
            self.request, self.response_id, self.created_at, status, output, None, model=self.upstream_model, **extra
        )

    def start(self) -> list[Event]:
        """response.created and response.in_progress; sent by the first `feed` if not called before."""
        if self._started:
            return []
        self._started = True
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def _begin(self, chunk: dict[str, Any]) -> list[Event]:
        if self.upstream_model is None:
            self.upstream_model = chunk.get("model")
        return self.start()

    # Message items

    def _on_text(self, text: str, events: list[Event], logprobs: list[dict[str, Any]]) -> None:
        index = self._open
        if index is None or self.items[index]["type"] != "message":
            self._close(events, "completed")
            index = len(self.items)
            item: dict[str, Any] = {
                "id": f"msg_{self._base}_{index}",
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self.items.append(item)
            self._open = index
            self._text = []
            self._logprobs = []
            events.append(self._event("response.output_item.added", output_index=index, item=_copy_item(item)))
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_output_text(""),
                )
            )
        self._text.append(text)
        self._logprobs += logprobs
        item_id = self.items[index]["id"]
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=item_id,
                output_index=index,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )

    # Tool call items

    def _on_tool_open(self, call: ToolCall, arguments: str, events: list[Event]) -> None:
        self._close(events, "completed")
        index = len(self.items)
        call.slot = index
        if call.call_id is None:
            call.call_id = f"call_{self._base}_{index}"
        name, namespace, custom = self._names.back(call.name or "")
        item = _call_item(custom, f"{self._base}_{index}", call.call_id, name, "", "in_progress", namespace)
        if custom:
            item["input"] = ""
        self.items.append(item)
        self._open = index
        events.append(self._event("response.output_item.added", output_index=index, item=_copy_item(item)))
        if arguments and not custom:
            self._on_tool_arguments(call, arguments, events)

    def _on_tool_arguments(self, call: ToolCall, piece: str, events: list[Event]) -> None:
        item = self.items[call.slot]
        if item["type"] == "function_call":
            item["arguments"] = call.text
            events.append(
                self._event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=call.slot, delta=piece
                )
            )
        # A custom call's input is a string inside the arguments: sent whole when the call ends.

    def _close(self, events: list[Event], status: str) -> None:
        index = self._open
        if index is None:
            return
        self._open = None
        item = self.items[index]
        item_id = item["id"]
        kind = item["type"]
        if kind == "message":
            text = "".join(self._text)
            part = _output_text(text, self._logprobs)
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=list(self._logprobs),
                )
            )
            events.append(
                self._event(
                    "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
                )
            )
            item["content"] = [_output_text(text, self._logprobs)]
            item["status"] = status
        elif kind == "function_call":
            call = self._call_at(index)
            item["arguments"] = call.text if call is not None else item["arguments"]
            item["status"] = status
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item_id,
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
        else:
            call = self._call_at(index)
            item["input"] = custom_tool_input(call.text) if call is not None else item["input"]
            if item["input"]:
                events.append(
                    self._event(
                        "response.custom_tool_call_input.delta",
                        item_id=item_id,
                        output_index=index,
                        delta=item["input"],
                    )
                )
            events.append(
                self._event(
                    "response.custom_tool_call_input.done", item_id=item_id, output_index=index, input=item["input"]
                )
            )
        events.append(self._event("response.output_item.done", output_index=index, item=_copy_item(item)))

    def _call_at(self, index: int) -> ToolCall | None:
        for call in self._tools.calls.values():
            if call.opened and call.slot == index:
                return call
        return None

    # The end

    @property
    def usage(self) -> Usage:
        """This stream's usage for the gateway's records (output estimated when not reported)."""
        return stream_usage(self.reported_usage, self.tokens_counted)

    def finish(self) -> list[Event]:
        """Close the open item and end with response.completed (or response.incomplete)."""
        if self._done:
            return []
        events = self.start()
        for call in self._tools.unopened():
            call.opened = True
            self._on_tool_open(call, call.text, events)
        status, incomplete = _status(self.finish_reason)
        self._close(events, status)
        self._done = True
        response = self.final = self._response(status, incomplete_details=incomplete)
        response["usage"] = self.usage.to_responses()
        kind = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(kind, response=response))
        return events

    def fail(self, message: str, code: str = "server_error") -> list[Event]:
        """End the stream with response.failed (the open item is left incomplete, without its done events)."""
        if self._done:
            return []
        events = self.start()
        self._done = True
        if self._open is not None:
            item = self.items[self._open]
            if item["type"] == "message":
                item["content"] = [_output_text("".join(self._text), self._logprobs)]
            if "status" in item:
                item["status"] = "incomplete"
            self._open = None
        response = self.final = self._response("failed", error={"code": code, "message": message})
        response["usage"] = self.usage.to_responses()
        events.append(self._event("response.failed", response=response))
        return events


def _copy_item(item: dict[str, Any]) -> dict[str, Any]:
    # Events are serialised by the caller, maybe later: they must not see the item change afterwards.
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(part) for part in copy["content"]]
    return copy
