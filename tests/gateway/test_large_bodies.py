"""A body of READ_ELSEWHERE_BYTES or more is read as JSON in a guardrails worker process, not on the
event loop, and is answered exactly as it would be read there: the same body reaches the engine,
the same refusal (status, message, code) comes back for a body that is wrong, and with no worker to
be had it is read in place."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from apps.gateway import guard
from apps.gateway.errors import Refused
from apps.gateway.intake import parse_body
from apps.guardrails.offload import Offload, OffloadFailed
from tests.gateway.harness import Gateway
from tests.gateway.mock_engine import MockEngine

PAD = "Merhaba dünya, 日本語のテキスト “quoted” " * 5_500  # ~500 KB escaped as ASCII, ~300 KB as UTF-8


@pytest.fixture
def workers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A pool of one worker, and the names of the functions it was given."""
    pool = Offload(processes=1)
    given: list[str] = []
    run = pool.run

    async def counted(function: Any, *args: Any) -> Any:
        given.append(function.__name__)
        return await run(function, *args)

    monkeypatch.setattr(pool, "run", counted)
    monkeypatch.setattr(guard, "offload", pool)
    yield given
    pool.shutdown()


async def test_a_large_body_is_read_in_a_worker_and_reaches_the_engine_whole(
    gw: Gateway, engine: MockEngine, workers: list[str]
) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": PAD}], "seed": 2**70}
    for data in (json.dumps(chat).encode(), json.dumps(chat, ensure_ascii=False).encode()):
        assert len(data) >= guard.READ_ELSEWHERE_BYTES
        answer = await gw.post("/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
        assert answer.status == 200, answer.text
        assert engine.seen[-1].body["messages"][-1]["content"] == PAD and engine.seen[-1].body["seed"] == 2**70
    assert workers == ["read_json_outcome", "read_json_outcome"]
    small = await gw.chat(model="m", messages=[{"role": "user", "content": "hi"}])
    assert small.status == 200 and workers == ["read_json_outcome", "read_json_outcome"]  # read here


def _wrong_bodies() -> dict[str, bytes]:
    pad = json.dumps(PAD)
    return {
        "not JSON": ('{"model": "m", "messages": [{"role": "user", "content": ' + pad + "}]").encode(),
        "NaN": ('{"model": "m", "temperature": NaN, "pad": ' + pad + "}").encode(),
        "not an object": ("[" + pad + "]").encode(),
        "too deep": ('{"model": "m", "pad": ' + pad + ', "deep": ' + "[" * 100 + "]" * 100 + "}").encode(),
        "lone surrogate": ('{"model": "m", "pad": ' + pad + ', "x": "\\ud800"}').encode(),
    }


@pytest.mark.parametrize("what", list(_wrong_bodies()))
async def test_a_large_wrong_body_is_refused_as_one_read_here_would_be(
    gw: Gateway, workers: list[str], what: str
) -> None:
    data = _wrong_bodies()[what]
    with pytest.raises(Refused) as here:
        parse_body(data)
    answer = await gw.post("/v1/chat/completions", data=data, headers={"Content-Type": "application/json"})
    error = json.loads(answer.text)["error"]
    assert (answer.status, error["message"]) == (here.value.status, here.value.message), answer.text
    assert error.get("code") == here.value.code
    assert workers == ["read_json_outcome"]


async def test_with_no_worker_to_be_had_a_large_body_is_read_in_place(
    gw: Gateway, engine: MockEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def failing(function: Any, *args: Any) -> Any:
        raise OffloadFailed("no worker process could be started")

    monkeypatch.setattr(guard.offload, "run", failing)
    answer = await gw.chat(model="m", messages=[{"role": "user", "content": PAD}])
    assert answer.status == 200, answer.text
    assert engine.seen[-1].body["messages"][-1]["content"] == PAD
