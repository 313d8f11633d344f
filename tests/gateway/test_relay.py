"""The stream relay on its own: an engine's chat stream, fed in pieces cut anywhere, and what the
client receives; and prefix affinity through the whole gateway."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from apps.gateway.intake import CHAT, COMPLETIONS, MESSAGES, Call
from apps.gateway.relay import StreamRelay, translator_for
from tests.gateway.harness import KEY, WAIT, Gateway, endpoint, held, route, sse_events, until
from tests.gateway.mock_engine import MockEngine


def chunk(
    content: str | None = None,
    *,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
    choices: bool = True,
    text: str | None = None,
) -> dict[str, Any]:
    data: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": []}
    if choices:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if text is not None:
            choice["text"] = text
        else:
            choice["delta"] = {"content": content} if content is not None else {}
        data["choices"] = [choice]
    if usage is not None:
        data["usage"] = usage
    return data


def engine_stream(*chunks: dict[str, Any], done: bool = True) -> bytes:
    out = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
STREAM = engine_stream(chunk("a"), chunk("b"), chunk("c"), chunk(finish="stop"), chunk(choices=False, usage=USAGE))


def relay(
    stream: bytes,
    *,
    wants_usage: bool = False,
    endpoint_: Any = CHAT,
    seed: int = 0,
    body: dict[str, Any] | None = None,
) -> tuple[str, Call]:
    """Feed the stream to a relay in random pieces; the client's text and the call."""
    call = Call(endpoint_)
    call.model = "m"
    call.original = body or {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    call.client_wants_usage = wants_usage
    relayed = StreamRelay(call, translator_for(call))
    rng = random.Random(seed)
    out = [relayed.start()]
    position = 0
    while position < len(stream):
        step = rng.randint(1, 40)
        out.append(relayed.feed(stream[position : position + step]))
        position += step
    out.append(relayed.end(None))
    return b"".join(out).decode(), call


@pytest.mark.parametrize("seed", range(10))
def test_pieces_cut_anywhere_give_the_same_stream_without_the_usage_chunk_nobody_asked_for(seed: int) -> None:
    text, call = relay(STREAM, seed=seed)
    events = sse_events(text)
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _name, data in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "abc"
    assert all(c["choices"] and "usage" not in c for c in chunks)
    assert call.counter is not None and call.counter.usage.output_tokens == 3


@pytest.mark.parametrize("seed", range(5))
def test_a_client_that_asked_for_usage_gets_usage_null_on_every_chunk_then_the_usage(seed: int) -> None:
    text, _call = relay(STREAM, wants_usage=True, seed=seed)
    chunks = [json.loads(data) for _name, data in sse_events(text)[:-1]]
    assert [c["usage"] for c in chunks[:-1]] == [None] * 4
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE


def test_a_completions_chunk_with_choices_and_usage_is_split_in_two_for_a_client_that_asked() -> None:
    stream = engine_stream(chunk(text="x"), chunk(text="", finish="length", usage=USAGE))
    text, _call = relay(stream, wants_usage=True, endpoint_=COMPLETIONS)
    chunks = [json.loads(data) for _name, data in sse_events(text)[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["x", ""]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == USAGE
    plain, _call = relay(stream, endpoint_=COMPLETIONS)
    assert all("usage" not in json.loads(data) for _name, data in sse_events(plain)[:-1])


def test_a_stream_the_engine_cuts_short_ends_with_an_error_and_a_502() -> None:
    text, call = relay(engine_stream(chunk("a"), done=False))
    last = json.loads(sse_events(text)[-1][1])
    assert last["error"]["type"] == "api_error"
    assert call.status == 502


def test_crlf_line_ends_and_keep_alive_comments_are_read_and_passed_on() -> None:
    stream = b": keep-alive\r\n\r\n" + STREAM.replace(b"\n\n", b"\r\n\r\n")
    text, _call = relay(stream, seed=3)
    assert text.startswith(": keep-alive\n\n")
    assert sse_events(text)[-1] == (None, "[DONE]")


@pytest.mark.parametrize("seed", range(5))
def test_an_anthropic_client_gets_its_events_with_the_stop_sequence_the_engine_matched(seed: int) -> None:
    finish = chunk(finish="stop")
    finish["__verbose"] = {"stop_type": "word", "stopping_word": "END"}
    stream = engine_stream(chunk("a"), chunk("b"), finish, chunk(choices=False, usage=USAGE))
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["END"]}
    text, _call = relay(stream, endpoint_=MESSAGES, seed=seed, body=body)
    names = [name for name, _data in sse_events(text)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    delta = next(json.loads(data) for name, data in sse_events(text) if name == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert "__verbose" not in text


# Prefix affinity through the gateway ---------------------------------------------------------------------


def conversation(system: str, turns: int) -> list[dict[str, Any]]:
    """The messages of a conversation's turn number `turns`: every earlier question and answer, then a new one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}"})
        messages.append({"role": "assistant", "content": f"answer {turn}"})
    messages.append({"role": "user", "content": f"question {turns}"})
    return messages


async def test_the_turns_of_one_conversation_reach_one_replica(gw: Gateway, engine: MockEngine) -> None:
    gw.set_models(route("m", [endpoint(engine.url, str(i), slots=4) for i in range(3)]))
    homes: dict[int, set[str]] = {}
    for turn in range(5):
        for talk in range(6):
            answer = await gw.chat(messages=conversation(f"You are assistant number {talk}. " * 40, turn))
            assert answer.status == 200
            homes.setdefault(talk, set()).add(answer.headers["x-llmgw-replica"])
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert len(set().union(*homes.values())) > 1  # and the conversations are spread over the replicas


async def test_a_conversation_whose_replica_is_full_is_moved_to_another(gw: Gateway, engine: MockEngine) -> None:
    replicas = [endpoint(engine.url, str(i), slots=2) for i in range(2)]
    gw.set_models(route("m", replicas))
    messages = conversation("A long shared system prompt. " * 40, 0)
    home = (await gw.chat(messages=messages)).headers["x-llmgw-replica"]
    engine.gate = asyncio.Event()  # hold what comes next
    held_requests = [asyncio.create_task(gw.chat(messages=messages)) for _ in range(2)]
    await until(lambda: sum(held(u) for u in replicas) == 2)
    # Two turns of the conversation hold its home's two slots; the next turn is served elsewhere.
    assert {f"m/{u.id}" for u in replicas if held(u) == 2} == {home}
    moved = asyncio.create_task(gw.chat(messages=messages))
    await until(lambda: sum(held(u) for u in replicas) == 3)
    engine.gate.set()
    async with asyncio.timeout(WAIT):
        answers = await asyncio.gather(*held_requests, moved)
    assert answers[-1].status == 200 and answers[-1].headers["x-llmgw-replica"] != home


async def test_a_client_that_reads_done_finds_the_replicas_slot_already_free(gw: Gateway, engine: MockEngine) -> None:
    gw.set_models(route("m", [endpoint(engine.url, "1", slots=1)]))
    engine.linger = 0.3  # the engine closes its stream a moment after its [DONE]

    for _turn in range(3):
        async with gw.client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as response:
            text = b""
            while not text.endswith(b"data: [DONE]\n\n"):
                text += await response.content.readuntil(b"\n\n")
            # The moment the client has [DONE], the one slot is free for its next turn.
            assert held(gw.endpoint) == 0
