"""Adversarial prompts and answers through one web process do not hold up anyone else.

The gateway runs for real (uvicorn, the harness's tables in memory) and, beside it on one port as
in production, Django for /healthz. The policies are the campaign's: expressions that made the old
engine backtrack for seconds on a few dozen characters, every detector and terms (redacting). Long
texts are matched in the guard's threads: while those are taken (each by a job that waits for the
test, which stands for a long match), an adversarial prompt and an answer with a long adversarial
chunk wait their turn, and meanwhile /healthz, the model list and another client's chat are
answered. Then the long ones finish, their cards and codenames masked. No time is measured: the
p99 of other clients under such load is bench/guardrails.py --noisy's to measure.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import uvicorn

from apps.gateway import guard
from apps.gateway.tables import Guards
from apps.guardrails.engine import DETECTORS, MASK, RuleSpec
from tests.gateway.harness import KEY, WAIT, Gateway, sse_events
from tests.gateway.mock_engine import MockEngine

CARD = "4111 1111 1111 1111"
PATTERNS = ("(a|a?)+b", "(a{1,30})+b", "(.*a){12}x", ".*a.*a.*a.*a.*a.*x", r"(?:\wb|ab)+c", r"\d+\d+\d+\d+x")
RULES = [
    *(RuleSpec("campaign", f"pattern {i}", "regex", "log", pattern=p) for i, p in enumerate(PATTERNS)),
    *(RuleSpec("campaign", name, "detector", "redact", detector=name) for name in DETECTORS),
    RuleSpec("campaign", "codename", "terms", "redact", terms=("Project Falcon",)),
]
ADVERSARIAL = "a" * 40 + " "  # what kept the old output guard busy for over 20 s


@pytest.fixture
async def web(gw: Gateway) -> AsyncIterator[str]:
    """The gateway and Django on one port, as llmgw/asgi.py serves them."""
    from llmgw.asgi import django_app

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            await gw.app(scope, receive, send)
        else:
            await django_app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    async with asyncio.timeout(WAIT):
        while not server.started:
            await asyncio.sleep(0.005)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    await serving


class TakenThreads:
    """Every thread of the guard's pool taken by a job that waits until `release()`."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.jobs = [guard._guard_executor().submit(self.gate.wait) for _ in range(guard.GUARD_THREADS)]

    def release(self) -> None:
        self.gate.set()


async def chat(session: aiohttp.ClientSession, url: str, text: str, *, stream: bool = False) -> tuple[int, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": text}], "stream": stream}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        return r.status, await r.text()


def streamed_text(raw: str) -> str:
    text = ""
    for _event, data in sse_events(raw):
        if data and data != "[DONE]":
            for choice in json.loads(data).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return text


async def test_long_adversarial_texts_wait_for_the_guards_threads_while_other_requests_are_answered(
    gw: Gateway, engine: MockEngine, web: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)
    monkeypatch.setattr(guard, "HEAVY_CHARS", 10**9)  # the threads' turn (test_heavy_prompts: the processes')
    long_prompt = ADVERSARIAL * 2_000 + f"pay with {CARD}, re Project\nFalcon"
    assert len(long_prompt) >= guard.OFF_LOOP_CHARS
    taken = TakenThreads()
    try:
        async with aiohttp.ClientSession() as session:
            prompt = asyncio.create_task(chat(session, web, long_prompt))
            engine.pieces = ["Sure. ", ADVERSARIAL * 1_000 + f"the card is {CARD}.", " Done."]
            answer = asyncio.create_task(chat(session, web, "tell me", stream=True))
            async with asyncio.timeout(WAIT):
                while not engine.seen:  # the answer's request reached the engine: its long chunk is coming
                    await asyncio.sleep(0.01)
            # The long prompt and the long chunk wait for a thread; everyone else is answered.
            async with session.get(f"{web}/healthz") as health:
                assert health.status == 200 and (await health.json()) == {"status": "ok"}
            async with session.get(f"{web}/v1/models", headers={"Authorization": f"Bearer {KEY}"}) as models:
                assert models.status == 200
            engine.pieces = None
            status, body = await chat(session, web, "a short question about project falcon")
            assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "Hello there"
            assert len(engine.seen) == 2  # the long prompt has not reached the engine
            assert engine.seen[-1].body["messages"][0]["content"] == f"a short question about {MASK}"
            assert not prompt.done() and not answer.done()
            taken.release()
            async with asyncio.timeout(WAIT * 4):
                (prompt_status, _prompt_body), (answer_status, raw) = await asyncio.gather(prompt, answer)
    finally:
        taken.release()
    assert prompt_status == 200 and answer_status == 200
    sent = next(s.body for s in engine.seen if len(str(s.body)) > guard.OFF_LOOP_CHARS)
    assert sent["messages"][0]["content"].endswith(f"pay with {MASK}, re {MASK}")
    assert streamed_text(raw) == "Sure. " + ADVERSARIAL * 1_000 + f"the card is {MASK}. Done."


async def test_many_adversarial_prompts_at_once_are_all_checked_and_others_answered(
    gw: Gateway, engine: MockEngine, web: str
) -> None:
    gw.app.tables.guards = Guards(everyone=RULES)
    # (The mock engine takes a body of at most 1 MB.)
    texts = [ADVERSARIAL * 5_000 + f"card {CARD}", "1234 " * 40_000 + "x", "a@" * 100_000, "ş" * 100_000]
    async with aiohttp.ClientSession() as session:
        noisy = [asyncio.create_task(chat(session, web, text)) for text in texts for _ in range(2)]
        others = []
        for _ in range(10):
            async with session.get(f"{web}/healthz") as health:
                others.append(health.status)
            status, _body = await chat(session, web, "hello")
            others.append(status)
        async with asyncio.timeout(WAIT * 12):
            done = await asyncio.gather(*noisy)
    assert others == [200] * 20
    assert [status for status, _body in done] == [200] * len(noisy)
    redacted = [s.body["messages"][0]["content"] for s in engine.seen if str(s.body).count("card")]
    assert redacted and all(content.endswith(f"card {MASK}") for content in redacted)
