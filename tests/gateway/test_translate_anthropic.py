"""Anthropic Messages <-> chat completions: requests, responses, streams and errors.

Where the `anthropic` and `openai` SDKs are installed (the dev extra), every body made here is
also parsed with their own types (and streams run through the Anthropic SDK's accumulator), the
strongest check that the shapes are the real ones. Without them those checks are skipped.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from apps.gateway.translate.anthropic import (
    ChatToAnthropicStream,
    TranslationError,
    anthropic_error,
    chat_to_message,
    error_event,
    messages_to_chat,
    parse_tool_input,
    sse,
)

try:
    import anthropic.types as anthropic_types
    from anthropic.lib.streaming._messages import accumulate_event
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.chat import completion_create_params as chat_params
    from pydantic import TypeAdapter

    HAVE_SDKS = True
except ImportError:  # pragma: no cover - the dev extra installs them
    HAVE_SDKS = False

needs_sdks = pytest.mark.skipif(not HAVE_SDKS, reason="the anthropic and openai SDKs are not installed")


# Builders and SDK checks ----------------------------------------------------------------------------------


def request(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "qwen", "max_tokens": 256, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    if HAVE_SDKS:
        TypeAdapter(anthropic_types.MessageCreateParams).validate_python(body)
    return body


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    chat = messages_to_chat(body)
    ignored = chat.pop("_ignored")
    assert isinstance(ignored, list)
    if HAVE_SDKS:
        kind = (
            chat_params.CompletionCreateParamsStreaming
            if chat.get("stream")
            else chat_params.CompletionCreateParamsNonStreaming
        )
        TypeAdapter(kind).validate_python(chat)
    return chat


def completion(message: dict[str, Any], finish: str = "stop", usage: dict[str, Any] | None = None, **choice: Any):
    resp = {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "qwen",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **choice}],
    }
    if usage is not None:
        resp["usage"] = usage
    if HAVE_SDKS:
        ChatCompletion.model_validate(resp)
    return resp


def to_message(resp: dict[str, Any], model: str = "claude-via-gw", **kw: Any) -> dict[str, Any]:
    msg = chat_to_message(resp, model, **kw)
    if HAVE_SDKS:
        anthropic_types.Message.model_validate(msg)
        json.dumps(msg)
    return msg


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None, **extra: Any):
    c: dict[str, Any] = {
        "id": "chatcmpl-abc123",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "qwen",
    }
    c["choices"] = (
        [] if delta is None and finish is None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    if usage is not None:
        c["usage"] = usage
    c.update(extra)
    if HAVE_SDKS and "error" not in c:
        ChatCompletionChunk.model_validate(c)
    return c


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def tool_delta(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None):
    call: dict[str, Any] = {"index": index}
    if id is not None:
        call["id"] = id
        call["type"] = "function"
    function = {}
    if name is not None:
        function["name"] = name
    if args is not None:
        function["arguments"] = args
    call["function"] = function
    return {"tool_calls": [call]}


def run_stream(chunks: list[dict[str, Any]], model: str = "claude-via-gw", **kw: Any):
    stream = ChatToAnthropicStream(model, **kw)
    events = []
    for c in chunks:
        events.extend(stream.feed(c))
    events.extend(stream.finish())
    check_events(events)
    return stream, events


def check_events(events: list[tuple[str, dict[str, Any]]]) -> Any:
    """Every event's name is its data's type; with the SDK, each parses and the whole stream accumulates."""
    for name, data in events:
        assert data["type"] == name
        assert sse(name, data).startswith(f"event: {name}\ndata: ".encode())
    if not HAVE_SDKS:
        return None
    adapter = TypeAdapter(anthropic_types.RawMessageStreamEvent)
    snapshot = None
    bufs: dict[int, bytes] = {}
    for name, data in events:
        if name in ("ping", "error"):
            continue
        event = adapter.validate_python(data)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


def names(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [name for name, _ in events]


# Requests ---------------------------------------------------------------------------------------------------


def test_plain_text_request_becomes_a_chat_request() -> None:
    chat = to_chat(request(system="Be brief.", temperature=0.2, top_p=0.9))
    assert chat == {
        "model": "qwen",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 256,
        "temperature": 0.2,
        "top_p": 0.9,
    }


def test_stream_asks_for_usage_in_the_last_chunk() -> None:
    chat = to_chat(request(stream=True))
    assert chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True}
    assert "stream" not in to_chat(request(stream=False))


def test_system_as_text_blocks_is_joined_and_cache_control_dropped() -> None:
    system = [
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Work in /repo."},
    ]
    chat = to_chat(request(system=system))
    assert chat["messages"][0] == {"role": "system", "content": "You are Claude Code.\n\nWork in /repo."}


def test_text_blocks_of_a_user_turn_become_one_string() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Fix it"}]}
    ]
    assert to_chat(request(messages=messages))["messages"] == [{"role": "user", "content": "<reminder>\nFix it"}]


def test_images_become_image_url_parts() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                {"type": "text", "text": "Same animal?"},
            ],
        }
    ]
    chat = to_chat(request(messages=messages))
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                {"type": "text", "text": "Same animal?"},
            ],
        }
    ]


def test_a_text_document_is_read_as_text() -> None:
    doc = {
        "type": "document",
        "title": "notes.txt",
        "source": {"type": "text", "media_type": "text/plain", "data": "x=1"},
    }
    messages = [{"role": "user", "content": [doc, {"type": "text", "text": "What is x?"}]}]
    assert to_chat(request(messages=messages))["messages"][0]["content"] == "notes.txt\n\nx=1\nWhat is x?"


def test_multi_turn_tool_use_and_tool_result() -> None:
    messages = [
        {"role": "user", "content": "What's the weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "two calls", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {"city": "Rome"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18°C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "service down"}, {"type": "text", "text": "retry later"}],
                    "is_error": True,
                },
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    chat = to_chat(request(messages=messages))
    assert chat["messages"] == [
        {"role": "user", "content": "What's the weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "toolu_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18°C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: service down\nretry later"},
        {"role": "user", "content": "Thanks"},
    ]


def test_tool_use_only_turn_has_null_content_and_tool_results_alone_need_no_user_message() -> None:
    messages = [
        {"role": "user", "content": "ls"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
    ]
    chat = to_chat(request(messages=messages))
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}],
    }
    assert chat["messages"][2:] == [{"role": "tool", "tool_call_id": "t1", "content": ""}]


def test_an_image_in_a_tool_result_moves_to_the_user_message_after_the_tool_messages() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}
    messages = [
        {"role": "user", "content": "screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "ok"}, image]}
            ],
        },
    ]
    chat = to_chat(request(messages=messages))
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}]},
    ]


def test_consecutive_turns_of_one_role_are_merged() -> None:
    messages = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "Hel"},
        {"role": "assistant", "content": [{"type": "text", "text": "lo"}]},
    ]
    assert to_chat(request(messages=messages))["messages"] == [
        {"role": "user", "content": "one\ntwo"},
        {"role": "assistant", "content": "Hello"},
    ]


def test_tools_become_functions() -> None:
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    tools = [
        {"name": "read", "description": "Read a file", "input_schema": schema, "cache_control": {"type": "ephemeral"}},
        {"type": "custom", "name": "noop", "input_schema": {"type": "object"}},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ]
    chat = messages_to_chat(request(tools=tools))
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": schema}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
    ]
    assert chat["_ignored"] == ["tools:web_search_20250305"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "read"}, {"type": "function", "function": {"name": "read"}}),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    tools = [{"name": "read", "input_schema": {"type": "object"}}]
    chat = to_chat(request(tools=tools, tool_choice=choice))
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_disable_parallel_tool_use() -> None:
    tools = [{"name": "read", "input_schema": {"type": "object"}}]
    chat = to_chat(request(tools=tools, tool_choice={"type": "auto", "disable_parallel_tool_use": True}))
    assert chat["parallel_tool_calls"] is False


def test_tool_choice_without_tools_is_dropped() -> None:
    assert "tool_choice" not in to_chat(request(tool_choice={"type": "any"}))


def test_sampling_fields_stops_and_ignored_fields() -> None:
    chat = messages_to_chat(
        request(
            top_k=40,
            stop_sequences=["</answer>", "\n\nHuman:"],
            metadata={"user_id": "u-1"},
            thinking={"type": "enabled", "budget_tokens": 128},
            service_tier="auto",
        )
    )
    assert chat["stop"] == ["</answer>", "\n\nHuman:"]
    assert chat["top_k"] == 40  # llama.cpp, vLLM and SGLang take it in chat
    assert "metadata" not in chat and "thinking" not in chat
    assert chat["_ignored"] == ["service_tier", "thinking"]
    assert messages_to_chat(request(stop_sequences=[]))["_ignored"] == []
    assert "stop" not in messages_to_chat(request(stop_sequences=[]))


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": "100"}, "max_tokens"),
        ({"model": None}, "model"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": ["text"]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages[0].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}
                ]
            },
            "messages[0].content[0].source.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {"type": "base64", "media_type": "application/pdf", "data": "x"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].source.type",
        ),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": []}]}
                ]
            },
            "messages[0].content[0].input",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web"}]}]},
            "messages[0].content[0].type",
        ),
        ({"system": [{"type": "image"}]}, "system[0].type"),
        ({"system": 3}, "system"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
        ({"tools": {"name": "x"}}, "tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"tool_choice": {"type": "tool"}, "tools": [{"name": "x", "input_schema": {}}]}, "tool_choice.name"),
        ({"stop_sequences": "STOP"}, "stop_sequences"),
        ({"stop_sequences": ["a", 1]}, "stop_sequences[1]"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_malformed_requests_name_the_parameter(change: dict[str, Any], param: str) -> None:
    body = {"model": "qwen", "max_tokens": 256, "messages": [{"role": "user", "content": "Hi"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(TranslationError) as caught:
        messages_to_chat(body)
    assert caught.value.param == param
    assert param.split("[")[0].split(".")[0] in caught.value.message


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(TranslationError):
        messages_to_chat([])  # type: ignore[arg-type]


# Responses --------------------------------------------------------------------------------------------------


def test_text_completion_becomes_a_message() -> None:
    msg = to_message(completion({"content": "Hello!"}, usage=usage(12, 3)))
    assert msg == {
        "id": "msg_abc123",
        "type": "message",
        "role": "assistant",
        "model": "claude-via-gw",
        "content": [{"type": "text", "text": "Hello!"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 12,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 3,
        },
    }


def test_tool_calls_become_tool_use_blocks() -> None:
    calls = [
        {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "list", "arguments": ""}},
    ]
    msg = to_message(completion({"content": "Let me look.", "tool_calls": calls}, "tool_calls", usage(40, 20)))
    assert msg["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "call_1", "name": "read", "input": {"path": "a.py"}},
        {"type": "tool_use", "id": "call_2", "name": "list", "input": {}},
    ]
    assert msg["stop_reason"] == "tool_use"


def test_invalid_tool_arguments_are_kept_raw() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"'}}]
    msg = to_message(completion({"content": None, "tool_calls": calls}, "tool_calls"))
    assert msg["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "read", "input": {"_raw_arguments": '{"path": "a.py"'}}
    ]
    assert parse_tool_input("[1, 2]") == {"_raw_arguments": "[1, 2]"}
    assert parse_tool_input("  ") == {}
    assert parse_tool_input(None) == {}
    assert parse_tool_input({"a": 1}) == {"a": 1}


def test_a_tool_call_without_an_id_gets_one() -> None:
    calls = [{"id": "", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    msg = to_message(completion({"content": None, "tool_calls": calls}, "stop"))
    assert msg["content"][0]["id"] == "toolu_abc123_0"
    assert msg["stop_reason"] == "tool_use"  # "stop" with calls present (some engines say so)


@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"), ("content_filter", "refusal")],
)
def test_stop_reasons(finish: str, expected: str) -> None:
    assert to_message(completion({"content": "x"}, finish))["stop_reason"] == expected


def test_a_matched_stop_string_is_a_stop_sequence() -> None:
    # vLLM names the stop string that ended the completion in the choice's stop_reason.
    msg = to_message(completion({"content": "42"}, "stop", stop_reason="</answer>"), stop_sequences=["</answer>"])
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "</answer>")
    eos = to_message(completion({"content": "42"}, "stop", stop_reason=None), stop_sequences=["</answer>"])
    assert (eos["stop_reason"], eos["stop_sequence"]) == ("end_turn", None)


@pytest.mark.parametrize(
    ("matched", "asked"),
    [
        ("<|im_end|>", ["</answer>"]),  # a stop the engine or its template added, not the client
        ("</answer>", None),  # the request asked for no stop sequences
        ("", [""]),  # an empty string matches nothing
        (151645, ["</answer>"]),  # vLLM's stop token id, not a string
    ],
)
def test_a_stop_the_request_did_not_ask_for_is_an_end_turn(matched: Any, asked: list[str] | None) -> None:
    resp = completion({"content": "42"}, "stop")
    resp["choices"][0]["stop_reason"] = matched
    msg = to_message(resp, stop_sequences=asked)
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("end_turn", None)


def test_llama_server_verbose_names_the_stop_sequence_of_a_whole_response() -> None:
    """llama-server asked with "verbose": true adds a top-level __verbose object (shape as seen)."""
    resp = completion({"content": "aaa "}, "stop", usage(12, 3))
    resp["timings"] = {"cache_n": 0, "prompt_n": 12, "predicted_n": 3}
    resp["__verbose"] = {"content": "aaa ", "stop": True, "stop_type": "word", "stopping_word": "bbb", "tokens": []}
    resp["system_fingerprint"] = "b1-0c1e570"
    msg = to_message(resp, stop_sequences=["zzz", "bbb"])
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "bbb")
    assert "__verbose" not in json.dumps(msg) and "timings" not in msg
    resp["__verbose"] = {"stop_type": "eos", "stopping_word": ""}
    assert to_message(resp, stop_sequences=["bbb"])["stop_reason"] == "end_turn"
    resp["__verbose"] = {"stop_type": "limit", "stopping_word": ""}
    assert to_message(resp, stop_sequences=["bbb"])["stop_reason"] == "end_turn"


def test_messages_to_chat_does_not_ask_for_verbose() -> None:
    # An external OpenAI-compatible provider refuses fields it does not know.
    chat = to_chat(request(stop_sequences=["bbb"], stream=True))
    assert "verbose" not in chat and chat["stop"] == ["bbb"]


def test_llama_server_timings_give_the_usage_of_a_whole_response_without_usage() -> None:
    resp = completion({"content": "x"})
    resp["timings"] = {"cache_n": 30, "prompt_n": 10, "predicted_n": 7, "prompt_ms": 1.5}
    assert to_message(resp)["usage"] == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 7,
    }


def test_cached_prompt_tokens_are_cache_reads() -> None:
    msg = to_message(completion({"content": "x"}, usage=usage(100, 5, cached=80)))
    assert msg["usage"] == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 80,
        "output_tokens": 5,
    }


def test_no_usage_and_no_id() -> None:
    resp = completion({"content": "x"})
    del resp["id"]
    msg = chat_to_message(resp, "m")
    assert msg["id"].startswith("msg_") and len(msg["id"]) > 8
    assert msg["usage"] == {
        "input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }


def test_round_trip_of_a_tool_turn() -> None:
    """The message sent back is the next request's assistant turn: its calls and results line up."""
    calls = [{"id": "call_9", "type": "function", "function": {"name": "read", "arguments": '{"path": "x"}'}}]
    msg = to_message(completion({"content": "Reading.", "tool_calls": calls}, "tool_calls", usage(10, 8)))
    next_turns = [
        {"role": "user", "content": "Open x"},
        {"role": "assistant", "content": msg["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_9", "content": "data"}]},
    ]
    chat = to_chat(request(messages=next_turns))
    assert chat["messages"][1]["tool_calls"] == [
        {"id": "call_9", "type": "function", "function": {"name": "read", "arguments": '{"path": "x"}'}}
    ]
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "call_9", "content": "data"}


# Streams ----------------------------------------------------------------------------------------------------


def test_text_stream_event_sequence() -> None:
    chunks = [
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "Hel"}),
        chunk({"content": "lo"}),
        chunk({}, "stop"),
        chunk(usage=usage(24, 2)),
    ]
    stream, events = run_stream(chunks)
    assert events == [
        (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_abc123",
                    "type": "message",
                    "role": "assistant",
                    "model": "claude-via-gw",
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {
                        "input_tokens": 0,
                        "cache_creation_input_tokens": 0,
                        "cache_read_input_tokens": 0,
                        "output_tokens": 0,
                    },
                },
            },
        ),
        ("ping", {"type": "ping"}),
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {
                    "input_tokens": 24,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 2,
                },
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    assert stream.finish_reason == "stop"
    assert stream.usage.input_tokens == 24 and not stream.usage.estimated
    assert stream.done and stream.feed(chunk({"content": "late"})) == [] and stream.finish() == []


def test_tool_call_arguments_split_across_chunks() -> None:
    chunks = [
        chunk({"role": "assistant", "content": "Let me check."}),
        chunk(tool_delta(0, id="call_1", name="weather", args="")),
        chunk(tool_delta(0, args='{"ci')),
        chunk(tool_delta(0, args='ty": "Par')),
        chunk(tool_delta(0, args='is"}')),
        chunk(tool_delta(1, id="call_2", name="time", args='{"tz": "CET"}')),
        chunk({}, "tool_calls"),
        chunk(usage=usage(50, 30, cached=32)),
    ]
    stream, events = run_stream(chunks)
    assert names(events) == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[5][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "weather", "input": {}}
    assert [e[1]["delta"] for e in events[6:9]] == [
        {"type": "input_json_delta", "partial_json": '{"ci'},
        {"type": "input_json_delta", "partial_json": 'ty": "Par'},
        {"type": "input_json_delta", "partial_json": 'is"}'},
    ]
    assert {e[1]["index"] for e in events[5:10]} == {1}
    assert events[10][1] == {
        "type": "content_block_start",
        "index": 2,
        "content_block": {"type": "tool_use", "id": "call_2", "name": "time", "input": {}},
    }
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # The stream counts the whole prompt as input, as message_start did (the cache's part came too late).
    assert events[-2][1]["usage"] == {
        "input_tokens": 50,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 30,
    }
    assert stream.tokens_counted == 5  # the text, three argument pieces and the second call's arguments
    if HAVE_SDKS:
        final = check_events(events)
        assert final.content[1].input == {"city": "Paris"}
        assert final.content[2].input == {"tz": "CET"}
        assert final.stop_reason == "tool_use"
        assert (final.usage.input_tokens, final.usage.output_tokens) == (50, 30)


def test_a_tool_name_that_comes_late_opens_the_block_with_the_arguments_so_far() -> None:
    chunks = [
        chunk(tool_delta(0, id="call_1", args='{"a"')),
        chunk(tool_delta(0, name="f", args=": 1}")),
        chunk({}, "tool_calls"),
    ]
    _, events = run_stream(chunks)
    assert events[2][1]["content_block"]["name"] == "f"
    assert [e[1]["delta"]["partial_json"] for e in events if e[0] == "content_block_delta"] == ['{"a": 1}']


def test_a_repeated_tool_name_and_id_are_not_doubled() -> None:
    # Some providers repeat id and name in every delta of a call.
    chunks = [
        chunk(tool_delta(0, id="call_1", name="f", args='{"a":')),
        chunk(tool_delta(0, id="call_1", name="f", args="1}")),
        chunk({}, "tool_calls"),
    ]
    _, events = run_stream(chunks)
    starts = [e for e in events if e[0] == "content_block_start"]
    assert len(starts) == 1 and starts[0][1]["content_block"]["name"] == "f"


def test_a_tool_call_without_a_name_is_still_closed_at_the_end() -> None:
    _, events = run_stream([chunk(tool_delta(0, id="call_1", args="{}")), chunk({}, "tool_calls")])
    assert events[2][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "", "input": {}}
    assert names(events)[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stream_without_usage_counts_deltas() -> None:
    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "hmm"}),
        chunk({"content": "a"}),
        chunk({"content": "b"}),
        chunk({"content": "c"}, "length"),
    ]
    stream, events = run_stream(chunks)
    assert stream.tokens_counted == 4
    assert events[-2][1]["usage"] == {"output_tokens": 4}
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert stream.usage.output_tokens == 4 and stream.usage.estimated
    assert stream.usage.input_tokens is None


def test_input_tokens_given_up_front_go_in_message_start() -> None:
    _, events = run_stream([chunk({"content": "x"}, "stop")], input_tokens=321, message_id="msg_fixed")
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 321,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert events[0][1]["message"]["id"] == "msg_fixed"


def test_a_stop_string_in_a_stream() -> None:
    c = chunk({}, "stop")
    c["choices"][0]["stop_reason"] = "###"
    _, events = run_stream([chunk({"content": "x"}), c], stop_sequences=["###"])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}
    if HAVE_SDKS:
        assert check_events(events).stop_sequence == "###"


def test_a_stop_string_the_request_did_not_ask_for_ends_a_stream_as_end_turn() -> None:
    c = chunk({}, "stop")
    c["choices"][0]["stop_reason"] = "<|im_end|>"
    _, events = run_stream([chunk({"content": "x"}), c], stop_sequences=["###"])
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    _, events = run_stream([chunk({"content": "x"}), c])
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def llama_final_chunk(stop_type: str, word: str, *, with_usage: bool = False) -> dict[str, Any]:
    """llama-server's last chunk when the request carried "verbose": true (keys as it sent them)."""
    c: dict[str, Any] = {
        "choices": [{"finish_reason": "stop", "index": 0, "delta": {}}],
        "created": 1795981774,
        "id": "chatcmpl-GHeuQe6P",
        "model": "tiny.gguf",
        "system_fingerprint": "b1-0c1e570",
        "object": "chat.completion.chunk",
        "timings": {"cache_n": 0, "prompt_n": 9, "prompt_ms": 2.1, "predicted_n": 3, "predicted_ms": 4.2},
        "__verbose": {"content": "aaa ", "stop": True, "stop_type": stop_type, "stopping_word": word, "tokens": []},
    }
    if with_usage:
        c["usage"] = usage(9, 3)
    if HAVE_SDKS:
        ChatCompletionChunk.model_validate(c)
    return c


def test_llama_server_verbose_in_the_last_chunk_gives_the_stop_sequence() -> None:
    chunks = [chunk({"role": "assistant"}), chunk({"content": "aaa "}), llama_final_chunk("word", "bbb")]
    stream, events = run_stream(chunks, stop_sequences=["bbb"])
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "bbb"}
    assert not any("__verbose" in json.dumps(data) or "stopping_word" in json.dumps(data) for _, data in events)
    # No usage chunk came: the counts are llama.cpp's timings, exact, not estimated.
    assert events[-2][1]["usage"] == {
        "input_tokens": 9,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 3,
    }
    assert (stream.usage.input_tokens, stream.usage.output_tokens, stream.usage.estimated) == (9, 3, False)


def test_llama_server_verbose_on_a_usage_chunk_without_choices_is_read_too() -> None:
    last = llama_final_chunk("word", "bbb", with_usage=True)
    finish, tail = dict(last), dict(last)
    del finish["__verbose"], finish["timings"], finish["usage"]
    tail["choices"] = []
    _, events = run_stream([chunk({"content": "aaa "}), finish, tail], stop_sequences=["bbb"])
    assert events[-2][1]["delta"]["stop_sequence"] == "bbb"


@pytest.mark.parametrize("stop_type", ["eos", "limit"])
def test_llama_server_verbose_without_a_stop_word_is_no_stop_sequence(stop_type: str) -> None:
    _, events = run_stream([chunk({"content": "a"}), llama_final_chunk(stop_type, "")], stop_sequences=["bbb"])
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


def test_start_takes_the_prompt_count_once_it_is_known() -> None:
    stream = ChatToAnthropicStream("m", stop_sequences=["bbb"])
    events = stream.start(input_tokens=120)
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 120,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert stream.start(input_tokens=5) == []  # started once; the count is kept, nothing is sent again
    events += stream.feed(chunk({"content": "x"}))
    events += stream.feed(chunk({}, "stop"))
    events += stream.feed(chunk(usage=usage(120, 3, cached=100)))
    events += stream.finish()
    # The engine's final count wins in message_delta, split as message_start split it: the cache's
    # 100 tokens became known after message_start had counted every prompt token as input.
    assert events[-2][1]["usage"] == {
        "input_tokens": 120,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 3,
    }
    assert stream.usage.input_tokens == 120 and stream.usage.cached_input_tokens == 100
    if HAVE_SDKS:
        final = check_events(events).usage
        assert (final.input_tokens, final.cache_read_input_tokens, final.output_tokens) == (120, 0, 3)


def test_without_engine_usage_message_delta_carries_the_counted_prompt() -> None:
    stream = ChatToAnthropicStream("m")
    events = stream.start(input_tokens=50)
    events += stream.feed(chunk({"content": "a"}))
    events += stream.feed(chunk({"content": "b"}, "stop"))
    events += stream.finish()
    check_events(events)
    assert events[0][1]["message"]["usage"]["input_tokens"] == 50
    assert events[-2][1]["usage"] == {
        "input_tokens": 50,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 2,
    }
    assert (stream.usage.input_tokens, stream.usage.output_tokens, stream.usage.estimated) == (50, 2, True)


def test_a_count_known_only_after_the_stream_started_still_reaches_message_delta() -> None:
    stream = ChatToAnthropicStream("m")
    events = stream.feed(chunk({"content": "a"}, "stop"))
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert stream.start(input_tokens=33) == []
    events += stream.finish()
    check_events(events)
    assert events[-2][1]["usage"] == {
        "input_tokens": 33,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 1,
    }


def test_with_no_count_known_message_start_says_zero_and_message_delta_the_engines() -> None:
    _, events = run_stream([chunk({"content": "a"}, "stop"), chunk(usage=usage(17, 1))])
    assert events[0][1]["message"]["usage"] == {
        "input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 0,
    }
    assert events[-2][1]["usage"] == {
        "input_tokens": 17,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 1,
    }
    if HAVE_SDKS:
        assert check_events(events).usage.input_tokens == 17


def test_an_empty_stream_still_starts_and_stops() -> None:
    stream = ChatToAnthropicStream("m")
    events = stream.finish()
    check_events(events)
    assert names(events) == ["message_start", "ping", "message_delta", "message_stop"]


def test_an_upstream_error_chunk_ends_the_stream_with_an_error_event() -> None:
    stream = ChatToAnthropicStream("m")
    events = stream.feed(chunk({"content": "par"}))
    events += stream.feed({"error": {"message": "CUDA out of memory", "type": "server_error"}})
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "CUDA out of memory"}})
    assert stream.done and stream.finish() == []


def test_fail_mid_stream() -> None:
    stream = ChatToAnthropicStream("m")
    stream.feed(chunk({"content": "par"}))
    assert stream.fail("upstream closed the connection", "overloaded_error") == [
        ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "upstream closed the connection"}})
    ]
    assert stream.fail("again") == []


def test_text_after_a_tool_call_opens_a_new_text_block() -> None:
    chunks = [
        chunk(tool_delta(0, id="c", name="f", args="{}")),
        chunk({"content": "done"}),
        chunk({}, "tool_calls"),
    ]
    _, events = run_stream(chunks)
    starts = [e[1] for e in events if e[0] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "tool_use"), (1, "text")]


@needs_sdks
def test_stream_and_non_stream_give_the_same_message() -> None:
    calls = [{"id": "call_1", "type": "function", "function": {"name": "edit", "arguments": '{"file": "a", "n": 2}'}}]
    whole = to_message(completion({"content": "Editing.", "tool_calls": calls}, "tool_calls", usage(70, 9, cached=64)))
    chunks = [
        chunk({"role": "assistant", "content": "Edit"}),
        chunk({"content": "ing."}),
        chunk(tool_delta(0, id="call_1", name="edit", args='{"file": ')),
        chunk(tool_delta(0, args='"a", "n": 2}')),
        chunk({}, "tool_calls"),
        chunk(usage=usage(70, 9, cached=64)),
    ]
    _, events = run_stream(chunks)
    streamed = check_events(events).to_dict()
    assert streamed["content"] == whole["content"]
    assert streamed["stop_reason"] == whole["stop_reason"]
    assert streamed["id"] == whole["id"]
    # The same prompt and output; a stream counts its cache reads as input (message_start split the
    # prompt before the engine said what its cache held), a whole message reports them apart.
    parts = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    assert sum(streamed["usage"][k] for k in parts) == sum(whole["usage"][k] for k in parts) == 70
    assert streamed["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 9
    assert (whole["usage"]["input_tokens"], whole["usage"]["cache_read_input_tokens"]) == (6, 64)


def test_stream_of_a_real_llama_server_reply() -> None:
    """Chunks as llama.cpp's llama-server sent them (shared/bin, tiny test model, include_usage)."""
    raw = [
        '{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}],"created":1795981774,'
        '"id":"chatcmpl-GHeuQe6P","model":"tiny.gguf","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}',
        '{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"W{"}}],"created":1795981774,'
        '"id":"chatcmpl-GHeuQe6P","model":"tiny.gguf","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}',
        '{"choices":[{"finish_reason":"stop","index":0,"delta":{}}],"created":1795981774,"id":"chatcmpl-GHeuQe6P",'
        '"model":"tiny.gguf","system_fingerprint":"b1-0c1e570","object":"chat.completion.chunk"}',
        '{"choices":[],"created":1795981774,"id":"chatcmpl-GHeuQe6P","model":"tiny.gguf","system_fingerprint":"b1-0c1e570",'
        '"object":"chat.completion.chunk","usage":{"completion_tokens":4,"prompt_tokens":24,"total_tokens":28,'
        '"prompt_tokens_details":{"cached_tokens":0}},"timings":{"prompt_n":24,"predicted_n":4}}',
    ]
    chunks = [json.loads(line) for line in raw]
    if HAVE_SDKS:
        for c in chunks:
            ChatCompletionChunk.model_validate(c)
    stream, events = run_stream(chunks)
    assert events[0][1]["message"]["id"] == "msg_GHeuQe6P"
    assert events[-2][1]["usage"] == {
        "input_tokens": 24,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 4,
    }
    assert stream.tokens_counted == 1  # the engine's count (4) is better than ours: byte tokens arrived merged


# SSE and errors ---------------------------------------------------------------------------------------------


def test_sse_framing() -> None:
    assert sse("message_stop", {"type": "message_stop"}) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    assert sse("x", {"t": "é"}) == 'event: x\ndata: {"t":"é"}\n\n'.encode()


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
    ],
)
def test_anthropic_error_types(status: int, kind: str) -> None:
    body = anthropic_error(status, "why, with the numbers")
    assert body == {"type": "error", "error": {"type": kind, "message": "why, with the numbers"}}
    if HAVE_SDKS and kind != "request_too_large":  # the SDK's union lacks the 413 type its docs name
        from anthropic.types.shared.error_response import ErrorResponse

        ErrorResponse.model_validate(body)


def test_error_type_can_be_forced_and_error_event() -> None:
    assert anthropic_error(400, "m", "not_found_error")["error"]["type"] == "not_found_error"
    assert error_event("boom") == ("error", {"type": "error", "error": {"type": "api_error", "message": "boom"}})


def test_translation_error_carries_message_and_param() -> None:
    error = TranslationError("max_tokens: an integer is required.", "max_tokens")
    assert str(error) == "max_tokens: an integer is required."
    assert error.param == "max_tokens"
    assert anthropic_error(400, error.message)["error"]["type"] == "invalid_request_error"
