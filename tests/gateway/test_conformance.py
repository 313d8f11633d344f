"""The gateway's answers field by field against the APIs' published references.

The references are the types of the official `openai` and `anthropic` SDKs, which their makers
generate from the providers' OpenAPI documents: every field the gateway sends must be one the
reference names, with a value of its type (an enum's value among the enum's), and every field the
reference requires must be there. Checked here for error bodies (OpenAI's four fields, always all
present; Anthropic's error type matching the status, and its request_id), the request-id headers
each SDK reads, whole answers, and every event of each API's stream, against the mock engine.
Runs with the gateway's other tests, so on every change.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import AsyncIterator
from typing import Any

import pydantic
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from openai.types import CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from openai.types.shared import ErrorObject

from tests.gateway.harness import HELLO, KEY, Gateway, gateway_fixture
from tests.gateway.mock_engine import MockEngine

pytestmark = pytest.mark.django_db(transaction=True)

#: OpenAI's error object: all four fields, param and code null when they do not apply.
OPENAI_ERROR_FIELDS = {"message", "type", "param", "code"}
#: Anthropic's error type for each status, as its API reference lists them.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
#: Fields the providers' own answers carry that the SDKs' types do not declare, by type: a Response
#: says whether it was stored (`store`), as OpenAI's API reference shows it and the SDKs read it.
UNDECLARED = {"Response": {"store"}}


def problems(value: Any, annotation: Any, path: str = "$") -> list[str]:
    """Where `value` (parsed JSON) departs from the reference type `annotation`, one line each."""
    origin = typing.get_origin(annotation)
    if annotation is Any or annotation is object:
        return []
    if origin is typing.Annotated:
        return problems(value, typing.get_args(annotation)[0], path)
    if isinstance(annotation, typing.TypeAliasType):
        return problems(value, annotation.__value__, path)
    if origin in (typing.Union, types.UnionType):
        tried = [problems(value, arm, path) for arm in typing.get_args(annotation)]
        # The arm whose `type` the value names, as the references discriminate their unions, else the closest.
        return min(tried, key=lambda lines: (any(line.startswith(f"{path}.type: ") for line in lines), len(lines)))
    if origin is typing.Literal:
        allowed = typing.get_args(annotation)
        return [] if value in allowed else [f"{path}: {value!r} is not one of {allowed}"]
    if annotation is type(None):
        return [] if value is None else [f"{path}: expected null, got {value!r}"]
    if origin in (list, typing.List, typing.Sequence):  # noqa: UP006
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        (item,) = typing.get_args(annotation) or (Any,)
        return [line for n, one in enumerate(value) for line in problems(one, item, f"{path}[{n}]")]
    if origin in (dict, typing.Dict, typing.Mapping):  # noqa: UP006
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {value!r}"]
        args = typing.get_args(annotation)
        kind = args[1] if len(args) == 2 else Any
        return [line for k, v in value.items() for line in problems(v, kind, f"{path}.{k}")]
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        if not isinstance(value, dict):
            return [f"{path}: expected a {annotation.__name__} object, got {value!r}"]
        fields = {(info.alias or name): info for name, info in annotation.model_fields.items()}
        known = fields.keys() | UNDECLARED.get(annotation.__name__, set())
        lines = [f"{path}.{key}: not a field of {annotation.__name__}" for key in value if key not in known]
        for key, info in fields.items():
            if key in value:
                lines += problems(value[key], info.annotation, f"{path}.{key}")
            elif info.is_required():
                lines.append(f"{path}.{key}: missing ({annotation.__name__} requires it)")
        return lines
    if annotation is bool:
        return [] if isinstance(value, bool) else [f"{path}: expected a boolean, got {value!r}"]
    if annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected an integer, got {value!r}"]
    if annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if ok else [f"{path}: expected a number, got {value!r}"]
    if annotation is str:
        return [] if isinstance(value, str) else [f"{path}: expected a string, got {value!r}"]
    return []  # a type this check does not read (none of the answers' fields so far)


def events(text: str) -> list[tuple[str | None, Any]]:
    """A server-sent event stream as (event name, parsed data), [DONE] left out."""
    found: list[tuple[str | None, Any]] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if data and data != ["[DONE]"]:
            found.append((name, json.loads("\n".join(data))))
    return found


def conforms(value: Any, annotation: Any) -> None:
    found = problems(value, annotation)
    assert not found, "\n".join(found) + f"\nin {json.dumps(value)[:2000]}"


@pytest.fixture
async def engine() -> AsyncIterator[MockEngine]:
    mock = await MockEngine(tokenizer=True).start()
    yield mock
    await mock.stop()


@pytest.fixture
def owner(transactional_db: Any) -> Any:
    """The key's user and organisation, so that Responses answers are stored."""
    from apps.accounts.models import Organization
    from tests.conftest import make_user
    from tests.gateway.harness import entry

    user = make_user("conformance@example.com")
    org = Organization.objects.create(name="Acme", slug="acme")
    return entry(1, user_id=user.pk, org_id=org.pk, team_id=None, project_id=None)


@pytest.fixture
async def gw(engine: MockEngine, monkeypatch: pytest.MonkeyPatch, owner: Any) -> AsyncIterator[Gateway]:
    async for gateway in gateway_fixture(engine, monkeypatch, store=True, key=owner):
        yield gateway


async def anthropic_post(gw: Gateway, path: str, body: Any, key: str = KEY) -> Any:
    return await gw.post(path, body, key=None, headers={"x-api-key": key, "anthropic-version": "2023-06-01"})


# Errors -------------------------------------------------------------------------------------------------


async def test_openai_error_bodies_and_headers(gw: Gateway, engine: MockEngine) -> None:
    cases = [
        (await gw.chat(key="llmgw_wrong"), 401),
        (await gw.post("/v1/chat/completions", {"model": "nothing", "messages": HELLO}), 404),
        (await gw.chat(temperature=5), 400),
        (await gw.post("/v1/nothing", {}), 404),
        (await gw.post("/v1/responses", {"model": "m", "input": "x", "previous_response_id": "resp_none"}), 400),
        (await gw.get("/v1/responses/resp_none"), 404),
    ]
    engine.embeddings = False
    cases.append((await gw.post("/v1/embeddings", {"model": "m", "input": "x"}), 400))
    for answer, status in cases:
        assert answer.status == status, answer.text
        body = answer.json
        assert set(body) == {"error"}, body
        assert set(body["error"]) == OPENAI_ERROR_FIELDS, body
        conforms(body["error"], ErrorObject)
        assert answer.headers["x-request-id"] == answer.headers["x-llmgw-request-id"]
        assert answer.headers["content-type"].startswith("application/json")


async def test_anthropic_error_bodies_and_headers(gw: Gateway) -> None:
    cases = [
        (await anthropic_post(gw, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO}, "llmgw_no"), 401),
        (await anthropic_post(gw, "/v1/messages", {"model": "nothing", "max_tokens": 5, "messages": HELLO}), 404),
        (
            await anthropic_post(
                gw, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO, "temperature": 2}
            ),
            400,
        ),
        (await anthropic_post(gw, "/v1/messages", {"model": "m", "messages": HELLO}), 400),
        (await anthropic_post(gw, "/v1/messages/nothing", {"model": "m"}), 404),
    ]
    for answer, status in cases:
        assert answer.status == status, answer.text
        body = answer.json
        conforms(body, ErrorResponse)
        assert body["error"]["type"] == ANTHROPIC_ERROR_TYPES[status], body
        assert body["request_id"] == answer.headers["request-id"] == answer.headers["x-llmgw-request-id"]


# Whole answers ----------------------------------------------------------------------------------------


async def test_whole_answers(gw: Gateway) -> None:
    chat = await gw.chat()
    conforms(chat.json, ChatCompletion)
    assert chat.headers["x-request-id"] == chat.headers["x-llmgw-request-id"]
    message = await anthropic_post(gw, "/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO})
    conforms(message.json, Message)
    assert message.headers["request-id"] == message.headers["x-llmgw-request-id"]
    made = await gw.post("/v1/responses", {"model": "m", "input": "Hello"})
    conforms(made.json, Response)
    stored = await gw.get(f"/v1/responses/{made.json['id']}")
    conforms(stored.json, Response)
    items = await gw.get(f"/v1/responses/{made.json['id']}/input_items")
    conforms(items.json, ResponseItemList)
    embedded = await gw.post("/v1/embeddings", {"model": "m", "input": "x"})
    conforms(embedded.json, CreateEmbeddingResponse)
    models = (await gw.get("/v1/models")).json
    assert models["object"] == "list"
    for model in models["data"]:
        conforms({k: v for k, v in model.items() if k != "llmgw"}, Model)  # llmgw: the gateway's own, documented


# Streams ------------------------------------------------------------------------------------------------


async def test_chat_stream_chunks(gw: Gateway) -> None:
    answer = await gw.chat(stream=True, stream_options={"include_usage": True})
    chunks = events(answer.text)
    assert chunks and answer.text.rstrip().endswith("data: [DONE]")
    for _name, chunk in chunks:
        conforms(chunk, ChatCompletionChunk)


async def test_anthropic_stream_events(gw: Gateway) -> None:
    body = {"model": "m", "max_tokens": 20, "messages": HELLO, "stream": True}
    answer = await anthropic_post(gw, "/v1/messages", body)
    found = events(answer.text)
    assert [data["type"] for _name, data in found][:1] == ["message_start"]
    for name, data in found:
        assert name == data["type"]  # the event line names the data's type, as the reference streams them
        if data["type"] == "ping":
            assert data == {"type": "ping"}
            continue
        conforms(data, RawMessageStreamEvent)


async def test_responses_stream_events(gw: Gateway) -> None:
    answer = await gw.post("/v1/responses", {"model": "m", "input": "Hello", "stream": True})
    found = events(answer.text)
    assert found[-1][1]["type"] == "response.completed"
    numbers = [data["sequence_number"] for _name, data in found]
    assert numbers == list(range(len(found)))
    for name, data in found:
        assert name == data["type"]
        conforms(data, ResponseStreamEvent)


def test_the_check_finds_what_departs_from_a_reference() -> None:
    good = {"message": "m", "type": "invalid_request_error", "param": None, "code": None}
    assert problems(good, ErrorObject) == []
    assert problems({**good, "param": 3}, ErrorObject) == ["$.param: expected a string, got 3"]
    assert problems({"message": "m", "extra": 1}, ErrorObject) == [
        "$.extra: not a field of ErrorObject",
        "$.type: missing (ErrorObject requires it)",
    ]
    event = {"type": "message_stop", "bogus": True}
    assert problems(event, RawMessageStreamEvent) == ["$.bogus: not a field of RawMessageStopEvent"]
    delta = {"type": "response.output_text.delta", "sequence_number": 1, "bogus": 1}
    assert "$.bogus: not a field of ResponseTextDeltaEvent" in problems(delta, ResponseStreamEvent)
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    chunk["choices"] = [{"index": 0, "delta": {"content": "a", "timings": {}}, "finish_reason": "nope"}]
    assert problems(chunk, ChatCompletionChunk) == [
        "$.choices[0].delta.timings: not a field of ChoiceDelta",
        "$.choices[0].finish_reason: 'nope' is not one of ('stop', 'length', 'tool_calls', 'content_filter', "
        "'function_call')",
    ]
