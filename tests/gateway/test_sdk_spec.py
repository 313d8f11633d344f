"""The gateway's API as the official OpenAI and Anthropic SDKs see it, called the way their own
docs call them, against `llmgw up` serving the real tiny llama.cpp engine.

Three models are declared: `tiny` (served on this machine's CPU), `alias` (kept at zero replicas,
falling back to `tiny`, with a profile no node can take) and `toobig` (one replica wanted, with a
profile no node can take).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import struct
import time
import urllib.error
import urllib.request
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.fleet import ControlPlane

if TYPE_CHECKING:
    from anthropic import Anthropic
    from openai import OpenAI

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.e2e

# Generous bounds for what the processes do on their own (never a measure of speed).
KEY_WAIT_S = 30.0
RECONCILE_WAIT_S = 120.0
# What a request may take at most here: the gateway may wait for a cold start of a model kept at zero.
CLIENT_TIMEOUT_S = 240.0
NEVER_FITS = [{"name": "cpu", "engine": "llama.cpp", "accelerator": "cpu", "memory": "100TB"}]
# Far over the tiny model's 512-token context, whatever its tokenizer makes of it.
LONG_TEXT = "the sea is a story of the llm gw and the sea. " * 200
# Greedy decoding, so the tiny model answers one prompt the same way each time. This SDK's
# messages.create has no `temperature` argument; the API takes the field, so it goes in the body.
GREEDY = {"temperature": 0}


def _llama() -> str | None:
    from tests.enginebin import llama_server_path

    path = llama_server_path()
    return str(path) if path else None


def _served(plane: ControlPlane) -> bool:
    request = urllib.request.Request(plane.url + "/v1/models", headers={"Authorization": f"Bearer {plane.key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            data = json.load(response)["data"]
    except urllib.error.HTTPError:
        return False  # the key has not reached the gateway's table yet
    return any(m["id"] == "tiny" and m["llmgw"]["ready_replicas"] for m in data)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if _llama() is None:
        from tests.enginebin import missing_reason

        pytest.skip(missing_reason())
    from tests.ggufgen import make_tiny_gguf

    tmp = tmp_path_factory.mktemp("gateway-spec")
    weights = make_tiny_gguf(tmp / "tiny.gguf")
    spec = tmp / "models.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "tiny",
                        "source": str(weights),
                        "replicas": 1,
                        "profiles": [
                            {
                                "name": "cpu",
                                "engine": "llama.cpp",
                                "accelerator": "cpu",
                                "memory": "1GB",
                                "cpu_cores": 1,
                                "parallel": 2,
                                "context_size": 512,
                            }
                        ],
                    },
                    {
                        "name": "alias",
                        "replicas": 0,
                        "fallbacks": ["tiny"],
                        "source": str(weights),
                        "profiles": NEVER_FITS,
                    },
                    {"name": "toobig", "replicas": 1, "source": str(weights), "profiles": NEVER_FITS},
                ]
            }
        )
    )
    engine: int | None = None
    with ControlPlane(
        tmp, extra_env={"LLMGW_LLAMA_SERVER": _llama() or "", "LLMGW_GATEWAY_COLD_START_TIMEOUT": "120"}
    ) as running:
        code, out, err = running.ctl("model", "apply", "-f", str(spec))
        assert code == 0, out + err
        running.wait_for(lambda: _served(running), timeout=120, what="tiny served by the gateway")
        try:
            yield running
        finally:
            with contextlib.suppress(Exception):
                engine = running.api("GET", "models/tiny")["replicas"][0]["shards"][0]["pid"]
    if engine:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine, signal.SIGKILL)


# Clients, as the SDKs' READMEs make them -------------------------------------------------------------


def oai(plane: ControlPlane, key: str | None = None) -> OpenAI:
    return openai.OpenAI(base_url=plane.url + "/v1", api_key=key or plane.key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


def claude(plane: ControlPlane, key: str | None = None) -> Anthropic:
    return anthropic.Anthropic(base_url=plane.url, api_key=key or plane.key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


def new_key(plane: ControlPlane, allowed_models: list[str]) -> str:
    """A new API key that may use only `allowed_models`, once the gateway knows it."""
    created = plane.api("POST", "keys/", {"name": f"spec-{uuid.uuid4().hex[:8]}", "allowed_models": allowed_models})
    key: str = created["key"]
    client = oai(plane, key)
    deadline = time.monotonic() + KEY_WAIT_S
    while True:
        try:
            client.models.list()
            return key
        except openai.AuthenticationError:
            if time.monotonic() > deadline:
                pytest.fail(f"the new key did not reach the gateway's tables within {KEY_WAIT_S:g} s")
            time.sleep(0.2)


def raw_post(plane: ControlPlane, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a JSON body with plain urllib: the status and the JSON answer."""
    request = urllib.request.Request(
        plane.url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {plane.key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT_S) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}")


def prompt_total(usage: Any) -> int:
    """The whole prompt of an Anthropic usage: input_tokens leaves out cache reads and writes."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0))


def one_pixel_png() -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 6, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00\xff"))
        + chunk(b"IEND", b"")
    )
    return base64.b64encode(png).decode()


def _text(message: Any) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# 1. models.retrieve ---------------------------------------------------------------------------------


def test_models_retrieve_returns_a_model_the_key_may_use(plane: ControlPlane) -> None:
    model = oai(plane).models.retrieve("tiny")
    assert model.id == "tiny"
    assert model.object == "model"


def test_models_retrieve_of_a_model_that_does_not_exist_is_not_found(plane: ControlPlane) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        oai(plane).models.retrieve("no-such-model")
    assert "no-such-model" in str(refused.value)


def test_models_retrieve_of_a_model_the_key_may_not_use_is_not_found(plane: ControlPlane) -> None:
    client = oai(plane, new_key(plane, ["alias"]))
    assert client.models.retrieve("alias").id == "alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tiny")


# 2. messages.count_tokens ------------------------------------------------------------------------------


def test_count_tokens_is_the_prompt_count_the_engine_reports_for_the_same_request(plane: ControlPlane) -> None:
    client = claude(plane)
    messages: list[Any] = [{"role": "user", "content": f"Count these words, please ({uuid.uuid4().hex[:6]})"}]
    system = "You count tokens."
    counted = client.messages.count_tokens(model="tiny", messages=messages, system=system)
    assert counted.input_tokens > 0
    message = client.messages.create(model="tiny", max_tokens=3, messages=messages, system=system)
    # The engine reuses a cached prompt prefix; Anthropic's usage reports that part apart.
    assert prompt_total(message.usage) == counted.input_tokens
    if not message.usage.cache_read_input_tokens:
        assert message.usage.input_tokens == counted.input_tokens


def test_count_tokens_with_a_bad_key_is_unauthorized_even_for_a_model_that_does_not_exist(plane: ControlPlane) -> None:
    client = claude(plane, key="llmgw_wrong")
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client.messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert refused.value.status_code == 401
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "x"}])


def test_count_tokens_for_a_model_that_does_not_exist_is_not_found(plane: ControlPlane) -> None:
    with pytest.raises(anthropic.NotFoundError) as refused:
        claude(plane).messages.count_tokens(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert "no-such-model" in str(refused.value)


# 3. An Anthropic stream's message_start ------------------------------------------------------------------


def test_an_anthropic_stream_opens_with_the_real_prompt_count(plane: ControlPlane) -> None:
    client = claude(plane)
    messages: list[Any] = [{"role": "user", "content": f"Stream me something ({uuid.uuid4().hex[:6]})"}]
    system = "You stream."
    counted = client.messages.count_tokens(model="tiny", messages=messages, system=system).input_tokens
    opened: list[int] = []
    with client.messages.stream(model="tiny", max_tokens=6, messages=messages, system=system) as stream:
        for event in stream:
            if event.type == "message_start":
                opened.append(event.message.usage.input_tokens)
        final = stream.get_final_message()
    assert len(opened) == 1
    assert opened[0] > 0
    assert opened[0] == counted
    assert prompt_total(final.usage) == opened[0]
    if not final.usage.cache_read_input_tokens:
        assert final.usage.input_tokens == opened[0]


# 4. stop_sequences ---------------------------------------------------------------------------------------


def _stop_case(client: Anthropic) -> tuple[list[Any], str, str]:
    """A prompt, the tiny model's answer to it at temperature 0, and a 2-3 character piece of that
    answer, from its middle, that first occurs there."""
    seen: list[str] = []
    for prompt in (
        "Tell me a story about the sea",
        "Write a poem about the rain",
        "Describe a long road home",
        "Name the colours of the sky",
    ):
        messages: list[Any] = [{"role": "user", "content": prompt}]
        text = _text(client.messages.create(model="tiny", max_tokens=30, extra_body=GREEDY, messages=messages))
        seen.append(text)
        for start in range(max(1, len(text) // 3), len(text) - 2):
            for size in (3, 2):
                piece = text[start : start + size]
                if (
                    len(piece) == size
                    and piece.isprintable()
                    and not any(c.isspace() for c in piece)
                    and text.find(piece) == start
                ):
                    return messages, text, piece
    pytest.fail(f"no answer of the tiny model held a piece to stop at: {seen!r}")


def test_a_matched_stop_sequence_ends_the_answer_before_it_and_is_named(plane: ControlPlane) -> None:
    client = claude(plane)
    messages, text, piece = _stop_case(client)
    again = client.messages.create(model="tiny", max_tokens=30, extra_body=GREEDY, messages=messages)
    assert _text(again) == text, "the tiny model is not deterministic with temperature 0"
    stopped = client.messages.create(
        model="tiny", max_tokens=30, extra_body=GREEDY, messages=messages, stop_sequences=[piece, "zzzz-never"]
    )
    assert stopped.stop_reason == "stop_sequence", (text, piece, stopped)
    assert stopped.stop_sequence == piece
    assert _text(stopped) == text[: text.find(piece)]


def test_a_matched_stop_sequence_is_named_in_a_stream(plane: ControlPlane) -> None:
    client = claude(plane)
    messages, text, piece = _stop_case(client)
    deltas: list[Any] = []
    with client.messages.stream(
        model="tiny", max_tokens=30, extra_body=GREEDY, messages=messages, stop_sequences=[piece, "zzzz-never"]
    ) as stream:
        for event in stream:
            if event.type == "message_delta":
                deltas.append(event.delta)
        final = stream.get_final_message()
    assert len(deltas) == 1
    assert deltas[0].stop_reason == "stop_sequence", (text, piece, deltas)
    assert deltas[0].stop_sequence == piece
    assert final.stop_reason == "stop_sequence"
    assert final.stop_sequence == piece
    assert _text(final) == text[: text.find(piece)]


def test_an_answer_that_matches_no_stop_sequence_names_none(plane: ControlPlane) -> None:
    client = claude(plane)
    messages: list[Any] = [{"role": "user", "content": "Tell me a story about the sea"}]
    message = client.messages.create(
        model="tiny", max_tokens=12, extra_body=GREEDY, messages=messages, stop_sequences=["zzzz-never"]
    )
    assert message.stop_reason in {"end_turn", "max_tokens"}
    assert message.stop_sequence is None
    deltas: list[Any] = []
    with client.messages.stream(
        model="tiny", max_tokens=12, extra_body=GREEDY, messages=messages, stop_sequences=["zzzz-never"]
    ) as stream:
        for event in stream:
            if event.type == "message_delta":
                deltas.append(event.delta)
        final = stream.get_final_message()
    assert [d.stop_reason in {"end_turn", "max_tokens"} for d in deltas] == [True]
    assert deltas[0].stop_sequence is None
    assert final.stop_reason in {"end_turn", "max_tokens"}
    assert final.stop_sequence is None


# 5. The OpenAI quickstart's streaming loops ---------------------------------------------------------------


def test_the_quickstart_chat_stream_loop_meets_no_chunk_without_choices(plane: ControlPlane) -> None:
    stream = oai(plane).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Say this is a test"}],
        max_tokens=8,
        temperature=0,
        stream=True,
    )
    pieces: list[str] = []
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")  # the quickstart's loop
        assert chunk.usage is None
    assert "".join(pieces)


def test_a_chat_stream_that_asks_for_usage_ends_with_one_usage_chunk(plane: ControlPlane) -> None:
    chunks = list(
        oai(plane).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say this is a test"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) >= 2
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens > 0
    assert 1 <= last.usage.completion_tokens <= 8
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert all(c.choices for c in chunks[:-1])


def test_the_legacy_completions_stream_loop_meets_no_chunk_without_choices(plane: ControlPlane) -> None:
    stream = oai(plane).completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
    )
    pieces: list[str] = []
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        assert chunk.usage is None
    assert "".join(pieces)


def test_a_legacy_completions_stream_that_asks_for_usage_ends_with_one_usage_chunk(plane: ControlPlane) -> None:
    chunks = list(
        oai(plane).completions.create(
            model="tiny",
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) >= 2
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens > 0
    assert 1 <= last.usage.completion_tokens <= 8
    assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert all(c.choices for c in chunks[:-1])


# 6. Responses ----------------------------------------------------------------------------------------------


def test_responses_refuses_an_input_item_of_an_unknown_type_naming_it(plane: ControlPlane) -> None:
    items: list[Any] = [{"type": "bogus_item", "text": "x"}]
    with pytest.raises(openai.BadRequestError) as refused:
        oai(plane).responses.create(model="tiny", input=items, max_output_tokens=4)
    assert "bogus_item" in refused.value.message


def test_responses_serves_a_request_with_a_web_search_tool_ignoring_the_tool(plane: ControlPlane) -> None:
    response = oai(plane).responses.create(
        model="tiny", input="What is new today?", tools=[{"type": "web_search"}], temperature=0, max_output_tokens=4
    )
    assert response.object == "response"
    assert response.status in {"completed", "incomplete"}
    assert response.usage is not None and response.usage.output_tokens > 0


def test_responses_accepts_a_namespace_tool(plane: ControlPlane) -> None:
    tools: list[Any] = [
        {
            "type": "namespace",
            "name": "ns",
            "description": "Tools of one kind",
            "tools": [
                {
                    "type": "function",
                    "name": "f",
                    "description": "Do f",
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                }
            ],
        }
    ]
    response = oai(plane).responses.create(
        model="tiny", input="Use f if you need it", tools=tools, temperature=0, max_output_tokens=4
    )
    assert response.object == "response"
    assert response.status in {"completed", "incomplete"}
    assert response.usage is not None and response.usage.output_tokens > 0


def test_a_stored_response_is_fetched_listed_continued_and_deleted(plane: ControlPlane) -> None:
    client = oai(plane)
    first = client.responses.create(model="tiny", input="Hello", temperature=0, max_output_tokens=4)
    assert first.store is True  # the reference's default
    fetched = client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]
    second = client.responses.create(
        model="tiny", input="Again", previous_response_id=first.id, temperature=0, max_output_tokens=4
    )
    assert second.previous_response_id == first.id
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens  # the replay
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unkept = client.responses.create(model="tiny", input="Hello", store=False, max_output_tokens=4)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


# 7. Prompts the engine cannot take ---------------------------------------------------------------------------


def test_a_chat_prompt_over_the_context_is_a_400_context_length_exceeded(plane: ControlPlane) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        oai(plane).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG_TEXT}], max_tokens=4
        )
    assert refused.value.status_code == 400
    assert refused.value.code == "context_length_exceeded"


def test_an_anthropic_prompt_over_the_context_is_an_invalid_request_error(plane: ControlPlane) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude(plane).messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": LONG_TEXT}])
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"


def test_an_image_to_a_text_only_model_is_a_400_saying_why(plane: ControlPlane) -> None:
    content: list[Any] = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{one_pixel_png()}"}},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        oai(plane).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=4)
    assert refused.value.status_code == 400
    message = refused.value.message.lower()
    assert "image" in message and "support" in message, message


# 8. A path the gateway does not serve -------------------------------------------------------------------------


def test_an_unknown_v1_path_is_a_404_invalid_request_error(plane: ControlPlane) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        oai(plane).post("/nothing", cast_to=object, body={"model": "tiny"})
    assert refused.value.status_code == 404
    assert refused.value.type == "invalid_request_error"
    status, answer = raw_post(plane, "/v1/nothing", {"model": "tiny"})
    assert status == 404
    assert answer["error"]["type"] == "invalid_request_error"


# 9. A model no node can take ---------------------------------------------------------------------------------


def _refused_replica(plane: ControlPlane, model: str) -> dict[str, Any] | None:
    replicas = plane.api("GET", f"models/{model}")["replicas"]
    return next((r for r in replicas if r["state"] == "pending" and r["rejections"]), None)


def test_a_model_that_fits_nowhere_is_refused_with_placements_reason(plane: ControlPlane) -> None:
    wait_until(lambda: _refused_replica(plane, "toobig"), RECONCILE_WAIT_S, "placement's refusal of toobig")
    with pytest.raises(openai.APIStatusError) as refused:
        oai(plane).chat.completions.create(model="toobig", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    message = refused.value.message
    assert refused.value.status_code == 503, message
    assert "no node can take it" in message
    assert "memory" in message and re.search(r"needs \d", message), message
    assert "stayed busy" not in message and "has no ready replica" not in message


# 10. A model at zero replicas, and its fallback ------------------------------------------------------------------


def _asked_for(plane: ControlPlane, model: str) -> dict[str, Any] | None:
    detail: dict[str, Any] = plane.api("GET", f"models/{model}")
    return detail if detail["replicas"] or detail["status"]["wanted"] >= 1 else None


def test_a_model_at_zero_replicas_is_served_by_its_fallback_and_asks_for_a_replica(plane: ControlPlane) -> None:
    raw = oai(plane).chat.completions.with_raw_response.create(
        model="alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    completion = raw.parse()
    assert raw.headers["x-llmgw-replica"].startswith("tiny/")
    assert completion.choices
    wait_until(lambda: _asked_for(plane, "alias"), RECONCILE_WAIT_S, "a replica of alias asked for")


def test_a_key_allowed_only_the_model_is_not_served_by_its_fallback(plane: ControlPlane) -> None:
    client = oai(plane, new_key(plane, ["alias"]))
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="alias", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    except openai.APIStatusError as exc:
        message = exc.message
        assert exc.status_code == 503, message
        assert "alias" in message and "no node can take it" in message, message
    else:
        pytest.fail(
            f"served {raw.http_response.status_code} by {raw.headers.get('x-llmgw-replica')}, "
            "a model the key may not use"
        )
