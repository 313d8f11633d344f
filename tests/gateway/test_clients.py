"""What real clients met at the gateway, each called as its SDK's docs call it, against the mock engine.

The official OpenAI and Anthropic SDKs (and raw HTTP where no SDK sends what is tested): structured
outputs, embeddings of a model that cannot give them, error codes and request ids the SDKs read,
Anthropic usage that agrees with itself, refusals where the gateway used to rewrite the request,
and request bodies sent gzip'd.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from pydantic import BaseModel

from tests.gateway.harness import HELLO, KEY, Gateway, anthropic, openai
from tests.gateway.mock_engine import MockEngine

MESSAGES = [{"role": "user", "content": "Name a city"}]


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    """The mock engine with llama.cpp's tokenizer calls, so an Anthropic stream opens with the count."""
    mock = await MockEngine(tokenizer=True).start()
    yield mock
    await mock.stop()


def retrying_openai(gw: Gateway) -> Any:
    """The OpenAI client as its docs make it: with its default retries (two)."""
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY)


# Anthropic structured outputs ---------------------------------------------------------------------


class City(BaseModel):
    name: str
    population: int


async def test_anthropic_structured_output_asks_the_engine_for_the_schema(gw: Gateway, engine: MockEngine) -> None:
    engine.pieces = ['{"name": "Paris", "population": 2100000}']
    message = await gw.anthropic().messages.parse(model="m", max_tokens=100, messages=MESSAGES, output_format=City)
    assert message.parsed_output == City(name="Paris", population=2100000)
    asked = engine.seen[0].body["response_format"]
    assert asked["type"] == "json_schema" and asked["json_schema"]["strict"] is True
    assert set(asked["json_schema"]["schema"]["properties"]) == {"name", "population"}


async def test_anthropic_output_config_format_with_a_schema_reaches_the_engine(gw: Gateway, engine: MockEngine) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    await gw.anthropic().messages.create(
        model="m",
        max_tokens=50,
        messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert engine.seen[0].body["response_format"]["json_schema"]["schema"] == schema


async def test_the_beta_output_format_is_translated_too(gw: Gateway, engine: MockEngine) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    await gw.anthropic().beta.messages.create(
        model="m",
        max_tokens=50,
        messages=MESSAGES,
        betas=["structured-outputs-2025-11-13"],
        extra_body={"output_format": {"type": "json_schema", "schema": schema}},
    )
    assert engine.seen[0].body["response_format"]["json_schema"]["schema"] == schema


async def test_an_output_format_that_is_not_a_json_schema_is_a_400(gw: Gateway, engine: MockEngine) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await gw.anthropic().messages.create(
            model="m", max_tokens=50, messages=MESSAGES, output_config={"format": {"type": "yaml"}}
        )
    assert "output_config.format.type" in caught.value.message
    assert engine.seen == []


# Embeddings -------------------------------------------------------------------------------------------


async def test_embeddings_of_a_model_that_cannot_give_them_is_a_400_tried_once(gw: Gateway, engine: MockEngine) -> None:
    engine.embeddings = False
    with pytest.raises(openai.BadRequestError) as caught:
        await retrying_openai(gw).embeddings.create(model="m", input="hello")
    assert caught.value.status_code == 400
    assert "cannot answer /v1/embeddings" in caught.value.message
    assert "does not support embeddings" in caught.value.message  # the engine's own reason
    assert caught.value.code == "unsupported_endpoint"
    assert len(engine.seen) == 1  # a client error: the SDK does not try again
    assert (await gw.usage.wait())["status"] == 400


async def test_embeddings_dimensions_the_model_cannot_give_is_a_400_naming_both(
    gw: Gateway, engine: MockEngine
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().embeddings.create(model="m", input="hello", dimensions=8)
    assert caught.value.param == "dimensions"
    assert "64 dimensions" in caught.value.message and "cannot give 8" in caught.value.message
    # The SDK asks for base64 vectors by default: their size is read from the encoding.
    assert engine.seen[0].body.get("encoding_format") == "base64"


async def test_embeddings_dimensions_the_model_gives_is_answered(gw: Gateway) -> None:
    answer = await gw.openai().embeddings.create(model="m", input=["a", "b"], dimensions=64)
    assert [len(item.embedding) for item in answer.data] == [64, 64]


async def test_embeddings_dimensions_that_is_not_a_positive_integer_is_a_400(gw: Gateway, engine: MockEngine) -> None:
    answer = await gw.post("/v1/embeddings", {"model": "m", "input": "x", "dimensions": 0})
    assert answer.status == 400
    assert answer.json["error"]["param"] == "dimensions"
    assert engine.seen == []


# Error codes and request ids --------------------------------------------------------------------------


async def test_an_engine_error_with_a_numeric_code_has_no_code(gw: Gateway, engine: MockEngine) -> None:
    engine.mode, engine.error_status, engine.error_code = "error", 400, 400
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=HELLO)
    assert caught.value.code is None  # not "400": the status is not a code


async def test_an_engine_error_with_a_string_code_keeps_it(gw: Gateway, engine: MockEngine) -> None:
    engine.mode, engine.error_status, engine.error_code = "error", 400, "invalid_value"
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=HELLO)
    assert caught.value.code == "invalid_value"


def overflow(engine: MockEngine) -> None:
    """llama.cpp's answer to a prompt over its context, word for word."""
    engine.mode, engine.error_status, engine.error_code = "error", 400, 400
    engine.error_type = "exceed_context_size_error"
    engine.error_message = "request (2022 tokens) exceeds the available context size (256 tokens), try increasing it"


async def test_a_context_overflow_names_the_prompts_field(gw: Gateway, engine: MockEngine) -> None:
    overflow(engine)
    with pytest.raises(openai.BadRequestError) as chat:
        await gw.openai().chat.completions.create(model="m", messages=HELLO)
    assert (chat.value.code, chat.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as responses:
        await gw.openai().responses.create(model="m", input="hello")
    assert (responses.value.code, responses.value.param) == ("context_length_exceeded", "input")
    with pytest.raises(openai.BadRequestError) as completions:
        await gw.openai().completions.create(model="m", prompt="hello")
    assert (completions.value.code, completions.value.param) == ("context_length_exceeded", "prompt")


async def test_an_unknown_messages_path_is_anthropics_not_found_error(gw: Gateway) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        await gw.anthropic().post("/v1/messages/nothing", cast_to=object, body={"model": "m"})
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert caught.value.request_id is not None
    assert caught.value.body["request_id"] == caught.value.request_id


async def test_answers_carry_the_request_id_each_sdk_reads(gw: Gateway) -> None:
    completion = await gw.openai().chat.completions.create(model="m", messages=HELLO)
    assert completion._request_id is not None and completion._request_id.startswith("req_")
    message = await gw.anthropic().messages.create(model="m", max_tokens=5, messages=HELLO)
    assert message._request_id is not None and message._request_id.startswith("req_")
    assert completion._request_id != message._request_id
    with pytest.raises(anthropic.AuthenticationError) as caught:
        await gw.anthropic("llmgw_wrong").messages.create(model="m", max_tokens=5, messages=HELLO)
    assert caught.value.request_id is not None
    assert caught.value.body["request_id"] == caught.value.request_id
    with pytest.raises(openai.AuthenticationError) as refused:
        await gw.openai("llmgw_wrong").chat.completions.create(model="m", messages=HELLO)
    assert refused.value.request_id is not None and refused.value.request_id.startswith("req_")


# Anthropic usage ----------------------------------------------------------------------------------------


async def test_anthropic_stream_usage_splits_the_prompt_the_same_way_in_both_events(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.prompt_tokens, engine.cached_tokens = 30, 24
    starts: list[Any] = []
    deltas: list[Any] = []
    async with gw.anthropic().messages.stream(model="m", max_tokens=20, messages=HELLO) as stream:
        async for event in stream:
            if event.type == "message_start":
                starts.append(event.message.usage)
            elif event.type == "message_delta":
                deltas.append(event.usage)
        final = await stream.get_final_message()
    (start,), (delta,) = starts, deltas
    parts = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    assert [getattr(start, p) for p in parts] == [getattr(delta, p) for p in parts] == [30, 0, 0]
    assert final.usage.input_tokens == 30 and final.usage.cache_creation_input_tokens == 0


async def test_a_whole_anthropic_message_reports_cache_reads_apart_with_cache_creation_present(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.prompt_tokens, engine.cached_tokens = 30, 24
    message = await gw.anthropic().messages.create(model="m", max_tokens=20, messages=HELLO)
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (6, 24, 0)


# Refusals instead of rewriting ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [2.5, -0.5])
async def test_an_openai_temperature_out_of_range_is_a_400(gw: Gateway, engine: MockEngine, temperature: float) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=HELLO, temperature=temperature)
    assert caught.value.param == "temperature"
    assert str(temperature) in caught.value.message
    with pytest.raises(openai.BadRequestError):
        await gw.openai().responses.create(model="m", input="hi", temperature=temperature)
    assert engine.seen == []


async def test_an_anthropic_temperature_over_one_is_a_400(gw: Gateway, engine: MockEngine) -> None:
    # This SDK's messages.create has no `temperature` argument; the API takes the field in the body.
    with pytest.raises(anthropic.BadRequestError) as caught:
        await gw.anthropic().messages.create(model="m", max_tokens=5, messages=HELLO, extra_body={"temperature": 1.5})
    assert "<= 1" in caught.value.message and "1.5" in caught.value.message
    assert engine.seen == []
    await gw.anthropic().messages.create(model="m", max_tokens=5, messages=HELLO, extra_body={"temperature": 1})
    assert engine.seen[0].body["temperature"] == 1


async def test_a_thinking_budget_not_below_max_tokens_is_a_400(gw: Gateway, engine: MockEngine) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await gw.anthropic().messages.create(
            model="m",
            max_tokens=1024,
            messages=HELLO,
            thinking={"type": "enabled", "budget_tokens": 1024},
        )
    assert "max_tokens (1024) must be greater than thinking.budget_tokens (1024)" in caught.value.message
    assert engine.seen == []


async def test_anthropic_top_k_reaches_the_engine(gw: Gateway, engine: MockEngine) -> None:
    await gw.anthropic().messages.create(model="m", max_tokens=5, messages=HELLO, extra_body={"top_k": 5})
    assert engine.seen[0].body["top_k"] == 5


async def test_responses_logprobs_come_back_as_chat_gives_them(gw: Gateway, engine: MockEngine) -> None:
    engine.pieces = ["Hi", "!"]
    response = await gw.openai().responses.create(
        model="m", input="hello", include=["message.output_text.logprobs"], top_logprobs=2
    )
    assert (engine.seen[0].body["logprobs"], engine.seen[0].body["top_logprobs"]) == (True, 2)
    text = response.output[0].content[0]
    assert [p.token for p in text.logprobs] == ["H", "i", "!"]
    assert [len(p.top_logprobs) for p in text.logprobs] == [2, 2, 2]
    stream = await gw.openai().responses.create(
        model="m", input="hello", include=["message.output_text.logprobs"], top_logprobs=1, stream=True
    )
    deltas = [event async for event in stream if event.type == "response.output_text.delta"]
    assert [[p.token for p in d.logprobs] for d in deltas] == [["Hi"], ["!"]]
    assert deltas[0].logprobs[0].top_logprobs[0].token == "alt0"


# Compressed bodies -----------------------------------------------------------------------------------------


async def test_a_gzipped_body_is_read(gw: Gateway, engine: MockEngine) -> None:
    body = gzip.compress(json.dumps({"model": "m", "messages": HELLO}).encode())
    answer = await gw.post(
        "/v1/chat/completions", data=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
    )
    assert answer.status == 200
    assert engine.seen[0].body["messages"] == HELLO


async def test_a_gzipped_body_that_inflates_past_the_limit_is_a_413(gw: Gateway, engine: MockEngine) -> None:
    gw.app.max_body = 1_000_000
    bomb = gzip.compress(b'{"model": "m", "pad": "' + b" " * 50_000_000 + b'"}')
    assert len(bomb) < gw.app.max_body
    answer = await gw.post("/v1/chat/completions", data=bomb, headers={"Content-Encoding": "gzip"})
    assert answer.status == 413
    assert "inflates to more than the limit of 1000000 bytes" in answer.json["error"]["message"]
    assert engine.seen == []


async def test_a_body_in_an_encoding_not_taken_is_a_415_naming_it(gw: Gateway, engine: MockEngine) -> None:
    answer = await gw.post("/v1/chat/completions", data=b"\x1b\x00", headers={"Content-Encoding": "br"})
    assert answer.status == 415
    assert "“br” is not supported" in answer.json["error"]["message"]
    corrupt = await gw.post("/v1/chat/completions", data=b"not gzip", headers={"Content-Encoding": "gzip"})
    assert corrupt.status == 400
    assert "not valid JSON" not in corrupt.json["error"]["message"]
    assert "gzip" in corrupt.json["error"]["message"]
    assert engine.seen == []
