"""A request cut off by a stop is told which stop and why: its replica's (its drain grace ran out),
or the gateway process's own (stopped, and its requests in flight had the drain grace)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
import uvicorn

from apps.gateway.tables import Stopped, Tables
from llmgw import http_protocol
from tests.gateway.harness import WAIT, Gateway, held, sse_events
from tests.gateway.mock_engine import MockEngine

ROLLED = "the replica r1 was stopped: its drain grace of 120 s ran out (a profile change replaced it)"


def stopping(gw: Gateway, *stopped: Stopped) -> None:
    """The gateway's next tables: the same routes, these replicas listed as being stopped."""
    now = gw.app.tables
    gw.app.routes.use(
        Tables(keys=now.keys, models=now.models, version=now.version + 1, stopping={s.replica: s for s in stopped})
    )


async def test_a_stream_its_stopped_replica_cut_off_ends_with_an_error_naming_the_reason(
    gw: Gateway, engine: MockEngine
) -> None:
    stopping(gw, Stopped(replica="1", reason="a profile change replaced it", grace=120))
    engine.mode, engine.chunks = "die", 3  # the engine goes mid-stream, as its agent stops it
    answer = await gw.chat(stream=True)
    assert answer.status == 200
    events = sse_events(answer.text)
    assert [json.loads(d)["choices"][0]["delta"]["content"] for _n, d in events[:3]] == ["t0 ", "t1 ", "t2 "]
    assert json.loads(events[-1][1])["error"]["message"] == ROLLED
    assert "[DONE]" not in answer.text
    record = await gw.usage.wait()
    assert record["error"] == ROLLED
    assert held(gw.endpoint) == 0


async def test_a_messages_stream_its_stopped_replica_cut_off_ends_with_an_error_event_naming_it(
    gw: Gateway, engine: MockEngine
) -> None:
    stopping(gw, Stopped(replica="1", reason="a profile change replaced it", grace=120))
    engine.mode = "die"
    answer = await gw.post(
        "/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    name, data = sse_events(answer.text)[-1]
    assert name == "error" and json.loads(data)["error"]["message"] == ROLLED


async def test_a_whole_answer_its_stopped_replica_cut_off_is_a_503_naming_the_reason(
    gw: Gateway, engine: MockEngine
) -> None:
    stopping(gw, Stopped(replica="1", reason="its node is being drained", grace=30))
    engine.mode = "die"
    answer = await gw.chat()
    assert answer.status == 503, answer.text
    error = answer.json["error"]
    assert error["message"] == (
        "The replica r1 was stopped: its drain grace of 30 s ran out (its node is being drained)."
    )
    assert error["code"] == "replica_stopped"


async def test_a_replica_seen_stopping_is_still_named_after_it_left_the_tables(gw: Gateway, engine: MockEngine) -> None:
    # Its row is released as soon as its engine has stopped, which may reach this process before
    # the broken stream does.
    stopping(gw, Stopped(replica="1", reason="the model was scaled down", grace=120))
    stopping(gw)
    engine.mode = "die"
    answer = await gw.chat(stream=True)
    assert json.loads(sse_events(answer.text)[-1][1])["error"]["message"] == (
        "the replica r1 was stopped: its drain grace of 120 s ran out (the model was scaled down)"
    )


async def test_a_stream_of_a_replica_not_stopping_that_breaks_says_the_upstream_broke(
    gw: Gateway, engine: MockEngine
) -> None:
    stopping(gw, Stopped(replica="2", reason="the model was scaled down", grace=120))  # another one
    engine.mode = "die"
    answer = await gw.chat(stream=True)
    assert json.loads(sse_events(answer.text)[-1][1])["error"]["message"].startswith("the upstream stream broke: ")


async def test_a_stopping_gateway_finishes_its_streams_and_ends_one_still_running_after_the_grace_naming_it(
    gw: Gateway, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from django.conf import settings

    monkeypatch.setattr(settings, "DRAIN_GRACE", 1)
    monkeypatch.setattr(http_protocol, "ON_SHUTDOWN", [gw.app.begin_stop])
    # The gateway served by uvicorn with llmgw's own protocol, as `llmgw web` serves it.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(
        gw.app, lifespan="off", log_config=None, http=http_protocol.HttpProtocol, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(WAIT):
        while not server.started:
            await asyncio.sleep(0.005)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"Authorization": "Bearer llmgw_edge_test_key"}

    async def ask(mode: str) -> str:
        async with gw.client.post(url + "/v1/chat/completions", json={**body, "mock": mode}, headers=headers) as answer:
            return await answer.text()

    engine.hold = asyncio.Event()
    finishing = asyncio.create_task(ask("ok"))  # held until we let it go, well within the grace
    hanging = asyncio.create_task(ask("hang"))  # never ends by itself
    async with asyncio.timeout(WAIT):
        while engine.active < 2:
            await asyncio.sleep(0.005)
    server.should_exit = True
    async with asyncio.timeout(WAIT):
        while gw.app._stop_timer is None:
            await asyncio.sleep(0.005)
    engine.hold.set()
    assert (await finishing).rstrip().endswith("data: [DONE]")
    cut = json.loads(sse_events(await hanging)[-1][1])["error"]["message"]
    assert cut == "the gateway was stopped: its drain grace of 1 s ran out (this llmgw web process is stopping)"
    await serving
