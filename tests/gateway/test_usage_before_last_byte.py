"""A request's usage record is emitted (and so, in production, in the process's journal on disk)
before the last byte of its answer is handed to the server: a web process killed the moment a
client has its whole answer has already kept the record. Checked at the ASGI boundary, where the
last message is told by `more_body` being false, for answers, streams and refusals."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.harness import KEY, Gateway, receive_once

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def call(gw: Gateway, body: dict[str, Any], key: str = KEY) -> list[tuple[bool, int]]:
    """Send one request straight to the ASGI app; for each body message, (last?, records emitted)."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        "query_string": b"",
        "client": ("127.0.0.1", 5000),
    }
    seen: list[tuple[bool, int]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            seen.append((not message.get("more_body"), len(gw.usage.records)))

    await gw.app(scope, receive_once(body), send)
    return seen


@pytest.mark.parametrize(
    "body",
    [CHAT, {**CHAT, "stream": True}, {**CHAT, "model": "nope"}, {**CHAT, "messages": "not a list"}],
    ids=["answer", "stream", "no-such-model", "refused-body"],
)
async def test_the_record_is_emitted_before_the_last_byte(gw: Gateway, body: dict[str, Any]) -> None:
    seen = await call(gw, body)
    assert seen and seen[-1][0], seen  # the answer ended with a last message
    assert seen[-1][1] == 1, f"records emitted when the last byte went out: {seen[-1][1]}"
    assert all(count == 0 for last, count in seen if not last)  # and not before the answer was known
    assert len(gw.usage.records) == 1  # once


async def test_a_request_with_no_key_has_no_record_and_still_gets_its_answer(gw: Gateway) -> None:
    seen = await call(gw, CHAT, key="llmgw_not_a_key")
    assert seen == [(True, 0)] and gw.usage.records == []
