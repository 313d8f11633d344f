"""Requests that would occupy an engine, or the gateway's memory, far beyond their worth."""

from __future__ import annotations

import asyncio

from tests.gateway.harness import HELLO, Gateway, endpoint, route
from tests.gateway.mock_engine import MockEngine


async def test_a_request_with_more_messages_than_allowed_is_refused_before_any_engine_sees_it(
    gw: Gateway, engine: MockEngine
) -> None:
    gw.app.max_messages = 100
    answer = await gw.chat(messages=[{"role": "user", "content": "hi"}] * 101)
    assert answer.status == 400
    error = answer.json["error"]
    assert error["code"] == "too_many_messages" and "101 messages" in error["message"] and "100" in error["message"]
    assert engine.seen == []


async def test_content_parts_beyond_the_bound_are_refused(gw: Gateway, engine: MockEngine) -> None:
    gw.app.max_parts = 10
    parts = [{"type": "text", "text": "a"}] * 11
    answer = await gw.chat(messages=[{"role": "user", "content": parts}])
    assert answer.status == 400 and answer.json["error"]["code"] == "too_many_parts"
    assert engine.seen == []


async def test_a_prompt_that_surely_cannot_fit_the_context_is_refused_without_the_engine(
    gw: Gateway, engine: MockEngine
) -> None:
    gw.set_models(route("m", [endpoint(engine.url, "1", context_size=512)]))
    answer = await gw.chat(messages=[{"role": "user", "content": "word " * 4000}])
    assert answer.status == 400
    error = answer.json["error"]
    assert error["code"] == "context_length_exceeded" and "context of 512 tokens" in error["message"]
    assert engine.seen == []
    # A prompt that might fit goes to the engine, which has the last word.
    assert (await gw.chat(messages=[{"role": "user", "content": "word " * 300}])).status == 200


async def test_the_bodies_held_at_once_are_bounded_and_given_back(gw: Gateway, engine: MockEngine) -> None:
    gw.app.bodies.most = 64 * 1024
    engine.gate = asyncio.Event()
    big = "x" * (40 * 1024)
    first = asyncio.create_task(gw.chat(messages=[{"role": "user", "content": big}]))
    async with asyncio.timeout(5):
        await engine.arrived.wait()
    second = await gw.chat(messages=[{"role": "user", "content": big}])
    assert second.status == 503
    assert "holds" in second.json["error"]["message"] and second.headers["retry-after"] == "2"
    engine.gate.set()
    assert (await first).status == 200
    assert gw.app.bodies.held == 0
    assert (await gw.chat(messages=HELLO)).status == 200
