"""What a request's accounting does once its answer is out, seen from the client's side.

The usage record is made before the answer's last byte (tests/gateway/test_usage_before_last_byte.py);
the token charge against the caller's limits and the request's metrics come right after that byte,
so the answer never waits on them, and they are counted all the same when the client is gone the
moment it has its answer. The answer's headers, made while the engine works, say what they said
when they were made once the engine had answered: the replica that answered, and what guardrails did
to the answer too.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import REGISTRY

from apps.gateway.tables import Guards
from apps.guardrails.engine import RuleSpec
from apps.quotas.limiter import Headroom, Window
from tests.gateway.harness import HELLO, OTHER_KEY, Gateway, endpoint, entry, receive_once, route, until
from tests.gateway.mock_engine import MockEngine, closed_port

CHAT = {"model": "m", "messages": HELLO}
CARD = "4111 1111 1111 1111"


def answered(model: str = "m", status: str = "200") -> float:
    """Requests counted in llmgw_gateway_requests for the model and status."""
    return REGISTRY.get_sample_value("llmgw_gateway_requests_total", {"model": model, "status": status}) or 0.0


def timed(model: str = "m") -> float:
    """Requests counted in llmgw_gateway_request_duration_seconds for the model."""
    return REGISTRY.get_sample_value("llmgw_gateway_request_duration_seconds_count", {"model": model}) or 0.0


def limited(gw: Gateway) -> None:
    """OTHER_KEY under a limit, with room left: its requests are admitted and their tokens charged."""
    gw.set_key(OTHER_KEY, entry(2, limits=("key:2",)))
    gw.limiter.refusal = Headroom(Window(60, 41, 12.2), Window(100_000, 99_000, 372.0))


def scope() -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {OTHER_KEY}".encode()), (b"content-type", b"application/json")],
        "query_string": b"",
        "client": ("127.0.0.1", 5000),
    }


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "stream": True}], ids=["answer", "stream"])
async def test_the_token_charge_and_the_metrics_come_right_after_the_last_byte(
    gw: Gateway, body: dict[str, Any]
) -> None:
    limited(gw)
    before = (answered(), timed())
    at_last_byte: list[Any] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            at_last_byte.append((len(gw.usage.records), list(gw.limiter.recorded), answered(), timed()))

    await gw.app(scope(), receive_once(body), send)
    # When the last byte went out: the record made, nothing charged or counted yet.
    assert at_last_byte == [(1, [], *before)]
    # Once it is out, before the gateway is done with the request: charged and counted, once.
    record = gw.usage.records[0]
    assert gw.limiter.recorded == [record["prompt_tokens"] + record["completion_tokens"]]
    assert (answered(), timed()) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize("body", [CHAT, {**CHAT, "stream": True}], ids=["answer", "stream"])
async def test_a_client_gone_as_its_last_byte_is_sent_is_still_charged_and_counted(
    gw: Gateway, body: dict[str, Any]
) -> None:
    limited(gw)
    before = (answered(), timed())

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body"):
            raise OSError("the client's connection was reset")  # a server whose client is gone says so

    await gw.app(scope(), receive_once(body), send)
    assert len(gw.usage.records) == 1
    record = gw.usage.records[0]
    assert record["status"] == 200 and record["completion_tokens"]
    assert gw.limiter.recorded == [record["prompt_tokens"] + record["completion_tokens"]]
    assert (answered(), timed()) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_a_client_that_hangs_up_the_moment_it_has_its_answer_is_counted_once(gw: Gateway, stream: bool) -> None:
    limited(gw)
    before = (answered(), timed())
    headers = {"Authorization": f"Bearer {OTHER_KEY}", "Content-Type": "application/json"}
    body = json.dumps({**CHAT, "stream": stream}).encode()
    async with gw.client.post(gw.url + "/v1/chat/completions", data=body, headers=headers) as response:
        assert response.status == 200
        text = await response.text()
        response.close()  # the connection goes with the answer
    assert "[DONE]" in text if stream else '"usage"' in text
    await until(lambda: gw.limiter.recorded and answered() == before[0] + 1)
    record = gw.usage.records[0]
    assert len(gw.usage.records) == 1 and record["status"] == 200
    assert gw.limiter.recorded == [record["prompt_tokens"] + record["completion_tokens"]]
    assert timed() == before[1] + 1


@pytest.mark.parametrize("stream", [False, True], ids=["answer", "stream"])
async def test_the_answer_names_the_replica_that_answered_after_one_could_not_be_reached(
    gw: Gateway, engine: MockEngine, stream: bool
) -> None:
    unreachable = endpoint(f"http://127.0.0.1:{closed_port()}", "gone", slots=1)
    gw.set_models(route("m", [unreachable, endpoint(engine.url, "2", slots=1)]))
    for _ in range(4):  # whichever is tried first, the answer says who answered
        gw.app.keeper.mark_failed(unreachable, 0.0)  # tried again each time
        answer = await gw.chat(stream=stream)
        assert answer.status == 200
        assert answer.headers["x-llmgw-replica"] == "m/2"
        assert answer.headers["x-request-id"] == answer.headers["request-id"] == gw.usage.records[-1]["request_id"]
        assert answer.headers["content-type"].startswith("text/event-stream" if stream else "application/json")


async def test_the_answer_says_what_guardrails_did_to_the_answer_itself(gw: Gateway, engine: MockEngine) -> None:
    gw.app.tables.guards = Guards(
        everyone=[RuleSpec("company", "mask cards out", "detector", "redact", detector="card", applies_to="output")]
    )
    engine.pieces = [f"Your card {CARD} is on file."]
    answer = await gw.chat()
    assert answer.status == 200
    assert CARD not in answer.text
    assert answer.headers["x-llmgw-guardrail"] == "redact; company/mask cards out"
    engine.pieces = ["Nothing to hide."]
    assert "x-llmgw-guardrail" not in (await gw.chat()).headers


async def test_an_answer_under_limits_carries_its_limit_headers_on_both_apis(gw: Gateway) -> None:
    limited(gw)
    answer = await gw.chat(key=OTHER_KEY)
    assert answer.headers["x-ratelimit-remaining-tokens"] == "99000"
    assert answer.headers["x-ratelimit-reset-tokens"] == "6m12s"
    assert answer.headers["x-llmgw-queue-ms"] == "0"
    message = await gw.post("/v1/messages", {"model": "m", "max_tokens": 5, "messages": HELLO}, key=OTHER_KEY)
    assert message.headers["anthropic-ratelimit-tokens-remaining"] == "99000"
    assert message.headers["anthropic-ratelimit-tokens-reset"].endswith("Z")
