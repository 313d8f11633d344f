"""Edge cases of the /v1 gateway's protocol handling, against a scriptable mock engine.

The gateway runs for real (uvicorn, on a free port, in the test's event loop) with its tables set
in memory instead of loaded from the database, a fake usage writer that keeps the records it is
given, and a fake limiter. Clients are aiohttp and the official OpenAI and Anthropic SDKs.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from apps.gateway.routing import affinity_key, preference
from apps.gateway.tables import Tables, Upstream, key_hash
from apps.quotas.limiter import Window
from tests.gateway.harness import (
    HELLO,
    KEY,
    OTHER_KEY,
    WAIT,
    Answer,
    Gateway,
    Headroom,
    Refusal,
    anthropic,
    endpoint,
    entry,
    failed_until,
    held,
    openai,
    route,
    sse_events,
    until,
)
from tests.gateway.mock_engine import MockEngine, closed_port

# Requests the gateway refuses itself ---------------------------------------------------------


async def test_malformed_json_is_a_400_openai_error(gw: Gateway) -> None:
    answer = await gw.post(
        "/v1/chat/completions", data=b'{"model": "m", "messages": [', headers={"Content-Type": "application/json"}
    )
    assert answer.status == 400
    error = answer.json["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("The body is not valid JSON")
    assert set(error) == {"message", "type", "param", "code"}
    assert (await gw.usage.wait())["status"] == 400


async def test_malformed_json_on_messages_is_a_400_anthropic_error(gw: Gateway) -> None:
    answer = await gw.post("/v1/messages", data=b"not json at all")
    assert answer.status == 400
    assert answer.json["type"] == "error"
    assert answer.json["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in answer.json["error"]["message"]


async def test_a_body_that_is_not_an_object_is_a_400(gw: Gateway) -> None:
    answer = await gw.post("/v1/chat/completions", ["m"])
    assert answer.status == 400
    assert answer.json["error"]["message"] == "The body must be a JSON object."


async def test_a_body_without_a_model_is_a_400_naming_the_field(gw: Gateway) -> None:
    answer = await gw.post("/v1/chat/completions", {"messages": HELLO})
    assert answer.status == 400
    assert answer.json["error"]["code"] == "missing_model"
    assert "model" in answer.json["error"]["message"]


async def test_a_model_name_with_a_nul_is_a_400_naming_the_field(gw: Gateway, engine: MockEngine) -> None:
    answer = await gw.post("/v1/chat/completions", {"model": "m\x00", "messages": HELLO})
    assert answer.status == 400
    error = answer.json["error"]
    assert error["code"] == "invalid_model" and error["param"] == "model" and "NUL" in error["message"]
    record = await gw.usage.wait()
    assert record["status"] == 400 and "\x00" not in record["model"] + record["error"]
    assert engine.seen == []


async def test_an_unknown_model_is_a_404_in_each_protocol(gw: Gateway, engine: MockEngine) -> None:
    chat = await gw.post("/v1/chat/completions", {"model": "nope", "messages": HELLO})
    assert chat.status == 404
    assert chat.json["error"]["code"] == "model_not_found"
    assert chat.json["error"]["type"] == "invalid_request_error"
    messages = await gw.post("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": HELLO})
    assert messages.status == 404
    assert messages.json["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        await gw.openai().chat.completions.create(model="nope", messages=HELLO)
    assert engine.seen == []


async def test_an_unknown_route_is_a_404(gw: Gateway) -> None:
    answer = await gw.post("/v1/nothing/here", {"model": "m"})
    assert answer.status == 404
    assert answer.json["error"]["message"] == "No route for POST /v1/nothing/here"


async def test_a_body_over_max_body_is_a_413(gw: Gateway, engine: MockEngine) -> None:
    gw.app.max_body = 200
    answer = await gw.chat(padding="x" * 1000)
    assert answer.status == 413
    assert "200 bytes" in answer.json["error"]["message"]
    assert (await gw.usage.wait())["status"] == 413
    assert engine.seen == []


async def test_a_wrong_key_is_a_401_in_the_protocol_of_the_endpoint(gw: Gateway, engine: MockEngine) -> None:
    chat = await gw.chat(key="llmgw_wrong")
    assert chat.status == 401
    assert chat.json["error"]["type"] == "authentication_error"
    assert chat.json["error"]["code"] == "invalid_api_key"
    messages = await gw.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO}, key="llmgw_wrong")
    assert messages.status == 401
    assert messages.json == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "Invalid, revoked or expired API key."},
        "request_id": messages.headers["request-id"],
    }
    missing = await gw.chat(key=None)
    assert missing.status == 401
    assert missing.json["error"]["code"] == "missing_api_key"
    models = await gw.get("/v1/models", key="llmgw_wrong")
    assert models.status == 401
    with pytest.raises(openai.AuthenticationError):
        await gw.openai("llmgw_wrong").chat.completions.create(model="m", messages=HELLO)
    with pytest.raises(anthropic.AuthenticationError):
        await gw.anthropic("llmgw_wrong").messages.create(model="m", max_tokens=5, messages=HELLO)
    assert engine.seen == []
    assert gw.usage.records == []  # nobody to charge


async def test_an_expired_key_is_a_401(gw: Gateway) -> None:
    gw.set_key(OTHER_KEY, entry(2, expires_at=time.time() - 1))
    answer = await gw.chat(key=OTHER_KEY)
    assert answer.status == 401
    assert answer.json["error"]["message"] == "API key expired."


async def test_a_key_limited_to_other_models_is_a_403(gw: Gateway, engine: MockEngine) -> None:
    gw.set_key(OTHER_KEY, entry(2, allowed_models=frozenset({"other"})))
    answer = await gw.chat(key=OTHER_KEY)
    assert answer.status == 403
    assert answer.json["error"]["code"] == "model_not_allowed"
    assert engine.seen == []


# Upstream errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_an_upstream_400_is_passed_on_with_its_message_and_recorded(
    gw: Gateway, engine: MockEngine, stream: bool
) -> None:
    engine.mode, engine.error_status, engine.error_message = "error", 400, "max_tokens is too large"
    answer = await gw.chat(stream=stream)
    assert answer.status == 400
    assert answer.json["error"]["message"] == "max_tokens is too large"
    assert answer.json["error"]["type"] == "invalid_request_error"
    record = await gw.usage.wait()
    assert record["status"] == 400
    assert record["error"] == "max_tokens is too large"
    assert record["replica"] == "n1/1"
    assert held(gw.endpoint) == 0


async def test_an_upstream_500_is_passed_on_to_the_openai_sdk_and_recorded(gw: Gateway, engine: MockEngine) -> None:
    engine.mode, engine.error_status, engine.error_message = "error", 500, "CUDA out of memory"
    with pytest.raises(openai.InternalServerError) as raised:
        await gw.openai().chat.completions.create(model="m", messages=HELLO)
    assert raised.value.status_code == 500
    assert "CUDA out of memory" in raised.value.message
    record = await gw.usage.wait()
    assert (record["status"], record["error"]) == (500, "CUDA out of memory")


async def test_an_upstream_error_on_messages_is_an_anthropic_error(gw: Gateway, engine: MockEngine) -> None:
    engine.mode, engine.error_status, engine.error_message = "error", 400, "context length exceeded"
    with pytest.raises(anthropic.BadRequestError) as raised:
        await gw.anthropic().messages.create(model="m", max_tokens=5, messages=HELLO)
    assert raised.value.body["error"] == {"type": "invalid_request_error", "message": "context length exceeded"}
    record = await gw.usage.wait()
    assert (record["status"], record["endpoint"]) == (400, "messages")


async def test_an_upstream_that_dies_mid_stream_ends_a_chat_stream_with_an_error_line(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.mode, engine.chunks = "die", 3
    answer = await gw.chat(stream=True)
    assert answer.status == 200
    events = sse_events(answer.text)
    assert [json.loads(d)["choices"][0]["delta"]["content"] for _n, d in events[:3]] == ["t0 ", "t1 ", "t2 "]
    last = json.loads(events[-1][1])
    assert last["error"]["type"] == "api_error"
    assert "the upstream" in last["error"]["message"]
    assert "[DONE]" not in answer.text
    record = await gw.usage.wait()
    assert record["status"] == 502
    assert record["error"].startswith("the upstream")
    assert record["completion_tokens"] == 3 and record["tokens_estimated"] is True
    assert held(gw.endpoint) == 0


async def test_an_upstream_that_dies_mid_stream_ends_a_messages_stream_with_an_error_event(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.mode = "die"
    answer = await gw.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO, "stream": True})
    assert answer.status == 200
    names = [name for name, _d in sse_events(answer.text)]
    assert names[0] == "message_start"
    assert "content_block_delta" in names
    assert names[-1] == "error"
    assert "message_stop" not in names
    error = json.loads(sse_events(answer.text)[-1][1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    record = await gw.usage.wait()
    assert record["status"] == 502 and record["error"]


async def test_an_upstream_that_dies_mid_stream_ends_a_responses_stream_with_response_failed(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.mode = "die"
    answer = await gw.post("/v1/responses", {"model": "m", "input": "Say hello", "stream": True})
    assert answer.status == 200
    events = sse_events(answer.text)
    assert events[0][0] == "response.created"
    assert events[-1][0] == "response.failed"
    assert "response.completed" not in [name for name, _d in events]
    failed = json.loads(events[-1][1])["response"]
    assert failed["status"] == "failed" and failed["error"]["message"]
    record = await gw.usage.wait()
    assert (record["status"], record["endpoint"]) == (502, "responses")


# Streams -----------------------------------------------------------------------------------------------


async def test_a_stream_with_usage_is_passed_on_and_its_reported_usage_recorded(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.chunks = 4
    answer = await gw.chat(stream=True, stream_options={"include_usage": True})
    assert answer.status == 200
    assert answer.headers["content-type"] == "text/event-stream"
    events = sse_events(answer.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _name, data in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    # As the API reference says: with include_usage, every other chunk carries "usage": null.
    assert all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1])
    record = await gw.usage.wait()
    assert (record["status"], record["stream"]) == (200, True)
    assert (record["prompt_tokens"], record["completion_tokens"], record["tokens_estimated"]) == (7, 4, False)
    assert record["first_token_ms"] is not None


async def test_a_stream_whose_client_did_not_ask_for_usage_gets_no_usage_chunk(gw: Gateway, engine: MockEngine) -> None:
    engine.chunks = 4
    answer = await gw.chat(stream=True)
    events = sse_events(answer.text)
    chunks = [json.loads(data) for _name, data in events[:-1]]
    assert events[-1] == (None, "[DONE]")
    assert all(chunk["choices"] and "usage" not in chunk for chunk in chunks)
    # The engine was asked for its usage all the same, and the record has it.
    assert engine.seen[-1].body["stream_options"] == {"include_usage": True}
    record = await gw.usage.wait()
    assert (record["prompt_tokens"], record["completion_tokens"], record["tokens_estimated"]) == (7, 4, False)


async def test_the_openai_quickstart_stream_loop_reads_every_chunk(gw: Gateway, engine: MockEngine) -> None:
    engine.chunks = 3
    stream = await gw.openai().chat.completions.create(model="m", messages=HELLO, stream=True)
    # The loop the OpenAI quickstart shows: it indexes choices[0] of every chunk.
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert text == "t0 t1 t2 "


async def test_a_stream_without_usage_is_counted_from_its_chunks(gw: Gateway, engine: MockEngine) -> None:
    engine.chunks, engine.stream_usage = 5, False
    answer = await gw.chat(stream=True)
    assert answer.status == 200
    assert sse_events(answer.text)[-1] == (None, "[DONE]")
    # The gateway asks for usage whatever the client said...
    assert engine.seen[0].body["stream_options"] == {"include_usage": True}
    # ...and counts one token a chunk when the engine sends none.
    record = await gw.usage.wait()
    assert record["status"] == 200
    assert record["completion_tokens"] == 5
    assert record["prompt_tokens"] is None
    assert record["tokens_estimated"] is True


async def test_a_client_that_goes_away_mid_stream_cancels_the_upstream_request_and_is_recorded_as_499(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.mode, engine.chunks = "hang", 2
    response = await gw.client.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": HELLO, "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert response.status == 200
    first = await response.content.readuntil(b"\n\n")
    assert first.startswith(b"data: ")
    response.close()  # drop the connection mid-stream
    async with asyncio.timeout(WAIT):
        await engine.closed.wait()
    record = await gw.usage.wait()
    assert record["status"] == 499
    assert "went away" in record["error"]
    assert held(gw.endpoint) == 0


async def test_a_stream_cancelled_after_300_chunks_is_charged_for_what_was_relayed(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.chunks = 300
    engine.hold = asyncio.Event()  # the engine has sent 300 chunks and is not done: no usage came yet
    gw.app.tables.keys[key_hash(KEY)] = entry(limits=("a limit",))
    response = await gw.client.post(
        gw.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x" * 400}], "stream": True},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    seen = 0
    while seen < 300:
        seen += (await response.content.readuntil(b"\n\n")).startswith(b"data: {")
    response.close()  # the client hangs up just before the end
    record = await gw.usage.wait()
    assert record["status"] == 499
    # What was relayed is what is charged: 300 chunks of output, and the prompt, which this mock
    # engine cannot count, estimated from its length (a quarter of its characters).
    assert record["completion_tokens"] == 300
    assert record["prompt_tokens"] is not None and record["prompt_tokens"] >= 100
    assert record["tokens_estimated"] is True
    async with asyncio.timeout(WAIT):
        await gw.limiter.tokens_recorded.wait()
    assert gw.limiter.recorded == [record["prompt_tokens"] + 300]
    assert held(gw.endpoint) == 0


async def test_a_client_that_goes_away_before_the_upstream_answers_cancels_the_upstream_request(
    gw: Gateway, engine: MockEngine
) -> None:
    engine.gate = asyncio.Event()
    request = asyncio.create_task(gw.chat())
    async with asyncio.timeout(WAIT):
        await engine.arrived.wait()
    request.cancel()  # the client gives up while the engine is still working on the whole answer
    with pytest.raises(asyncio.CancelledError):
        await request
    try:
        async with asyncio.timeout(0.5):
            await engine.closed.wait()
    finally:
        engine.gate.set()


async def take_the_only_slot(gw: Gateway, engine: MockEngine) -> asyncio.Task[Answer]:
    """Give the replica one slot and fill it with a request the engine holds until `engine.gate` is set."""
    gw.endpoint.capacity = 1
    engine.gate = asyncio.Event()
    first = asyncio.create_task(gw.chat())
    async with asyncio.timeout(WAIT):
        await engine.arrived.wait()
    return first


# Slots and the queue ------------------------------------------------------------------------------------


async def test_a_second_request_waits_for_a_busy_slot_and_is_served_after_the_first(
    gw: Gateway, engine: MockEngine
) -> None:
    first = await take_the_only_slot(gw, engine)
    second = asyncio.create_task(gw.chat())
    await until(lambda: gw.app.admission.queue.waiting("m") == 1)
    assert len(engine.seen) == 1  # the second is queued in the gateway, not at the engine
    engine.gate.set()
    answers = await asyncio.gather(first, second)
    assert [a.status for a in answers] == [200, 200]
    assert len(engine.seen) == 2
    assert engine.max_active == 1
    await gw.usage.wait(2)
    assert held(gw.endpoint) == 0
    assert gw.app.admission.queue.waiting("m") == 0


async def test_a_request_that_must_wait_tells_the_reconciler_once_that_a_growable_model_is_busy(
    gw: Gateway, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import apps.catalog.services

    busy: list[str] = []
    monkeypatch.setattr(apps.catalog.services, "record_busy", lambda name: busy.append(name) or True)
    gw.app.tables.models["m"] = route("m", [gw.endpoint], max_replicas=2)
    first = await take_the_only_slot(gw, engine)
    assert busy == []  # a free slot was found: nothing to report
    waiting = [asyncio.create_task(gw.chat()) for _ in range(3)]
    await until(lambda: gw.app.admission.queue.waiting("m") == 3)
    await until(lambda: busy == ["m"])
    engine.gate.set()
    answers = await asyncio.gather(first, *waiting)
    assert [a.status for a in answers] == [200] * 4
    assert busy == ["m"]  # three waits within the interval make one report


async def test_a_model_at_its_maximum_is_not_reported_busy(
    gw: Gateway, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    import apps.catalog.services

    busy: list[str] = []
    monkeypatch.setattr(apps.catalog.services, "record_busy", lambda name: busy.append(name) or True)
    first = await take_the_only_slot(gw, engine)  # the route's maximum is its one replica
    second = asyncio.create_task(gw.chat())
    await until(lambda: gw.app.admission.queue.waiting("m") == 1)
    engine.gate.set()
    assert [a.status for a in await asyncio.gather(first, second)] == [200, 200]
    assert busy == []


async def test_a_client_that_leaves_while_waiting_gives_up_its_place_and_never_reaches_the_engine(
    gw: Gateway, engine: MockEngine
) -> None:
    first = await take_the_only_slot(gw, engine)
    second = asyncio.create_task(gw.chat())
    await until(lambda: gw.app.admission.queue.waiting("m") == 1)
    second.cancel()  # the client closes its connection while its request waits in the gateway
    with pytest.raises(asyncio.CancelledError):
        await second
    await until(lambda: gw.app.admission.queue.waiting("m") == 0)
    record = await gw.usage.wait(1)  # recorded before the first request even ends
    assert record["status"] == 499 and "waiting for a replica" in record["error"]
    engine.gate.set()
    assert (await first).status == 200
    await gw.usage.wait(2)
    assert len(engine.seen) == 1 and held(gw.endpoint) == 0


async def test_a_request_beyond_the_queue_gets_503_with_retry_after(gw: Gateway, engine: MockEngine) -> None:
    gw.app.admission.most = gw.app.admission.queue.most = 0
    first = await take_the_only_slot(gw, engine)
    refused = await gw.chat()
    assert refused.status == 503
    assert refused.headers["retry-after"] == "5"
    assert "The queue for “m” is full (0 of 0 waiting)" in refused.json["error"]["message"]
    assert refused.json["error"]["type"] == "server_error"
    assert (await gw.usage.wait())["status"] == 503
    engine.gate.set()
    assert (await first).status == 200


async def test_a_request_that_waits_past_the_queue_timeout_gets_503_with_retry_after(
    gw: Gateway, engine: MockEngine
) -> None:
    gw.app.admission.timeouts = (0.05, 0.05)
    first = await take_the_only_slot(gw, engine)
    refused = await gw.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO})
    assert refused.status == 503
    assert refused.headers["retry-after"] == "10"
    assert refused.json["error"]["type"] == "overloaded_error"
    assert refused.json["error"]["message"].startswith("No capacity")
    engine.gate.set()
    assert (await first).status == 200
    assert gw.app.admission.queue.waiting("m") == 0


# Routing ---------------------------------------------------------------------------------------------------


async def test_an_unreachable_replica_is_marked_failed_and_the_request_retried_on_another(
    gw: Gateway, engine: MockEngine
) -> None:
    bad = endpoint(f"http://127.0.0.1:{closed_port()}", "bad")
    good = endpoint(engine.url, "good")
    gw.set_models(route("m", [bad, good]))

    # A prompt whose home on the affinity ring is the unreachable replica, so that it is tried first.
    def first_choice(text: str) -> Upstream:
        return preference([bad, good], affinity_key({"messages": [{"role": "user", "content": text}]}))[0][0]

    prompt = next(f"hello {i}" for i in range(1000) if first_choice(f"hello {i}") is bad)
    answer = await gw.chat(messages=[{"role": "user", "content": prompt}])
    assert answer.status == 200
    assert answer.headers["x-llmgw-replica"] == "m/good"
    assert failed_until(bad) > time.monotonic()
    record = await gw.usage.wait()
    assert record["replica"] == "n1/good"
    # Both slots are given back: the retried replica's, and the one it moved to.
    assert (held(bad), held(good)) == (0, 0)


async def test_an_only_replica_that_is_unreachable_is_a_502(gw: Gateway) -> None:
    bad = endpoint(f"http://127.0.0.1:{closed_port()}", "bad")
    gw.set_models(route("m", [bad]))
    answer = await gw.chat()
    assert answer.status == 502
    assert "could not be reached" in answer.json["error"]["message"]
    assert failed_until(bad) > time.monotonic()
    assert (await gw.usage.wait())["status"] == 502
    assert held(bad) == 0


async def test_a_fallback_model_serves_when_the_primary_has_no_endpoints(gw: Gateway, engine: MockEngine) -> None:
    fallback = endpoint(engine.url, "7", model="f")
    gw.set_models(route("m", [], fallbacks=["f"]), route("f", [fallback]))
    answer = await gw.chat()
    assert answer.status == 200
    assert answer.headers["x-llmgw-replica"] == "f/7"
    assert engine.seen[0].body["model"] == "f"
    assert answer.json["model"] == "m"
    record = await gw.usage.wait()
    assert (record["model"], record["replica"]) == ("m", "n1/7")
    assert held(fallback) == 0


@pytest.mark.parametrize("asked", [0, 0.7, 2])
async def test_a_temperature_in_range_reaches_the_engine_as_asked(
    gw: Gateway, engine: MockEngine, asked: float
) -> None:
    assert (await gw.chat(temperature=asked)).status == 200
    assert engine.seen[0].body["temperature"] == asked


async def test_an_external_endpoint_gets_its_upstream_model_and_key_and_answers_name_the_callers_model(
    gw: Gateway, engine: MockEngine
) -> None:
    external = endpoint(
        engine.url,
        "external:m",
        secret="sk-provider",
        hardware="external",
        node="",
        upstream_model="provider-model-v2",
        slots=1_000_000,
    )
    gw.set_models(route("m", [external], external=True, hardware=["external"]))
    engine.require_key = "sk-provider"
    whole = await gw.chat()
    assert whole.status == 200
    assert whole.json["model"] == "m"
    assert whole.headers["x-llmgw-hardware"] == "external"
    streamed = await gw.chat(stream=True)
    chunks = [json.loads(d) for _n, d in sse_events(streamed.text) if d != "[DONE]"]
    assert chunks and {c["model"] for c in chunks} == {"m"}
    for seen in engine.seen:
        assert seen.body["model"] == "provider-model-v2"
        assert seen.headers["Authorization"] == "Bearer sk-provider"  # never the caller's own key
    message = await gw.anthropic().messages.create(model="m", max_tokens=5, messages=HELLO)
    assert message.model == "m"
    assert message.content[0].text == "Hello there"


async def test_an_endpoints_key_file_is_read_on_every_request(gw: Gateway, engine: MockEngine, tmp_path: Path) -> None:
    key_file = tmp_path / "provider.key"
    key_file.write_text("sk-one\n")
    gw.set_models(route("m", [endpoint(engine.url, "external:m", secret=None, key_file=str(key_file))]))
    engine.require_key = "sk-one"
    assert (await gw.chat()).status == 200
    key_file.write_text("sk-two\n")
    engine.require_key = "sk-two"
    assert (await gw.chat()).status == 200


# Headers, listing, limits -------------------------------------------------------------------------------


async def test_every_answer_carries_a_request_id_and_successes_name_the_replica_and_hardware(
    gw: Gateway, engine: MockEngine
) -> None:
    for answer in (await gw.chat(), await gw.chat(stream=True)):
        assert answer.status == 200
        assert answer.headers["x-llmgw-request-id"].startswith("req_")
        assert answer.headers["x-llmgw-replica"] == "m/1"
        assert answer.headers["x-llmgw-hardware"] == "cpu"
    engine.mode, engine.error_status = "error", 500
    gw.app.max_body = 500
    errors = [
        await gw.chat(),  # the upstream's error
        await gw.chat(key="llmgw_wrong"),
        await gw.post("/v1/chat/completions", data=b"{"),
        await gw.post("/v1/messages", {"model": "nope", "max_tokens": 5, "messages": HELLO}),
        await gw.chat(padding="x" * 1000),
        await gw.post("/v1/nothing", {}),
        await gw.get("/v1/models", key="llmgw_wrong"),
    ]
    assert [e.status for e in errors] == [500, 401, 400, 404, 413, 404, 401]
    ids = [e.headers.get("x-llmgw-request-id", "") for e in errors]
    assert all(i.startswith("req_") for i in ids), ids
    assert len(set(ids)) == len(ids)
    usage_ids = {r["request_id"] for r in await _all_records(gw, 6)}
    assert ids[0] in usage_ids  # the id a caller sees is the one its usage record has


async def _all_records(gw: Gateway, count: int) -> list[dict[str, Any]]:
    await gw.usage.wait(count)
    return gw.usage.records


async def test_models_lists_only_the_models_a_key_may_use(gw: Gateway, engine: MockEngine) -> None:
    gw.set_models(route("m", [endpoint(engine.url)]), route("other", [], min_replicas=0))
    gw.set_key(OTHER_KEY, entry(2, allowed_models=frozenset({"m"})))
    limited = await gw.get("/v1/models", key=OTHER_KEY)
    assert limited.status == 200
    assert limited.headers["x-llmgw-request-id"].startswith("req_")
    assert [m["id"] for m in limited.json["data"]] == ["m"]
    everything = await gw.get("/v1/models")
    assert [(m["id"], m["llmgw"]["ready_replicas"]) for m in everything.json["data"]] == [("m", 1), ("other", 0)]
    listed = await gw.openai(OTHER_KEY).models.list()
    assert [m.id for m in listed.data] == ["m"]


async def test_a_limiter_refusal_is_a_429_with_retry_after_and_the_limits_message(
    gw: Gateway, engine: MockEngine
) -> None:
    gw.set_key(OTHER_KEY, entry(2, limits=("key:2",)))
    gw.limiter.refusal = Refusal("requests per minute", "key:2", "key “test”", used=5, allowed=5, retry_after_s=7)
    answer = await gw.chat(key=OTHER_KEY)
    assert answer.status == 429
    assert answer.headers["retry-after"] == "7"
    message = "key “test” is over its limit of 5 requests per minute (5 used); retry in 7 s"
    assert answer.json["error"]["message"] == message
    assert answer.json["error"]["type"] == "rate_limit_error"
    assert answer.json["error"]["code"] == "rate_limit_exceeded"  # what the OpenAI SDKs switch on
    # the limit headers the clients read, on the refusal too
    assert answer.headers["x-ratelimit-limit-requests"] == "5"
    assert answer.headers["x-ratelimit-remaining-requests"] == "0"
    assert answer.headers["x-ratelimit-reset-requests"] == "7s"
    assert gw.limiter.admitted == [["key:2"]]
    record = await gw.usage.wait()
    assert record["status"] == 429 and record["error"].startswith("key “test”")
    with pytest.raises(anthropic.RateLimitError) as refused:
        await gw.anthropic(OTHER_KEY).messages.create(model="m", max_tokens=5, messages=HELLO)
    assert refused.value.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert engine.seen == []


async def test_an_answer_a_limit_governs_carries_the_rate_limit_headers(gw: Gateway) -> None:
    gw.set_key(OTHER_KEY, entry(2, limits=("key:2",)))
    gw.limiter.refusal = Headroom(Window(60, 41, 12.2), Window(100_000, 99_000, 372.0))
    answer = await gw.chat(key=OTHER_KEY)
    assert answer.status == 200
    headers = answer.headers
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("60", "41")
    assert headers["x-ratelimit-reset-requests"] == "13s"
    assert (headers["x-ratelimit-limit-tokens"], headers["x-ratelimit-remaining-tokens"]) == ("100000", "99000")
    assert headers["x-ratelimit-reset-tokens"] == "6m12s"
    assert headers["x-llmgw-queue-ms"] == "0" and headers["x-llmgw-priority"] == "interactive"
    message = await gw.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO}, key=OTHER_KEY)
    assert message.headers["anthropic-ratelimit-tokens-remaining"] == "99000"
    assert message.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert "x-ratelimit-limit-requests" not in message.headers
    plain = await gw.chat()  # a key no limit governs: no limit headers
    assert "x-ratelimit-limit-requests" not in plain.headers


async def test_a_success_counts_its_tokens_against_the_keys_limits(gw: Gateway) -> None:
    gw.set_key(OTHER_KEY, entry(2, limits=("key:2",)))
    assert (await gw.chat(key=OTHER_KEY)).status == 200
    async with asyncio.timeout(WAIT):
        await gw.limiter.tokens_recorded.wait()
    assert gw.limiter.recorded == [9]  # 7 prompt + 2 completion


async def test_a_whole_answer_reaches_the_openai_sdk_with_its_usage_recorded(gw: Gateway) -> None:
    completion = await gw.openai().chat.completions.create(model="m", messages=HELLO, max_tokens=5)
    assert completion.choices[0].message.content == "Hello there"
    assert completion.model == "m"
    record = await gw.usage.wait()
    assert (record["status"], record["endpoint"], record["stream"]) == (200, "chat.completions", False)
    assert (record["prompt_tokens"], record["completion_tokens"], record["tokens_estimated"]) == (7, 2, False)
    assert (
        record["api_key_id"],
        record["user_id"],
        record["project_id"],
        record["team_id"],
        record["organization_id"],
    ) == (1, 10, 20, 30, 40)


# Keys and models made a moment ago -----------------------------------------------------------------


async def test_a_key_and_model_made_since_the_last_refresh_are_served_not_refused(
    gw: Gateway, engine: MockEngine
) -> None:
    fresh_key = "llmgw_made_a_moment_ago"
    keys = {**gw.app.tables.keys, key_hash(fresh_key): entry(key_id=2)}
    models = {**gw.app.tables.models, "new": route("new", [endpoint(engine.url, "2", model="new")])}
    gw.database["tables"] = Tables(keys=keys, models=models, version=gw.app.tables.version + 1)
    # The refresh loop would see this within a second; a request in that second must not be refused.
    answer = await gw.post("/v1/chat/completions", {"model": "new", "messages": HELLO}, key=fresh_key)
    assert answer.status == 200, answer.text
    assert gw.app.tables.version == gw.database["tables"].version


async def test_requests_that_miss_together_ask_for_the_table_version_once(gw: Gateway) -> None:
    answers = await asyncio.gather(*(gw.chat(key="llmgw_no_such_key") for _ in range(20)))
    assert {a.status for a in answers} == {401}
    assert 1 <= len(gw.version_checks) < 20
    assert gw.app.tables.keys.get(key_hash("llmgw_no_such_key")) is None


# Metrics --------------------------------------------------------------------------------------------


async def test_requests_are_counted_by_model_and_a_made_up_model_name_never_becomes_a_series(
    gw: Gateway, engine: MockEngine
) -> None:
    from apps.gateway import metrics

    def count(model: str, status: str) -> float:
        return metrics.REQUESTS.labels(model=model, status=status)._value.get()

    served, unknown = count("m", "200"), count("-", "404")
    assert (await gw.chat()).status == 200
    made_up = "no-such-model-" + str(time.time_ns())
    assert (await gw.post("/v1/chat/completions", {"model": made_up, "messages": HELLO})).status == 404
    await gw.usage.wait(2)
    assert count("m", "200") == served + 1
    assert count("-", "404") == unknown + 1
    assert not [labels for labels in metrics.REQUESTS._metrics if labels[0] == made_up]


async def test_an_engine_that_stays_silent_past_the_read_timeout_is_a_504_and_is_let_go(
    gw: Gateway, engine: MockEngine
) -> None:
    assert gw.app.forwarder.upstream is not None
    gw.app.forwarder.upstream.read_timeout = 0.2
    engine.gate = asyncio.Event()
    try:
        answer = await gw.chat()
        assert answer.status == 504
        assert "did not answer in time" in answer.json["error"]["message"]
        assert "0.2 s" in answer.json["error"]["message"]
        async with asyncio.timeout(WAIT):
            await engine.closed.wait()  # the connection was closed, so the engine may stop its work
    finally:
        engine.gate.set()
    record = await gw.usage.wait()
    assert record["status"] == 504
    assert held(gw.endpoint) == 0


async def test_an_announced_change_is_read_before_the_next_request_is_routed(gw: Gateway, engine: MockEngine) -> None:
    assert (await gw.chat()).status == 200
    # The model is deleted (the database moved on) and the change announced, as a commit does.
    gw.database["tables"] = Tables(keys=gw.app.tables.keys, models={}, version=gw.app.tables.version + 1)
    gw.app.wake_from_thread()
    await asyncio.sleep(0)  # the loop runs the announcement, as it does before the next request
    answer = await gw.chat()
    assert answer.status == 404 and answer.json["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("messages", "code", "message"),
    [
        (None, "missing_required_parameter", "Missing required parameter: 'messages'."),
        ([], "empty_array", "Invalid 'messages': empty array."),
        ("hello", "invalid_type", "Invalid type for 'messages': expected an array of objects, but got a string"),
        (["hello"], "invalid_type", "Invalid type for 'messages': expected an array of objects, but got an array"),
    ],
)
async def test_a_chat_without_a_list_of_messages_is_refused_here_as_the_api_refuses_it(
    gw: Gateway, engine: MockEngine, messages: Any, code: str, message: str
) -> None:
    body = {"model": "m"} if messages is None else {"model": "m", "messages": messages}
    answer = await gw.post("/v1/chat/completions", body)
    assert answer.status == 400
    error = answer.json["error"]
    assert (error["code"], error["param"], error["type"]) == (code, "messages", "invalid_request_error")
    assert error["message"].startswith(message)
    assert engine.seen == []
