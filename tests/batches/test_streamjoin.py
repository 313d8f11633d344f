"""A streamed answer joined back (apps.batches.streamjoin): the real llama-server's stream joins into
the answer it gives unstreamed, pieces of content, reasoning, tool calls and log probabilities come
together by choice and index, and a stream that failed or broke off is never taken for an answer."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from apps.batches.streamjoin import join
from tests.enginebin import llama_server_path, missing_reason


def sse(*events: Any, done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(index: int = 0, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "m",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
    }


USAGE = {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


def test_content_and_reasoning_pieces_and_usage_join_into_a_chat_completion() -> None:
    raw = sse(
        chunk(role="assistant", content="", reasoning_content="think "),
        chunk(reasoning_content="hard"),
        chunk(content="Hel"),
        chunk(content="lo"),
        chunk(finish="stop"),
        USAGE,
    )
    joined, why = join("/v1/chat/completions", raw)
    assert why is None and joined is not None
    answer = json.loads(joined)
    assert answer["object"] == "chat.completion" and (answer["id"], answer["model"], answer["created"]) == (
        "chatcmpl-1",
        "m",
        7,
    )
    [choice] = answer["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello", "reasoning_content": "think hard"}
    assert choice["finish_reason"] == "stop" and answer["usage"]["total_tokens"] == 8


def test_tool_calls_in_pieces_two_choices_and_log_probabilities() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"ci'}}
    raw = sse(
        chunk(0, tool_calls=[call]),
        chunk(1, content="other"),
        chunk(0, tool_calls=[{"index": 0, "function": {"arguments": 'ty": "Ankara"}'}}]),
        {**chunk(1, finish="stop"), "choices": [{"index": 1, "delta": {}, "finish_reason": "stop",
                                                   "logprobs": {"content": [{"token": "other", "logprob": -0.5}]}}]},
        chunk(0, finish="tool_calls"),
    )  # fmt: skip
    joined, why = join("/v1/chat/completions", raw)
    assert why is None and joined is not None
    first, second = json.loads(joined)["choices"]
    assert first["message"]["content"] is None and first["finish_reason"] == "tool_calls"
    assert first["message"]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": '{"city": "Ankara"}'}}
    ]
    assert second["message"]["content"] == "other" and second["logprobs"] == {
        "content": [{"token": "other", "logprob": -0.5}]
    }


def test_a_text_completion_stream_joins_into_a_text_completion() -> None:
    pieces = [{"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
               "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
              for text, finish in (("Once ", None), ("upon", None), ("", "length"))]  # fmt: skip
    joined, why = join("/v1/completions", sse(*pieces))
    assert why is None and joined is not None
    answer = json.loads(joined)
    assert answer["object"] == "text_completion"
    assert answer["choices"] == [{"index": 0, "text": "Once upon", "logprobs": None, "finish_reason": "length"}]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (sse(chunk(content="Hel"), done=False), "before the answer was complete"),
        (sse(chunk(content="Hel")), "before the answer was complete"),  # [DONE] but no finish reason
        (sse(chunk(content="Hel"), {"error": {"message": "the replica went away"}}), "the replica went away"),
        (b"data: {not json\n\ndata: [DONE]\n\n", "not JSON"),
        (b"", "before the answer was complete"),
    ],
)
def test_a_stream_that_failed_or_broke_off_is_no_answer(raw: bytes, reason: str) -> None:
    joined, why = join("/v1/chat/completions", raw)
    assert joined is None and why is not None and reason in why


@pytest.mark.skipif(llama_server_path() is None, reason=missing_reason())
def test_the_real_llama_servers_stream_joins_into_its_unstreamed_answer(tmp_path: Path) -> None:
    from tests.e2e.helpers import free_port
    from tests.ggufgen import make_tiny_gguf

    weights = make_tiny_gguf(tmp_path / "tiny.gguf")
    port = free_port()
    engine = subprocess.Popen(
        [str(llama_server_path()), "-m", str(weights), "--port", str(port), "--threads", "1", "--no-webui"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def post(body: dict[str, Any]) -> bytes:
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:  # noqa: S310 - our own loopback engine
            return response.read()

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:  # noqa: S310
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 12, "temperature": 0, "seed": 3}
        whole = json.loads(post(body))
        joined, why = join(
            "/v1/chat/completions", post({**body, "stream": True, "stream_options": {"include_usage": True}})
        )
    finally:
        engine.terminate()
        engine.wait(timeout=30)
    assert why is None and joined is not None
    answer = json.loads(joined)
    assert answer["choices"][0]["message"]["content"] == whole["choices"][0]["message"]["content"]
    assert answer["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert answer["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
