"""What an engine is sent: the request's body as UTF-8 JSON, whatever it holds that parse_body let in."""

from __future__ import annotations

from tests.gateway.harness import HELLO, Gateway
from tests.gateway.mock_engine import MockEngine


async def test_the_engine_is_sent_the_prompt_as_utf8_not_as_escapes(gw: Gateway, engine: MockEngine) -> None:
    text = "Merhaba dünya, ğüşıöç İÇ 日本語のテキスト \u2028 “quoted” \\ back\\slash\n" * 40
    answer = await gw.chat(model="m", messages=[{"role": "user", "content": text}])
    assert answer.status == 200, answer.text
    seen = engine.seen[-1]
    assert seen.body["messages"][-1]["content"] == text
    assert "Merhaba dünya, ğüşıöç İÇ 日本語のテキスト".encode() in seen.raw
    assert b"\\u" not in seen.raw  # half the bytes a \u-escaped body took for this text


async def test_an_integer_past_64_bits_reaches_the_engine_as_sent(gw: Gateway, engine: MockEngine) -> None:
    answer = await gw.chat(model="m", messages=HELLO, metadata={"run": "a"}, vendor_seed=2**70 + 1)
    assert answer.status == 200, answer.text
    assert engine.seen[-1].body["vendor_seed"] == 2**70 + 1
    assert str(2**70 + 1).encode() in engine.seen[-1].raw
