"""Usage read from whole responses and from streams of all three protocols, and counted when a
stream reports none."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apps.gateway.translate.anthropic import ChatToAnthropicStream
from apps.gateway.translate.responses import ChatToResponsesStream
from apps.gateway.translate.usage import (
    StreamUsage,
    Usage,
    count_chunk_tokens,
    from_anthropic,
    from_chat,
    from_responses,
    usage_from_response,
)


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, usage: dict | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    c["choices"] = (
        [] if delta is None and finish is None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    )
    if usage is not None:
        c["usage"] = usage
    return c


CHAT_USAGE = {
    "prompt_tokens": 120,
    "completion_tokens": 30,
    "total_tokens": 150,
    "prompt_tokens_details": {"cached_tokens": 100},
    "completion_tokens_details": {"reasoning_tokens": 12},
}


# Whole responses --------------------------------------------------------------------------------------------


def test_from_chat() -> None:
    assert from_chat(CHAT_USAGE) == Usage(
        input_tokens=120, output_tokens=30, cached_input_tokens=100, reasoning_tokens=12
    )
    assert from_chat({"prompt_tokens": 5, "completion_tokens": 1}) == Usage(input_tokens=5, output_tokens=1)
    assert from_chat(None) is None
    assert from_chat({"prompt_tokens": "5", "completion_tokens": True}) == Usage()


def test_from_anthropic_adds_cache_reads_and_writes_back_into_input() -> None:
    usage = from_anthropic(
        {"input_tokens": 20, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5, "output_tokens": 30}
    )
    assert usage == Usage(input_tokens=125, output_tokens=30, cached_input_tokens=100)
    assert from_anthropic({"input_tokens": 7, "output_tokens": 2}) == Usage(input_tokens=7, output_tokens=2)


def test_from_responses() -> None:
    usage = from_responses(
        {
            "input_tokens": 120,
            "input_tokens_details": {"cached_tokens": 100},
            "output_tokens": 30,
            "output_tokens_details": {"reasoning_tokens": 12},
            "total_tokens": 150,
        }
    )
    assert usage == Usage(input_tokens=120, output_tokens=30, cached_input_tokens=100, reasoning_tokens=12)


@pytest.mark.parametrize(
    "body",
    [
        {"id": "chatcmpl-1", "object": "chat.completion", "choices": [], "usage": CHAT_USAGE},
        {
            "id": "msg_1",
            "type": "message",
            "usage": {"input_tokens": 20, "cache_read_input_tokens": 100, "output_tokens": 30},
        },
        {
            "id": "resp_1",
            "object": "response",
            "usage": {"input_tokens": 120, "input_tokens_details": {"cached_tokens": 100}, "output_tokens": 30},
        },
    ],
)
def test_usage_from_response_recognises_the_protocol(body: dict[str, Any]) -> None:
    usage = usage_from_response(body)
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.cached_input_tokens) == (120, 30, 100)
    assert usage.total_tokens == 150


def test_usage_from_response_when_told_and_when_unknown() -> None:
    assert usage_from_response({"usage": CHAT_USAGE}, "chat") == from_chat(CHAT_USAGE)
    assert usage_from_response({"usage": CHAT_USAGE}) is None
    assert usage_from_response({"object": "chat.completion", "choices": []}) is None
    assert usage_from_response("not json") is None


def test_unknown_is_not_zero() -> None:
    assert Usage().total_tokens is None
    assert Usage(output_tokens=3).total_tokens == 3


def test_writing_usage_in_each_protocol() -> None:
    usage = from_chat(CHAT_USAGE)
    assert usage is not None
    assert usage.to_anthropic() == {
        "input_tokens": 20,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 100,
        "output_tokens": 30,
    }
    assert usage.to_responses() == {
        "input_tokens": 120,
        "input_tokens_details": {"cached_tokens": 100, "cache_write_tokens": 0},
        "output_tokens": 30,
        "output_tokens_details": {"reasoning_tokens": 12},
        "total_tokens": 150,
    }
    assert Usage(output_tokens=4).to_anthropic() == {
        "input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 4,
    }


# Counting ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("c", "tokens"),
    [
        (chunk({"role": "assistant", "content": ""}), 0),
        (chunk({"role": "assistant", "content": None}), 0),
        (chunk({"content": "Hi"}), 1),
        (chunk({"reasoning_content": "Let me think"}), 1),
        (chunk({"reasoning": "vLLM's field name"}), 1),
        (chunk({"refusal": "No."}), 1),
        (
            chunk(
                {
                    "tool_calls": [
                        {"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}
                    ]
                }
            ),
            0,
        ),
        (chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a'}}]}), 1),
        (chunk({}, "stop"), 0),
        (chunk(usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}), 0),
        ({"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"content": "b"}}]}, 2),
        ({"error": {"message": "boom"}}, 0),
        ("garbage", 0),
    ],
)
def test_count_chunk_tokens(c: Any, tokens: int) -> None:
    assert count_chunk_tokens(c) == tokens


# Streams ----------------------------------------------------------------------------------------------------


def test_chat_stream_with_usage_in_the_last_chunk() -> None:
    reader = StreamUsage("chat")
    for c in [chunk({"content": "a"}), chunk({"content": "b"}), chunk({}, "stop"), chunk(usage=CHAT_USAGE)]:
        reader.feed(c)
    assert reader.counted == 2
    assert reader.usage == from_chat(CHAT_USAGE)
    assert not reader.usage.estimated


def test_chat_stream_with_continuous_usage_keeps_the_last() -> None:
    reader = StreamUsage("chat")
    reader.feed(chunk({"content": "a"}, usage={"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}))
    reader.feed(chunk({"content": "b"}, usage={"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}))
    assert (reader.usage.input_tokens, reader.usage.output_tokens) == (9, 2)


def test_chat_stream_without_usage_is_counted() -> None:
    reader = StreamUsage("chat")
    for c in [chunk({"role": "assistant", "content": ""}), chunk({"content": "a"}), chunk({"content": "b"}, "length")]:
        reader.feed(c)
    assert reader.reported is None
    assert reader.usage == Usage(output_tokens=2, estimated=True)


def test_anthropic_stream() -> None:
    reader = StreamUsage("anthropic")
    events = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "m",
                "usage": {"input_tokens": 5, "cache_read_input_tokens": 100, "output_tokens": 1},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "!"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
        {"type": "message_stop"},
    ]
    for event in events:
        reader.feed(event)
    assert reader.counted == 2
    assert reader.usage == Usage(input_tokens=105, output_tokens=2, cached_input_tokens=100)


def test_anthropic_stream_whose_message_delta_carries_the_input_count() -> None:
    # As the gateway's own translation (and llama.cpp) send it: message_start cannot know the prompt yet.
    reader = StreamUsage("anthropic")
    reader.feed({"type": "message_start", "message": {"usage": {"input_tokens": 0, "output_tokens": 0}}})
    reader.feed(
        {"type": "message_delta", "usage": {"input_tokens": 18, "cache_read_input_tokens": 32, "output_tokens": 30}}
    )
    assert reader.usage == Usage(input_tokens=50, output_tokens=30, cached_input_tokens=32)


def test_anthropic_stream_cut_before_message_delta_is_counted() -> None:
    reader = StreamUsage("anthropic")
    reader.feed({"type": "message_start", "message": {"usage": {"input_tokens": 7, "output_tokens": 1}}})
    reader.feed({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{"}})
    assert reader.usage == Usage(input_tokens=7, output_tokens=1, estimated=True)


def test_responses_stream() -> None:
    reader = StreamUsage("responses")
    reader.feed({"type": "response.created", "response": {"id": "resp_1", "usage": None}})
    reader.feed({"type": "response.output_text.delta", "delta": "a"})
    reader.feed({"type": "response.function_call_arguments.delta", "delta": "{"})
    assert reader.usage == Usage(output_tokens=2, estimated=True)
    reader.feed(
        {
            "type": "response.completed",
            "response": {"id": "resp_1", "usage": {"input_tokens": 40, "output_tokens": 9, "total_tokens": 49}},
        }
    )
    assert reader.usage == Usage(input_tokens=40, output_tokens=9)


def test_feeding_non_objects_is_harmless() -> None:
    for protocol in ("chat", "anthropic", "responses"):
        reader = StreamUsage(protocol)  # type: ignore[arg-type]
        reader.feed(None)
        reader.feed([1, 2])
        assert reader.usage == Usage(output_tokens=0, estimated=True)


# The translators' streams read back -------------------------------------------------------------------------


def upstream() -> list[dict[str, Any]]:
    return [
        chunk({"role": "assistant", "content": "He"}),
        chunk({"content": "llo"}),
        chunk(
            {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        ),
        chunk({}, "tool_calls"),
        chunk(usage=CHAT_USAGE),
    ]


def test_a_translated_anthropic_stream_reads_back_as_the_upstream_usage() -> None:
    stream = ChatToAnthropicStream("m")
    reader = StreamUsage("anthropic")
    for c in upstream():
        for _, data in stream.feed(c):
            reader.feed(data)
    for _, data in stream.finish():
        reader.feed(data)
    expected = from_chat(CHAT_USAGE)
    assert expected is not None
    # The stream's usage counts the whole prompt as input tokens, as its message_start did (the
    # cache's part became known after it): the prompt's total is the upstream's, its split not.
    assert (reader.usage.input_tokens, reader.usage.output_tokens, reader.usage.cached_input_tokens) == (
        expected.input_tokens,
        expected.output_tokens,
        0,
    )
    assert stream.usage == expected
    assert reader.counted == stream.tokens_counted == 3


def test_a_translated_responses_stream_reads_back_as_the_upstream_usage() -> None:
    stream = ChatToResponsesStream({"model": "m", "input": "x"}, "resp_1", 1)
    reader = StreamUsage("responses")
    for c in upstream():
        for _, data in stream.feed(c):
            reader.feed(data)
    for _, data in stream.finish():
        reader.feed(data)
    assert reader.usage == from_chat(CHAT_USAGE)
    assert stream.tokens_counted == 3


def test_the_package_imports_nothing_but_the_standard_library() -> None:
    """It runs on the gateway's hot path and in processes without Django set up."""
    code = (
        "import sys; before = set(sys.modules); import apps.gateway.translate; "
        "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
        "third = {m for m in new if m != 'apps' and m not in sys.stdlib_module_names}; "
        "sys.exit(f'imported {sorted(third)}' if third else 0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=True)
