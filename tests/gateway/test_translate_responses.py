"""OpenAI Responses API (as Codex speaks it) <-> chat completions: requests, responses and streams.

With the `openai` SDK installed (the dev extra) every Response object and stream event made here
is parsed with its own types, and streams run through the SDK's own stream state machine
(`ResponseStreamState`), which refuses events out of order or for items never added.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from apps.gateway.translate.errors import openai_error
from apps.gateway.translate.responses import (
    CUSTOM_TOOL_INPUT,
    IGNORED_INPUT_ITEMS,
    ChatToResponsesStream,
    ToolNames,
    TranslationError,
    chat_to_response,
    custom_tool_input,
    responses_to_chat,
    sse,
)

try:
    from openai import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.chat import completion_create_params as chat_params
    from openai.types.responses import Response, ResponseStreamEvent
    from openai.types.responses import response_create_params as responses_params
    from pydantic import TypeAdapter

    HAVE_SDK = True
except ImportError:  # pragma: no cover - the dev extra installs it
    HAVE_SDK = False

needs_sdk = pytest.mark.skipif(not HAVE_SDK, reason="the openai SDK is not installed")

RESPONSE_ID = "resp_0123abcd"
CREATED = 1_760_000_000

APPLY_PATCH_GRAMMAR = (
    'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?'
)
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@\n-x = 1\n+x = 2\n*** End Patch\n"

SHELL_TOOL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "array", "items": {"type": "string"}}, "workdir": {"type": "string"}},
        "required": ["command"],
        "additionalProperties": False,
    },
}
APPLY_PATCH_TOOL = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_GRAMMAR},
}


SPAWN_PARAMETERS = {
    "type": "object",
    "properties": {"message": {"type": "string"}, "agent_type": {"type": "string"}},
    "required": ["message"],
    "additionalProperties": False,
}
#: A namespace tool as Codex sends it: function children, and a custom one.
COLLABORATION_TOOL = {
    "type": "namespace",
    "name": "collaboration",
    "description": "Tools for working with other agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start a sub-agent on a task.",
            "parameters": SPAWN_PARAMETERS,
        },
        {"type": "function", "name": "wait", "description": "Wait for agents.", "parameters": {"type": "object"}},
        {"type": "custom", "name": "send_note", "description": "Send free-form text to an agent."},
    ],
}
CHAT_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


# Builders and SDK checks ----------------------------------------------------------------------------------


def request(validate: bool = True, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "gpt-oss-120b", "input": "Hi"}
    body.update(fields)
    if HAVE_SDK and validate:
        kind = (
            responses_params.ResponseCreateParamsStreaming
            if body.get("stream")
            else responses_params.ResponseCreateParamsNonStreaming
        )
        TypeAdapter(kind).validate_python(body)
    return body


def to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    chat = responses_to_chat(body)
    ignored = chat.pop("_ignored")
    if HAVE_SDK:
        kind = (
            chat_params.CompletionCreateParamsStreaming
            if chat.get("stream")
            else chat_params.CompletionCreateParamsNonStreaming
        )
        TypeAdapter(kind).validate_python(chat)
    return chat, ignored


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def completion(message: dict[str, Any], finish: str = "stop", usage: dict[str, Any] | None = None) -> dict[str, Any]:
    resp = {
        "id": "chatcmpl-xyz",
        "object": "chat.completion",
        "created": 1,
        "model": "/models/gpt-oss-120b",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish}],
    }
    if usage is not None:
        resp["usage"] = usage
    if HAVE_SDK:
        ChatCompletion.model_validate(resp)
    return resp


def usage(prompt: int, completion: int, cached: int | None = None, reasoning: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u


def to_response(resp: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
    out = chat_to_response(resp, request=req, response_id=RESPONSE_ID, created_at=CREATED)
    json.dumps(out)
    if HAVE_SDK:
        Response.model_validate(out)
    return out


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": "chatcmpl-xyz", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    c["choices"] = (
        [] if delta is None and finish is None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    if usage is not None:
        c["usage"] = usage
    if HAVE_SDK:
        ChatCompletionChunk.model_validate(c)
    return c


def tool_delta(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None):
    call: dict[str, Any] = {"index": index, "function": {}}
    if id is not None:
        call["id"] = id
        call["type"] = "function"
    if name is not None:
        call["function"]["name"] = name
    if args is not None:
        call["function"]["arguments"] = args
    return {"tool_calls": [call]}


def run_stream(chunks: list[dict[str, Any]], req: dict[str, Any]) -> tuple[ChatToResponsesStream, list]:
    stream = ChatToResponsesStream(req, RESPONSE_ID, CREATED)
    events = []
    for c in chunks:
        events.extend(stream.feed(c))
    events.extend(stream.finish())
    check_events(events)
    return stream, events


def check_events(events: list[tuple[str, dict[str, Any]]]) -> Any:
    """Names match types, sequence numbers count up from 0; with the SDK each event parses and the
    SDK's stream state accepts the whole sequence. Returns the SDK's final response, if any."""
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    for name, data in events:
        assert data["type"] == name
        assert sse(name, data).startswith(f"event: {name}\ndata: ".encode())
    if not HAVE_SDK:
        return None
    adapter = TypeAdapter(ResponseStreamEvent)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    final = None
    for _, data in events:
        for handled in state.handle_event(adapter.validate_python(data)):
            if handled.type in ("response.completed", "response.incomplete", "response.failed"):
                final = handled.response
    return final


def names(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in events]


# Requests ---------------------------------------------------------------------------------------------------


def test_instructions_and_an_input_string() -> None:
    chat, ignored = to_chat(request(instructions="You are Codex.", max_output_tokens=512, temperature=0.5, top_p=1))
    assert chat == {
        "model": "gpt-oss-120b",
        "messages": [{"role": "system", "content": "You are Codex."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 512,
        "temperature": 0.5,
        "top_p": 1,
    }
    assert ignored == []


def test_stream_asks_for_usage_in_the_last_chunk() -> None:
    chat, _ = to_chat(request(stream=True))
    assert (chat["stream"], chat["stream_options"]) == (True, {"include_usage": True})


def test_a_codex_turn() -> None:
    """A request shaped as Codex sends it: developer and user messages, reasoning, a shell call
    and its output, an apply_patch custom call and its output, and server-side tools."""
    body = request(
        validate=False,  # Codex leaves reasoning items' ids out, which the SDK's param type requires
        instructions="You are a coding agent.",
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
            user("<environment_context>cwd=/repo</environment_context>"),
            user("Set x to 2 in a.py"),
            {
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "look first"}],
                "encrypted_content": "gAAA",
            },
            {"type": "function_call", "name": "shell", "arguments": '{"command":["cat","a.py"]}', "call_id": "call_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "x = 1\n"},
            {
                "type": "custom_tool_call",
                "call_id": "call_2",
                "name": "apply_patch",
                "input": PATCH,
                "status": "completed",
            },
            {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done!"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x is now 2."}]},
            user("Thanks"),
        ],
        tools=[SHELL_TOOL, APPLY_PATCH_TOOL, {"type": "web_search"}],
        tool_choice="auto",
        parallel_tool_calls=False,
        reasoning={"effort": "medium", "summary": "auto"},
        store=False,
        stream=True,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="c0ffee",
    )
    chat, ignored = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "You are a coding agent.\n\n<permissions>"},
        {"role": "user", "content": "<environment_context>cwd=/repo</environment_context>\nSet x to 2 in a.py"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "shell", "arguments": '{"command":["cat","a.py"]}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x = 1\n"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {
                        "name": "apply_patch",
                        "arguments": json.dumps({"input": PATCH}, separators=(",", ":")),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_2", "content": "Done!"},
        {"role": "assistant", "content": "x is now 2."},
        {"role": "user", "content": "Thanks"},
    ]
    assert json.loads(chat["messages"][4]["tool_calls"][0]["function"]["arguments"]) == {"input": PATCH}
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "apply_patch"]
    assert chat["tool_choice"] == "auto"
    assert chat["parallel_tool_calls"] is False
    assert ignored == ["reasoning", "include", "input:reasoning", "tools:web_search"]
    assert "store" not in chat and "prompt_cache_key" not in chat and "reasoning" not in chat


def test_function_tool_keeps_its_schema() -> None:
    chat, _ = to_chat(request(tools=[SHELL_TOOL, {"type": "function", "name": "now"}]))
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "description": SHELL_TOOL["description"],
                "parameters": SHELL_TOOL["parameters"],
                "strict": False,
            },
        },
        {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    ]


def test_a_custom_tool_is_a_function_of_one_string_named_input_with_its_grammar() -> None:
    chat, _ = to_chat(request(tools=[APPLY_PATCH_TOOL, {"type": "custom", "name": "note", "format": {"type": "text"}}]))
    patch, note = chat["tools"]
    assert patch["function"]["name"] == "apply_patch"
    assert patch["function"]["description"] == APPLY_PATCH_TOOL["description"]
    parameters = patch["function"]["parameters"]
    assert parameters["required"] == [CUSTOM_TOOL_INPUT] == ["input"]
    assert list(parameters["properties"]) == ["input"]
    assert parameters["properties"]["input"]["type"] == "string"
    assert parameters["properties"]["input"]["description"].endswith(
        "It must match this lark grammar:\n" + APPLY_PATCH_GRAMMAR
    )
    assert note["function"]["parameters"]["properties"]["input"]["description"] == (
        "The tool's whole input, as free-form text (not JSON)."
    )


def test_assistant_text_and_the_calls_after_it_are_one_turn() -> None:
    items = [
        user("Check both"),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "c1"},
        {"type": "function_call", "name": "shell", "arguments": '{"command":["pwd"]}', "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.py"},
        {"type": "function_call_output", "call_id": "c2", "output": "/repo"},
    ]
    chat, _ = to_chat(request(validate=False, input=items))  # Codex's assistant item has no id (the SDK wants one)
    assert chat["messages"][1]["content"] == "Checking."
    assert [c["id"] for c in chat["messages"][1]["tool_calls"]] == ["c1", "c2"]
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool", "tool"]


def test_images_and_tool_outputs_with_images() -> None:
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"},
            ],
        },
        {"type": "function_call", "name": "screenshot", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call", "name": "screenshot", "arguments": "{}", "call_id": "c2"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [
                {"type": "input_text", "text": "captured"},
                {"type": "input_image", "image_url": "https://example.com/s1.png", "detail": "auto"},
            ],
        },
        {"type": "function_call_output", "call_id": "c2", "output": "failed"},
    ]
    chat, _ = to_chat(request(input=items))
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
            ],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "captured"},
        {"role": "tool", "tool_call_id": "c2", "content": "failed"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "https://example.com/s1.png", "detail": "auto"}}],
        },
    ]


def test_a_late_developer_message_stays_in_place() -> None:
    items = [
        user("one"),
        {"role": "assistant", "content": "ok"},
        {"role": "developer", "content": "Approval mode changed."},
        user("two"),
    ]
    chat, _ = to_chat(request(input=items, instructions="Base."))
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "system", "user"]
    assert chat["messages"][3]["content"] == "Approval mode changed."


def test_old_codex_local_shell_history_still_pairs_calls_and_outputs() -> None:
    action = {"type": "exec", "command": ["ls"], "env": {}}
    items = [
        user("ls"),
        {"type": "local_shell_call", "id": "ls_1", "call_id": "call_9", "status": "completed", "action": action},
        {"type": "function_call_output", "call_id": "call_9", "output": "a.py"},
    ]
    chat, _ = to_chat(request(input=items, tools=[{"type": "local_shell"}]))
    call = chat["messages"][1]["tool_calls"][0]
    assert (call["id"], call["function"]["name"], json.loads(call["function"]["arguments"])) == (
        "call_9",
        "local_shell",
        action,
    )
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "call_9", "content": "a.py"}
    assert "tools" not in chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "shell"}, {"type": "function", "function": {"name": "shell"}}),
        ({"type": "custom", "name": "apply_patch"}, {"type": "function", "function": {"name": "apply_patch"}}),
    ],
)
def test_tool_choice(choice: Any, expected: Any) -> None:
    chat, _ = to_chat(request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL], tool_choice=choice))
    assert chat["tool_choice"] == expected


def test_allowed_tools_narrows_the_tools() -> None:
    choice = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "shell"}]}
    chat, _ = to_chat(request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL], tool_choice=choice))
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell"]
    assert chat["tool_choice"] == "required"


def test_a_hosted_tool_choice_and_no_tools_left() -> None:
    chat, ignored = to_chat(request(tools=[{"type": "web_search"}], tool_choice={"type": "web_search_preview"}))
    assert "tools" not in chat and "tool_choice" not in chat
    assert ignored == ["tools:web_search", "tool_choice:web_search_preview"]
    chat, _ = to_chat(request(tool_choice="required", parallel_tool_calls=True))
    assert "tool_choice" not in chat and "parallel_tool_calls" not in chat


def test_text_format_becomes_response_format() -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}, "verbosity": "low"}
    chat, ignored = to_chat(request(text=text))
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": schema, "strict": True},
    }
    assert ignored == ["text.verbosity"]
    chat, _ = to_chat(request(text={"format": {"type": "json_object"}}))
    assert chat["response_format"] == {"type": "json_object"}
    chat, _ = to_chat(request(text={"format": {"type": "text"}}))
    assert "response_format" not in chat


def test_unknown_fields_are_noted_and_store_is_the_gateways() -> None:
    chat = responses_to_chat(request(validate=False, store=True, metadata={"a": "b"}, user="u", frobnicate=1))
    assert chat["_ignored"] == ["frobnicate"]  # store is followed by the gateway (apps.gateway.response_store)
    assert "metadata" not in chat and "user" not in chat


@pytest.mark.parametrize("kind", sorted(IGNORED_INPUT_ITEMS))
def test_server_side_and_unreadable_input_items_are_ignored_and_noted(kind: str) -> None:
    items = [user("hi"), {"type": kind, "id": "x_1"}, user("again")]
    chat, ignored = to_chat(request(validate=False, input=items))
    assert chat["messages"] == [{"role": "user", "content": "hi\nagain"}]
    assert ignored == [f"input:{kind}"]


def test_the_ignored_input_items_are_the_listed_ones() -> None:
    listed = {
        "reasoning",
        "compaction",
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "program",
        "program_output",
        "mcp_list_tools",
        "mcp_call",
        "mcp_approval_request",
        "mcp_approval_response",
        "computer_call",
        "computer_call_output",
    }
    assert listed == IGNORED_INPUT_ITEMS


def test_an_unknown_input_item_type_is_refused_naming_it() -> None:
    with pytest.raises(TranslationError) as caught:
        responses_to_chat(request(validate=False, input=[user("hi"), {"type": "hologram", "data": "..."}]))
    assert caught.value.param == "input[1].type"
    assert caught.value.message.startswith("input[1].type: unsupported input item type 'hologram'")
    for odd in (7, ["message"], {"kind": "message"}):
        with pytest.raises(TranslationError) as caught:
            responses_to_chat(request(validate=False, input=[{"type": odd}]))
        assert caught.value.param == "input[0].type" and repr(odd) in caught.value.message


@pytest.mark.parametrize(
    "item",
    [
        {"type": "shell_call", "call_id": "c", "action": {"commands": ["ls"]}, "status": "completed"},
        {"type": "shell_call_output", "call_id": "c", "output": []},
        {"type": "apply_patch_call", "call_id": "c", "operation": {"type": "delete_file", "path": "a"}},
        {"type": "apply_patch_call_output", "call_id": "c", "status": "completed"},
        {"type": "tool_search_call", "arguments": {"query": "crm"}},
        {"type": "tool_search_output", "tools": [SHELL_TOOL]},
        {"type": "additional_tools", "role": "developer", "tools": [SHELL_TOOL]},
        {"type": "configuration_update", "text": {"format": {"type": "text"}}},
        {"type": "compaction_trigger"},
        {"type": "item_reference", "id": "msg_1"},
    ],
)
def test_input_items_that_carry_what_the_engine_cannot_be_given_are_refused(item: dict[str, Any]) -> None:
    with pytest.raises(TranslationError) as caught:
        responses_to_chat(request(validate=False, input=[user("hi"), item]))
    assert caught.value.param == "input[1].type"
    assert item["type"] in caught.value.message and "not supported" in caught.value.message


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"background": True}, "background"),
        ({"model": None}, "model"),
        ({"input": None}, "input"),
        ({"input": 42}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]}, "input[0].arguments"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f"}]}, "input[0].input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
        ({"instructions": ["x"]}, "instructions"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools[0].parameters"),
        ({"tools": [{"type": "namespace", "description": "d", "tools": []}]}, "tools[0].name"),
        ({"tools": [{"type": "namespace", "name": "n", "description": "d"}]}, "tools[0].tools"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
        ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function"}]}]}, "tools[0].tools[0].name"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": 3}]},
            "input[0].namespace",
        ),
        ({"tool_choice": {"type": "function", "name": "f", "namespace": 3}}, "tool_choice.namespace"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "maybe", "tools": []}}, "tool_choice.mode"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"temperature": "warm"}, "temperature"),
        ({"stream": 1}, "stream"),
        ({"parallel_tool_calls": "no", "tools": [SHELL_TOOL]}, "parallel_tool_calls"),
    ],
)
def test_malformed_or_unsupported_requests_name_the_parameter(change: dict[str, Any], param: str) -> None:
    body = {"model": "m", "input": "Hi", **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(TranslationError) as caught:
        responses_to_chat(body)
    assert caught.value.param == param


def test_previous_response_id_is_left_to_the_gateway_with_a_reason() -> None:
    with pytest.raises(TranslationError) as caught:
        responses_to_chat(request(previous_response_id="resp_1"))
    assert "the gateway replays the stored conversation" in caught.value.message
    assert "whole conversation" in caught.value.message
    body = openai_error(400, caught.value.message, param=caught.value.param)
    assert body["error"] == {
        "message": caught.value.message,
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": None,
    }


def test_instructions_alone_are_enough() -> None:
    chat, _ = to_chat({"model": "m", "instructions": "Say hi."})
    assert chat["messages"] == [{"role": "system", "content": "Say hi."}]


# Responses --------------------------------------------------------------------------------------------------


def test_text_completion_becomes_a_response() -> None:
    req = request(instructions="Be brief.", max_output_tokens=100, temperature=0.7)
    out = to_response(completion({"content": "Hello!"}, usage=usage(20, 4, cached=16, reasoning=1)), req)
    assert out["id"] == RESPONSE_ID and out["object"] == "response" and out["created_at"] == CREATED
    assert out["status"] == "completed" and out["incomplete_details"] is None and out["error"] is None
    assert out["model"] == "gpt-oss-120b"  # the name the client asked for, not the engine's path
    assert out["instructions"] == "Be brief." and out["max_output_tokens"] == 100 and out["temperature"] == 0.7
    assert out["output"] == [
        {
            "id": "msg_0123abcd_0",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello!", "annotations": [], "logprobs": []}],
        }
    ]
    assert out["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 16, "cache_write_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 24,
    }
    if HAVE_SDK:
        assert Response.model_validate(out).output_text == "Hello!"


def test_function_and_custom_tool_calls() -> None:
    req = request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL])
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
        {
            "id": "call_b",
            "type": "function",
            "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})},
        },
    ]
    out = to_response(completion({"content": "On it.", "tool_calls": calls}, "tool_calls", usage(100, 50)), req)
    assert out["output"][1:] == [
        {
            "id": "fc_0123abcd_1",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_a",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
        },
        {
            "id": "ctc_0123abcd_2",
            "type": "custom_tool_call",
            "call_id": "call_b",
            "name": "apply_patch",
            "input": PATCH,
        },
    ]
    assert out["status"] == "completed"
    assert [t["name"] for t in out["tools"]] == ["shell", "apply_patch"]


def test_round_trip_of_a_custom_call() -> None:
    """The custom_tool_call sent back comes back as the next request's input, as Codex replays it."""
    req = request(tools=[APPLY_PATCH_TOOL])
    calls = [
        {
            "id": "call_p",
            "type": "function",
            "function": {"name": "apply_patch", "arguments": json.dumps({"input": PATCH})},
        }
    ]
    out = to_response(completion({"content": None, "tool_calls": calls}, "tool_calls"), req)
    replay = [user("edit"), *out["output"], {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"}]
    chat, _ = to_chat(request(input=replay, tools=[APPLY_PATCH_TOOL]))
    assert json.loads(chat["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {"input": PATCH}
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "call_p", "content": "Done!"}


def test_custom_tool_input_fallbacks() -> None:
    assert custom_tool_input(json.dumps({"input": "raw"})) == "raw"
    assert custom_tool_input(json.dumps({"patch": "raw"})) == "raw"  # the only string, under another name
    assert custom_tool_input("*** Begin Patch") == "*** Begin Patch"  # not JSON: the model wrote the input itself
    assert custom_tool_input(json.dumps({"a": "x", "b": "y"})) == '{"a": "x", "b": "y"}'
    assert custom_tool_input("") == ""


def test_length_is_incomplete() -> None:
    out = to_response(completion({"content": "Once upon"}, "length", usage(5, 16)), request(max_output_tokens=16))
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"


def test_content_filter_and_refusal() -> None:
    out = to_response(completion({"content": None, "refusal": "I can't help with that."}, "content_filter"), request())
    assert out["incomplete_details"] == {"reason": "content_filter"}
    assert out["output"][0]["content"] == [{"type": "refusal", "refusal": "I can't help with that."}]


def test_no_usage_is_null_and_empty_output() -> None:
    out = to_response(completion({"content": ""}), request())
    assert out["usage"] is None and out["output"] == []


def test_a_call_without_an_id_gets_one() -> None:
    calls = [{"id": "", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]
    out = to_response(completion({"content": None, "tool_calls": calls}, "tool_calls"), request(tools=[SHELL_TOOL]))
    assert out["output"][0]["call_id"] == "call_0123abcd_0"


# Streams ----------------------------------------------------------------------------------------------------


def test_text_stream_event_sequence() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "stop"),
        chunk(usage=usage(30, 2, cached=0)),
    ]
    stream, events = run_stream(chunks, request(stream=True))
    assert names(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    created = events[0][1]["response"]
    assert (created["id"], created["status"], created["output"], created["usage"]) == (
        RESPONSE_ID,
        "in_progress",
        [],
        None,
    )
    assert events[2][1] == {
        "type": "response.output_item.added",
        "sequence_number": 2,
        "output_index": 0,
        "item": {
            "id": "msg_0123abcd_0",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        },
    }
    assert events[3][1] == {
        "type": "response.content_part.added",
        "sequence_number": 3,
        "item_id": "msg_0123abcd_0",
        "output_index": 0,
        "content_index": 0,
        "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
    }
    assert events[4][1] == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        "item_id": "msg_0123abcd_0",
        "output_index": 0,
        "content_index": 0,
        "delta": "Hel",
        "logprobs": [],
    }
    assert events[6][1]["text"] == "Hello"
    assert events[8][1]["item"]["status"] == "completed"
    assert events[8][1]["item"]["content"] == [
        {"type": "output_text", "text": "Hello", "annotations": [], "logprobs": []}
    ]
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["output"] == [events[8][1]["item"]]
    assert done["usage"]["input_tokens"] == 30 and done["usage"]["output_tokens"] == 2
    assert not stream.usage.estimated
    assert stream.done and stream.feed(chunk({"content": "late"})) == [] and stream.finish() == []


def test_function_call_arguments_split_across_chunks() -> None:
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk(tool_delta(0, id="call_1", name="shell", args="")),
        chunk(tool_delta(0, args='{"comm')),
        chunk(tool_delta(0, args='and":["ls"]}')),
        chunk({}, "tool_calls"),
        chunk(usage=usage(80, 12)),
    ]
    stream, events = run_stream(chunks, request(tools=[SHELL_TOOL], stream=True))
    assert names(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[2][1]["item"] == {
        "id": "fc_0123abcd_0",
        "type": "function_call",
        "status": "in_progress",
        "call_id": "call_1",
        "name": "shell",
        "arguments": "",
    }
    assert [e[1]["delta"] for e in events[3:5]] == ['{"comm', 'and":["ls"]}']
    assert events[5][1]["arguments"] == '{"command":["ls"]}'
    assert events[6][1]["item"]["arguments"] == '{"command":["ls"]}' and events[6][1]["item"]["status"] == "completed"
    assert stream.tokens_counted == 2


def test_custom_tool_call_input_comes_whole_when_the_call_ends() -> None:
    args = json.dumps({"input": PATCH})
    chunks = [
        chunk({"content": "Patching."}),
        chunk(tool_delta(0, id="call_p", name="apply_patch", args=args[:20])),
        chunk(tool_delta(0, args=args[20:])),
        chunk({}, "tool_calls"),
    ]
    _, events = run_stream(chunks, request(tools=[APPLY_PATCH_TOOL], stream=True))
    assert names(events)[8:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert names(events)[2:8] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    added = events[8][1]
    assert added["output_index"] == 1
    assert added["item"] == {
        "id": "ctc_0123abcd_1",
        "type": "custom_tool_call",
        "call_id": "call_p",
        "name": "apply_patch",
        "input": "",
    }
    assert events[9][1]["delta"] == PATCH and events[10][1]["input"] == PATCH
    assert events[11][1]["item"]["input"] == PATCH
    assert events[-1][1]["response"]["output"][1]["input"] == PATCH


def test_stream_without_usage_counts_deltas() -> None:
    chunks = [
        chunk({"content": "a"}),
        chunk({"content": "b"}),
        chunk(tool_delta(0, id="c", name="shell", args="{}")),
        chunk({}, "tool_calls"),
    ]
    stream, events = run_stream(chunks, request(tools=[SHELL_TOOL]))
    assert stream.tokens_counted == 3
    final_usage = events[-1][1]["response"]["usage"]
    assert (final_usage["input_tokens"], final_usage["output_tokens"], final_usage["total_tokens"]) == (0, 3, 3)
    assert stream.usage.estimated and stream.usage.input_tokens is None


def test_length_ends_in_response_incomplete() -> None:
    stream, events = run_stream([chunk({"content": "Once"}), chunk({}, "length"), chunk(usage=usage(3, 1))], request())
    assert events[-1][0] == "response.incomplete"
    response = events[-1][1]["response"]
    assert response["status"] == "incomplete" and response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete"
    assert events[-2][1]["item"]["status"] == "incomplete"


def test_fail_mid_stream() -> None:
    stream = ChatToResponsesStream(request(), RESPONSE_ID, CREATED)
    events = stream.feed(chunk({"content": "Half"}))
    events += stream.fail("upstream closed the connection")
    final = check_events(events)
    assert events[-1][0] == "response.failed"
    response = events[-1][1]["response"]
    assert response["status"] == "failed"
    assert response["error"] == {"code": "server_error", "message": "upstream closed the connection"}
    assert response["output"][0]["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == "Half"
    if HAVE_SDK:
        assert final.status == "failed"
    assert stream.fail("again") == [] and stream.finish() == []


def test_fail_before_anything_still_opens_the_stream() -> None:
    stream = ChatToResponsesStream(request(), RESPONSE_ID, CREATED)
    events = stream.fail("no replica is ready")
    check_events(events)
    assert names(events) == ["response.created", "response.in_progress", "response.failed"]


def test_an_upstream_error_chunk_fails_the_stream() -> None:
    stream = ChatToResponsesStream(request(), RESPONSE_ID, CREATED)
    events = stream.feed({"error": {"message": "context length exceeded", "type": "BadRequestError", "code": 400}})
    check_events(events)
    assert events[-1][1]["response"]["error"]["message"] == "context length exceeded"
    assert stream.done


def test_an_empty_stream_completes() -> None:
    stream = ChatToResponsesStream(request(), RESPONSE_ID, CREATED)
    events = stream.finish()
    check_events(events)
    assert names(events) == ["response.created", "response.in_progress", "response.completed"]


def test_a_second_text_after_a_call_is_a_new_message_item() -> None:
    chunks = [chunk(tool_delta(0, id="c", name="shell", args="{}")), chunk({"content": "ran"}), chunk({}, "stop")]
    _, events = run_stream(chunks, request(tools=[SHELL_TOOL]))
    output = events[-1][1]["response"]["output"]
    assert [(item["type"], item["id"]) for item in output] == [
        ("function_call", "fc_0123abcd_0"),
        ("message", "msg_0123abcd_1"),
    ]


@needs_sdk
def test_stream_and_non_stream_give_the_same_response() -> None:
    req = request(tools=[SHELL_TOOL, APPLY_PATCH_TOOL], stream=True)
    patch_args = json.dumps({"input": PATCH})
    calls = [
        {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
        {"id": "call_b", "type": "function", "function": {"name": "apply_patch", "arguments": patch_args}},
    ]
    whole = to_response(
        completion({"content": "Two steps.", "tool_calls": calls}, "tool_calls", usage(90, 40, cached=64)), req
    )
    chunks = [
        chunk({"role": "assistant", "content": "Two "}),
        chunk({"content": "steps."}),
        chunk(tool_delta(0, id="call_a", name="shell", args='{"command":')),
        chunk(tool_delta(0, args='["ls"]}')),
        chunk(tool_delta(1, id="call_b", name="apply_patch", args=patch_args[:7])),
        chunk(tool_delta(1, args=patch_args[7:])),
        chunk({}, "tool_calls"),
        chunk(usage=usage(90, 40, cached=64)),
    ]
    _, events = run_stream(chunks, req)
    streamed = events[-1][1]["response"]
    assert streamed["output"] == whole["output"]
    assert streamed["usage"] == whole["usage"]
    assert {k: v for k, v in streamed.items() if k != "output"} == {k: v for k, v in whole.items() if k != "output"}
    final = check_events(events)
    assert [item.type for item in final.output] == ["message", "function_call", "custom_tool_call"]


def test_events_do_not_change_after_they_are_made() -> None:
    stream = ChatToResponsesStream(request(), RESPONSE_ID, CREATED)
    added = stream.feed(chunk({"content": "a"}))[2][1]
    stream.feed(chunk({"content": "b"}))
    stream.finish()
    assert added["item"] == {
        "id": "msg_0123abcd_0",
        "type": "message",
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }


# Errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "invalid_request_error"),
        (429, "rate_limit_exceeded"),
        (500, "server_error"),
        (503, "server_error"),
    ],
)
def test_openai_error_types(status: int, kind: str) -> None:
    assert openai_error(status, "why") == {"error": {"message": "why", "type": kind, "param": None, "code": None}}


def test_openai_error_with_everything() -> None:
    body = openai_error(404, "The model `x` does not exist.", "invalid_request_error", "model", "model_not_found")
    assert body == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


# Namespace tools --------------------------------------------------------------------------------------------


def test_namespace_tools_are_offered_as_functions_named_namespace__tool() -> None:
    chat, ignored = to_chat(request(tools=[SHELL_TOOL, COLLABORATION_TOOL]))
    assert ignored == []
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "shell",
        "collaboration__spawn_agent",
        "collaboration__wait",
        "collaboration__send_note",
    ]
    spawn, wait, note = chat["tools"][1:]
    assert spawn == {
        "type": "function",
        "function": {
            "name": "collaboration__spawn_agent",
            "description": "Tools for working with other agents.\n\nStart a sub-agent on a task.",
            "parameters": SPAWN_PARAMETERS,
        },
    }
    assert wait["function"]["description"] == "Tools for working with other agents.\n\nWait for agents."
    # A custom child is a function of one string, as a top-level custom tool is.
    assert note["function"]["parameters"]["required"] == [CUSTOM_TOOL_INPUT]
    assert note["function"]["description"].endswith("Send free-form text to an agent.")


def test_a_namespace_description_already_in_the_tools_description_is_not_repeated() -> None:
    tool = {
        "type": "namespace",
        "name": "crm",
        "description": "CRM.",
        "tools": [
            {"type": "function", "name": "find", "description": "CRM. Find a customer."},
            {"type": "function", "name": "bare"},
        ],
    }
    chat, _ = to_chat(request(tools=[tool]))
    assert [t["function"].get("description") for t in chat["tools"]] == ["CRM. Find a customer.", "CRM."]
    assert list(chat["tools"][1]["function"]) == ["name", "description", "parameters"]


def test_a_namespaced_name_that_chat_would_refuse_is_made_valid_the_same_way_every_time() -> None:
    long_name = "x" * 60
    tool = {
        "type": "namespace",
        "name": "mcp.github-server",
        "description": "GitHub.",
        "tools": [
            {"type": "function", "name": "list issues"},
            {"type": "function", "name": long_name},
            {"type": "function", "name": "list_issues"},
        ],
    }
    chat, _ = to_chat(request(tools=[tool]))
    offered = [t["function"]["name"] for t in chat["tools"]]
    assert all(CHAT_NAME.match(name) for name in offered), offered
    assert len(set(offered)) == 3
    assert offered[0].startswith("mcp_github-server__list_issues_") and len(offered[0]) == 39
    assert len(offered[1]) == 64
    again, _ = to_chat(request(tools=[tool]))
    assert [t["function"]["name"] for t in again["tools"]] == offered
    # And back: each chat name is the child's own name in its namespace.
    names = ToolNames([tool])
    assert [names.back(name) for name in offered] == [
        ("list issues", "mcp.github-server", False),
        (long_name, "mcp.github-server", False),
        ("list_issues", "mcp.github-server", False),
    ]


def test_a_joined_name_taken_by_a_top_level_tool_gets_another() -> None:
    taken = {"type": "function", "name": "collaboration__wait"}
    chat, _ = to_chat(request(tools=[taken, COLLABORATION_TOOL]))
    offered = [t["function"]["name"] for t in chat["tools"]]
    assert offered[0] == "collaboration__wait"
    assert offered[2].startswith("collaboration__wait_") and offered[2] != offered[0]
    names = ToolNames([taken, COLLABORATION_TOOL])
    assert names.back(offered[0]) == ("collaboration__wait", None, False)
    assert names.back(offered[2]) == ("wait", "collaboration", False)


def test_a_call_to_a_namespaced_tool_comes_back_with_its_name_and_namespace() -> None:
    req = request(tools=[SHELL_TOOL, COLLABORATION_TOOL])
    calls = [
        {
            "id": "call_s",
            "type": "function",
            "function": {"name": "collaboration__spawn_agent", "arguments": '{"message":"review a.py"}'},
        },
        {
            "id": "call_n",
            "type": "function",
            "function": {"name": "collaboration__send_note", "arguments": json.dumps({"input": "hurry"})},
        },
        {"id": "call_l", "type": "function", "function": {"name": "shell", "arguments": '{"command":["ls"]}'}},
    ]
    out = to_response(completion({"content": None, "tool_calls": calls}, "tool_calls"), req)
    assert out["output"] == [
        {
            "id": "fc_0123abcd_0",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_s",
            "name": "spawn_agent",
            "namespace": "collaboration",
            "arguments": '{"message":"review a.py"}',
        },
        {
            "id": "ctc_0123abcd_1",
            "type": "custom_tool_call",
            "call_id": "call_n",
            "name": "send_note",
            "namespace": "collaboration",
            "input": "hurry",
        },
        {
            "id": "fc_0123abcd_2",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_l",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
        },
    ]
    assert [t["type"] for t in out["tools"]] == ["function", "namespace"]
    if HAVE_SDK:
        parsed = Response.model_validate(out)
        assert [(item.name, item.namespace) for item in parsed.output] == [  # type: ignore[union-attr]
            ("spawn_agent", "collaboration"),
            ("send_note", "collaboration"),
            ("shell", None),
        ]


def test_a_streamed_call_to_a_namespaced_tool_names_it_and_its_namespace_in_every_event() -> None:
    args = '{"message":"review a.py"}'
    chunks = [
        chunk(tool_delta(0, id="call_s", name="collaboration__spawn_agent", args=args[:9])),
        chunk(tool_delta(0, args=args[9:])),
        chunk(tool_delta(1, id="call_n", name="collaboration__send_note", args=json.dumps({"input": "hurry"}))),
        chunk({}, "tool_calls"),
        chunk(usage=usage(40, 12)),
    ]
    req = request(tools=[COLLABORATION_TOOL], stream=True)
    _, events = run_stream(chunks, req)
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert added == [
        {
            "id": "fc_0123abcd_0",
            "type": "function_call",
            "status": "in_progress",
            "call_id": "call_s",
            "name": "spawn_agent",
            "namespace": "collaboration",
            "arguments": "",
        },
        {
            "id": "ctc_0123abcd_1",
            "type": "custom_tool_call",
            "call_id": "call_n",
            "name": "send_note",
            "namespace": "collaboration",
            "input": "",
        },
    ]
    assert [(item["name"], item["namespace"], item.get("status")) for item in done] == [
        ("spawn_agent", "collaboration", "completed"),
        ("send_note", "collaboration", None),
    ]
    assert done[0]["arguments"] == args and done[1]["input"] == "hurry"
    final = events[-1][1]["response"]
    assert final["output"] == done
    calls = [
        {"id": "call_s", "type": "function", "function": {"name": "collaboration__spawn_agent", "arguments": args}},
        {
            "id": "call_n",
            "type": "function",
            "function": {"name": "collaboration__send_note", "arguments": json.dumps({"input": "hurry"})},
        },
    ]
    whole = to_response(completion({"content": None, "tool_calls": calls}, "tool_calls"), req)
    assert final["output"] == whole["output"]
    if HAVE_SDK:
        parsed = check_events(events)
        assert [(item.name, item.namespace) for item in parsed.output] == [
            ("spawn_agent", "collaboration"),
            ("send_note", "collaboration"),
        ]


def test_namespaced_calls_in_the_history_become_calls_to_the_offered_names() -> None:
    items = [
        user("review a.py with a helper"),
        {
            "type": "function_call",
            "call_id": "call_s",
            "name": "spawn_agent",
            "namespace": "collaboration",
            "arguments": '{"message":"review a.py"}',
        },
        {"type": "function_call_output", "call_id": "call_s", "output": "agent 7 started"},
        {
            "type": "custom_tool_call",
            "call_id": "call_n",
            "name": "send_note",
            "namespace": "collaboration",
            "input": "go",
        },
        {"type": "custom_tool_call_output", "call_id": "call_n", "output": "sent"},
    ]
    chat, _ = to_chat(request(input=items, tools=[COLLABORATION_TOOL]))
    assert chat["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_s",
                    "type": "function",
                    "function": {"name": "collaboration__spawn_agent", "arguments": '{"message":"review a.py"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_s", "content": "agent 7 started"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_n",
                    "type": "function",
                    "function": {"name": "collaboration__send_note", "arguments": '{"input":"go"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_n", "content": "sent"},
    ]


def test_a_namespaced_call_round_trips_as_codex_replays_it() -> None:
    req = request(tools=[COLLABORATION_TOOL])
    calls = [{"id": "call_w", "type": "function", "function": {"name": "collaboration__wait", "arguments": "{}"}}]
    out = to_response(completion({"content": None, "tool_calls": calls}, "tool_calls"), req)
    replay = [user("wait"), *out["output"], {"type": "function_call_output", "call_id": "call_w", "output": "done"}]
    chat, _ = to_chat(request(input=replay, tools=[COLLABORATION_TOOL]))
    assert chat["messages"][1]["tool_calls"][0]["function"] == {"name": "collaboration__wait", "arguments": "{}"}


def test_a_history_call_to_a_namespace_no_longer_offered_still_gets_a_valid_name() -> None:
    items = [user("x"), {"type": "function_call", "call_id": "c", "name": "a b", "namespace": "old", "arguments": "{}"}]
    chat, _ = to_chat(request(input=items, validate=False))
    name = chat["messages"][1]["tool_calls"][0]["function"]["name"]
    assert CHAT_NAME.match(name) and name.startswith("old__a_b_")


@pytest.mark.parametrize(
    "choice",
    [
        {"type": "function", "name": "spawn_agent", "namespace": "collaboration"},
        {"type": "function", "name": "spawn_agent"},  # no top-level tool of that name, one namespace has it
        {"type": "function", "name": "collaboration__spawn_agent"},  # the offered name itself
    ],
)
def test_tool_choice_naming_a_namespaced_function_chooses_its_offered_name(choice: dict[str, Any]) -> None:
    chat, _ = to_chat(request(validate=False, tools=[SHELL_TOOL, COLLABORATION_TOOL], tool_choice=choice))
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "collaboration__spawn_agent"}}


def test_tool_choice_naming_a_namespaced_custom_tool_chooses_its_offered_name() -> None:
    choice = {"type": "custom", "name": "send_note", "namespace": "collaboration"}
    chat, _ = to_chat(request(validate=False, tools=[COLLABORATION_TOOL], tool_choice=choice))
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "collaboration__send_note"}}


def test_a_top_level_tool_wins_a_tool_choice_without_a_namespace() -> None:
    wait = {"type": "function", "name": "wait"}
    chat, _ = to_chat(request(tools=[wait, COLLABORATION_TOOL], tool_choice={"type": "function", "name": "wait"}))
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "wait"}}


def test_allowed_tools_can_name_namespaced_tools_or_a_whole_namespace() -> None:
    tools = [SHELL_TOOL, COLLABORATION_TOOL]
    one = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [{"type": "function", "name": "spawn_agent", "namespace": "collaboration"}],
    }
    chat, _ = to_chat(request(tools=tools, tool_choice=one))
    assert [t["function"]["name"] for t in chat["tools"]] == ["collaboration__spawn_agent"]
    whole = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "namespace", "name": "collaboration"}]}
    chat, _ = to_chat(request(tools=tools, tool_choice=whole))
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "collaboration__spawn_agent",
        "collaboration__wait",
        "collaboration__send_note",
    ]
    assert chat["tool_choice"] == "required"
    listed = {
        "type": "allowed_tools",
        "mode": "auto",
        "tools": [
            {"type": "namespace", "name": "collaboration", "tools": [{"type": "function", "name": "wait"}]},
            SHELL_TOOL,
        ],
    }
    chat, _ = to_chat(request(tools=tools, tool_choice=listed))
    assert [t["function"]["name"] for t in chat["tools"]] == ["shell", "collaboration__wait"]


# llama.cpp's timings ----------------------------------------------------------------------------------------


def test_llama_server_timings_give_the_usage_when_no_usage_came() -> None:
    resp = completion({"content": "hi"})
    resp["timings"] = {"cache_n": 100, "prompt_n": 20, "predicted_n": 2}
    assert to_response(resp, request())["usage"]["input_tokens"] == 120
    last = chunk({}, "stop")
    last["timings"] = {"cache_n": 100, "prompt_n": 20, "predicted_n": 2}
    stream, events = run_stream([chunk({"content": "h"}), chunk({"content": "i"}), last], request(stream=True))
    final = events[-1][1]["response"]["usage"]
    assert (final["input_tokens"], final["output_tokens"], final["total_tokens"]) == (120, 2, 122)
    assert not stream.usage.estimated
