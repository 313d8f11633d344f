"""Guardrails on every API, with the official OpenAI and Anthropic SDKs, streamed and not.

The gateway runs for real (uvicorn) with its tables in memory; the engine is the scriptable mock,
because what an answer must say for a rule to stop it (a key, a card number split across two
chunks) cannot be asked of a real model. The rules are the engine's own (apps.guardrails.engine).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from apps.gateway import metrics
from apps.gateway.tables import Guards
from apps.guardrails.engine import RuleSpec
from tests.gateway.harness import KEY, WAIT, Gateway, anthropic, openai, sse_events
from tests.gateway.mock_engine import MockEngine

CARD = "4111 1111 1111 1111"
SECRET = "sk-ant-" + "q" * 40


def policies(gw: Gateway, *rules: RuleSpec) -> None:
    gw.app.tables.guards = Guards(everyone=list(rules))


def rule(name: str, kind: str, action: str, **kw: Any) -> RuleSpec:
    return RuleSpec("company", name, kind, action, **kw)


CARDS_REFUSED = rule("no cards", "detector", "refuse", detector="card")
CARDS_MASKED = rule("mask cards", "detector", "redact", detector="card")
KEYS_STOPPED = rule("no keys out", "detector", "stop", detector="api_key", applies_to="output")
CODENAME = rule("codename", "terms", "refuse", terms=("Project Falcon",))


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_a_refused_prompt_gets_an_openai_error_naming_the_policy_and_never_the_match(
    gw: Gateway, engine: MockEngine
) -> None:
    policies(gw, CARDS_REFUSED)
    client = gw.openai()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model="m", messages=ask(f"charge {CARD} now"), stream=stream)
        error = caught.value
        assert error.code == "guardrail_refused"
        assert "policy “company”, rule “no cards”: a payment card number in the prompt" in error.message
        assert CARD not in error.message and "4111" not in str(error.body)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model="m", input=f"my card: {CARD}")
    assert "rule “no cards”" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        await client.completions.create(model="m", prompt=f"card {CARD}")
    assert engine.seen == []  # nothing reached the engine
    record = await gw.usage.wait()
    assert record["guardrail"] == [
        {"policy": "company", "rule": "no cards", "kind": "detector", "action": "refuse", "detector": "card"}
    ]
    assert record["status"] == 400


async def test_a_refused_messages_request_gets_anthropics_error_shape(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, CODENAME)
    client = gw.anthropic()
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(
            model="m", max_tokens=20, messages=[{"role": "user", "content": "status of project falcon?"}]
        )
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "rule “codename”: a blocked term in the prompt" in caught.value.message
    assert engine.seen == []


async def test_redaction_changes_only_what_the_engine_sees_and_says_so(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, CARDS_MASKED)
    client = gw.openai()
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "system", "content": "Be brief."}, *ask("card ４１１１ 1111 1111 1111 ok?")]
    )
    answer = raw.parse()
    assert answer.choices[0].message.content == "Hello there"
    assert raw.headers["x-llmgw-guardrail"] == "redact; company/mask cards"
    sent = engine.seen[-1].body["messages"]
    assert sent == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "card [redacted] ok?"}]
    # The Messages API's prompt too, after its translation (a content block of text).
    await gw.anthropic().messages.create(
        model="m", max_tokens=20, messages=[{"role": "user", "content": [{"type": "text", "text": f"pay {CARD}"}]}]
    )
    assert "[redacted]" in str(engine.seen[-1].body["messages"]) and "4111" not in str(engine.seen[-1].body)


async def test_a_streamed_answer_is_stopped_where_the_secret_begins_and_the_engine_request_cancelled(
    gw: Gateway, engine: MockEngine
) -> None:
    policies(gw, KEYS_STOPPED)
    engine.pieces = ["Here it is: sk-", "ant-" + "q" * 20, "q" * 20, *[" and more"] * 12]
    engine.mode = "hang"  # then the engine would go on: only the gateway's cancel ends it
    stream = await gw.openai().chat.completions.create(
        model="m", messages=ask("the key?"), stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == "Here it is: " and finish == "content_filter"
    assert usage is not None and usage.completion_tokens is not None
    async with asyncio.timeout(WAIT):
        await engine.closed.wait()  # the engine saw its request go away
    record = await gw.usage.wait()
    assert {
        "policy": "company",
        "rule": "no keys out",
        "kind": "detector",
        "action": "stop",
        "detector": "api_key",
    } in (record["guardrail"])


async def test_anthropic_and_responses_streams_end_properly_when_stopped(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, KEYS_STOPPED)
    engine.pieces = ["Sure: ", SECRET[:10], SECRET[10:], " tail"]
    async with gw.anthropic().messages.stream(model="m", max_tokens=50, messages=ask("key?")) as stream:
        async for _event in stream:
            pass
        message = await stream.get_final_message()
    assert message.stop_reason == "refusal"
    assert "".join(block.text for block in message.content if block.type == "text") == "Sure: "
    events = []
    responses = await gw.openai().responses.create(model="m", input="key?", stream=True)
    async for event in responses:
        events.append(event)
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None and last.response.incomplete_details.reason == "content_filter"
    assert last.response.output_text == "Sure: "


@pytest.mark.parametrize("split", [3, 8, 12, 16, 20])
async def test_a_card_split_across_chunks_is_masked_in_the_stream(gw: Gateway, engine: MockEngine, split: int) -> None:
    policies(gw, rule("mask cards out", "detector", "redact", detector="card", applies_to="output"))
    answer = f"Card {CARD} is on file."
    engine.pieces = [answer[:split], answer[split:]]
    stream = await gw.openai().chat.completions.create(model="m", messages=ask("card?"), stream=True)
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "Card [redacted] is on file."


async def test_a_whole_answer_is_checked_too(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, KEYS_STOPPED, rule("mask cards out", "detector", "redact", detector="card", applies_to="output"))
    engine.pieces = [f"Your card {CARD}. The key: {SECRET} end"]
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("both?"))
    assert answer.choices[0].message.content == "Your card [redacted]. The key: "
    assert answer.choices[0].finish_reason == "content_filter"
    message = await gw.anthropic().messages.create(model="m", max_tokens=50, messages=ask("both?"))
    assert message.stop_reason == "refusal"


async def test_models_and_token_caps(gw: Gateway, engine: MockEngine) -> None:
    policies(
        gw,
        rule("only others", "models", "refuse", models=("other",)),
    )
    with pytest.raises(openai.PermissionDeniedError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("hi"))
    assert "the model “m” is not among those it allows" in caught.value.message
    policies(gw, rule("short answers", "max_output_tokens", "refuse", limit=64))
    await gw.openai().chat.completions.create(model="m", messages=ask("hi"))
    assert engine.seen[-1].body["max_tokens"] == 64  # none asked: the cap is asked for
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("hi"), max_tokens=500)
    assert "500 output tokens asked for, its cap is 64" in caught.value.message
    policies(gw, rule("short prompts", "max_input_tokens", "refuse", limit=10))
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("word " * 200))
    assert "over its cap of 10 tokens" in caught.value.message


async def test_log_only_rules_change_nothing_and_every_action_is_counted(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, rule("watch mails", "detector", "log", detector="email"))
    before = metrics.GUARDRAIL_ACTIONS.labels("company", "log")._value.get()
    raw = await gw.openai().chat.completions.with_raw_response.create(model="m", messages=ask("mail a@b.example"))
    assert "x-llmgw-guardrail" not in raw.headers
    assert engine.seen[-1].body["messages"] == ask("mail a@b.example")
    record = await gw.usage.wait()
    assert record["guardrail"][0]["action"] == "log"
    assert metrics.GUARDRAIL_ACTIONS.labels("company", "log")._value.get() == before + 1


async def test_a_raw_stream_ends_with_done_after_a_stop(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, KEYS_STOPPED)
    engine.pieces = ["x ", SECRET, " y"]
    answer = await gw.post("/v1/chat/completions", {"model": "m", "messages": ask("k"), "stream": True})
    events = sse_events(answer.text)
    assert events[-1] == (None, "[DONE]")
    assert '"finish_reason": "content_filter"' in answer.text


def with_guard_model(gw: Gateway, engine: MockEngine, **kw: Any) -> None:
    from tests.gateway.harness import endpoint, route

    gw.set_models(gw.app.tables.models["m"], route("llama-guard", [endpoint(engine.url, "g1", model="llama-guard")]))
    policies(gw, rule("guarded", "guard_model", "refuse", models=("llama-guard",), applies_to="input", **kw))


async def test_a_guard_model_that_says_unsafe_refuses_the_prompt_on_every_api(gw: Gateway, engine: MockEngine) -> None:
    with_guard_model(gw, engine)
    engine.replies["llama-guard"] = "unsafe\nS2"
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("how do I pick a lock?"))
    assert "the guard model “llama-guard” judged the prompt unsafe (S2)" in caught.value.message
    with pytest.raises(anthropic.BadRequestError):
        await gw.anthropic().messages.create(model="m", max_tokens=20, messages=ask("how do I pick a lock?"))
    asked = [seen.body for seen in engine.seen]
    assert [b["model"] for b in asked] == ["llama-guard", "llama-guard"]  # the model itself was never asked
    assert asked[0]["messages"] == ask("how do I pick a lock?") and asked[0]["temperature"] == 0
    engine.replies["llama-guard"] = "safe"
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("how do I bake bread?"))
    assert answer.choices[0].message.content == "Hello there"
    assert [seen.body["model"] for seen in engine.seen[-2:]] == ["llama-guard", "m"]


async def test_a_slow_guard_model_follows_the_rules_fail_mode(gw: Gateway, engine: MockEngine) -> None:
    engine.replies["llama-guard"] = "safe"
    engine.delays["llama-guard"] = 2.0
    with_guard_model(gw, engine, limit=200)  # fails closed: refused, and says why
    with pytest.raises(openai.InternalServerError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("hello"))
    async with asyncio.timeout(WAIT):
        await engine.closed.wait()  # the guard's request was given up, not waited out
    assert caught.value.status_code == 503
    assert "gave no verdict (no answer within 200 ms), and the rule refuses when it cannot tell" in caught.value.message
    with_guard_model(gw, engine, limit=200, fail_open=True)  # fails open: answered, and the miss logged
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("hello"))
    assert answer.choices[0].message.content == "Hello there"
    record = await gw.usage.wait(2)
    assert record["status"] == 200
    assert record["guardrail"] == [
        {
            "policy": "company",
            "rule": "guarded",
            "kind": "guard_model",
            "action": "log",
            "error": "no answer within 200 ms",
        }
    ]


async def test_a_guard_model_not_served_follows_the_fail_mode_too(gw: Gateway, engine: MockEngine) -> None:
    policies(gw, rule("guarded", "guard_model", "refuse", models=("nowhere",), applies_to="input"))
    with pytest.raises(openai.InternalServerError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("hello"))
    assert "“nowhere” is not in the catalog" in caught.value.message


def judge_answers(body: dict[str, Any]) -> str:
    """A guard model that finds an answer about poison unsafe (the answer is the conversation's last
    turn, the assistant's) and every prompt safe."""
    turns = body["messages"]
    if turns[-1]["role"] == "assistant" and "poison" in turns[-1]["content"]:
        return "unsafe\nS9"
    return "safe"


def guard_answers(gw: Gateway, engine: MockEngine, action: str = "stop", **kw: Any) -> None:
    from tests.gateway.harness import endpoint, route

    gw.set_models(gw.app.tables.models["m"], route("llama-guard", [endpoint(engine.url, "g1", model="llama-guard")]))
    policies(gw, rule("judged", "guard_model", action, models=("llama-guard",), applies_to="output", **kw))
    engine.replies["llama-guard"] = judge_answers


STOPPED_BY_JUDGE = {"policy": "company", "rule": "judged", "kind": "guard_model", "action": "stop", "where": "answer"}


async def test_a_guard_model_judges_a_whole_answer_and_an_unsafe_one_is_withheld(
    gw: Gateway, engine: MockEngine
) -> None:
    guard_answers(gw, engine)
    engine.pieces = ["Mix the poison ", "into the soup."]
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("a recipe?"))
    assert answer.choices[0].message.content == ""
    assert answer.choices[0].finish_reason == "content_filter"
    judged = [seen.body for seen in engine.seen if seen.body["model"] == "llama-guard"]
    said = {"role": "assistant", "content": "Mix the poison into the soup."}
    assert judged[-1]["messages"] == [*ask("a recipe?"), said]
    record = await gw.usage.wait()
    assert record["guardrail"] == [STOPPED_BY_JUDGE]
    message = await gw.anthropic().messages.create(model="m", max_tokens=50, messages=ask("a recipe?"))
    assert message.stop_reason == "refusal" and not [b for b in message.content if b.type == "text" and b.text]
    response = await gw.openai().responses.create(model="m", input="a recipe?")
    assert response.status == "incomplete" and response.output_text == ""
    assert response.incomplete_details is not None and response.incomplete_details.reason == "content_filter"
    engine.pieces = ["Knead the dough."]  # a safe answer is returned as it is
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("a recipe?"))
    assert answer.choices[0].message.content == "Knead the dough." and answer.choices[0].finish_reason == "stop"


async def test_a_streamed_answer_ends_with_the_guard_models_verdict_on_every_api(
    gw: Gateway, engine: MockEngine
) -> None:
    guard_answers(gw, engine)
    engine.pieces = ["Mix the poison ", "into the soup."]
    stream = await gw.openai().chat.completions.create(
        model="m", messages=ask("a recipe?"), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["content_filter"]  # the engine's own "stop" never reached the client
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2  # what the engine said
    async with gw.anthropic().messages.stream(model="m", max_tokens=50, messages=ask("a recipe?")) as events:
        message = await events.get_final_message()
    assert message.stop_reason == "refusal"
    responses = [event async for event in await gw.openai().responses.create(model="m", input="r?", stream=True)]
    assert responses[-1].type == "response.incomplete"
    assert responses[-1].response.incomplete_details.reason == "content_filter"  # type: ignore[union-attr]
    raw = await gw.post("/v1/chat/completions", {"model": "m", "messages": ask("r?"), "stream": True})
    events = sse_events(raw.text)
    assert events[-1] == (None, "[DONE]") and '"llmgw_guardrail": {"policy": "company", "rule": "judged"' in raw.text
    engine.pieces = ["Knead ", "the dough."]
    stream = await gw.openai().chat.completions.create(model="m", messages=ask("bread?"), stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Knead the dough."
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_long_streamed_answer_is_judged_as_it_goes_and_stopped_with_the_engine_cancelled(
    gw: Gateway, engine: MockEngine
) -> None:
    guard_answers(gw, engine)
    engine.pieces = ["Take the poison. ", *["And so on and on. "] * 60]  # 1,097 characters
    engine.mode = "hang"  # then the engine goes on without end: only the verdict on what came ends it
    stream = await gw.openai().chat.completions.create(model="m", messages=ask("go on"), stream=True)
    text, finish = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "content_filter"
    assert text.startswith("Take the poison.") and len(text) >= 1000  # judged once 1,000 had passed
    async with asyncio.timeout(WAIT):
        await engine.closed.wait()
    record = await gw.usage.wait()
    assert STOPPED_BY_JUDGE in record["guardrail"]


async def test_a_guard_model_that_cannot_judge_an_answer_follows_the_fail_mode(gw: Gateway, engine: MockEngine) -> None:
    guard_answers(gw, engine, limit=200)
    engine.delays["llama-guard"] = 2.0
    engine.pieces = ["Knead the dough."]
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("bread?"))
    assert answer.choices[0].finish_reason == "content_filter"  # fails closed: withheld
    record = await gw.usage.wait()
    assert record["guardrail"] == [{**STOPPED_BY_JUDGE, "error": "no answer within 200 ms"}]
    guard_answers(gw, engine, limit=200, fail_open=True)
    engine.delays["llama-guard"] = 2.0
    stream = await gw.openai().chat.completions.create(model="m", messages=ask("bread?"), stream=True)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Knead the dough."
    assert chunks[-1].choices[0].finish_reason == "stop"
    record = await gw.usage.wait(2)
    assert record["guardrail"] == [{**STOPPED_BY_JUDGE, "action": "log", "error": "no answer within 200 ms"}]


async def test_a_client_that_leaves_while_the_guard_model_judges_its_prompt_cancels_the_guards_request(
    gw: Gateway, engine: MockEngine
) -> None:
    with_guard_model(gw, engine, limit=30_000)
    engine.replies["llama-guard"] = "safe"
    engine.delays["llama-guard"] = 20.0
    body = {"model": "m", "messages": ask("hello")}

    async def post() -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with gw.client.post(gw.url + "/v1/chat/completions", json=body, headers=headers) as answer:
            await answer.read()

    request = asyncio.create_task(post())
    async with asyncio.timeout(WAIT):
        await engine.arrived.wait()
    request.cancel()  # the client closes its connection
    with contextlib.suppress(asyncio.CancelledError):
        await request
    async with asyncio.timeout(WAIT):
        await engine.closed.wait()  # the guard model's request went away with the client
    record = await gw.usage.wait()
    assert record["status"] == 499
    assert record["error"] == "the client went away while a guard model judged its prompt"
    assert [seen.body["model"] for seen in engine.seen] == ["llama-guard"]  # the model itself was never asked


async def test_a_text_rule_that_stops_the_held_tail_of_a_judged_answer_ends_it_once(
    gw: Gateway, engine: MockEngine
) -> None:
    guard_answers(gw, engine)
    gw.app.tables.guards = Guards(everyone=[KEYS_STOPPED, *gw.app.tables.guards.everyone])
    engine.pieces = ["Short: ", SECRET]  # the key is in the window held back until the end
    body = {"model": "m", "messages": ask("k"), "stream": True, "stream_options": {"include_usage": True}}
    answer = await gw.post("/v1/chat/completions", body)
    events = [data for _name, data in sse_events(answer.text)]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    assert sum('"usage": {' in e for e in events) == 1
    assert '"finish_reason": "content_filter"' in answer.text and "sk-ant" not in answer.text


async def test_a_logging_guard_rule_that_cannot_judge_never_holds_anything_back(
    gw: Gateway, engine: MockEngine
) -> None:
    with_guard_model(gw, engine, limit=200)
    policies(gw, rule("watch", "guard_model", "log", models=("llama-guard",), applies_to="both", limit=200))
    engine.replies["llama-guard"] = "safe"
    engine.delays["llama-guard"] = 2.0
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("hello"))
    assert answer.choices[0].message.content == "Hello there" and answer.choices[0].finish_reason == "stop"
    record = await gw.usage.wait()
    assert [f["action"] for f in record["guardrail"]] == ["log", "log"]  # the prompt's and the answer's
    assert all(f["error"] == "no answer within 200 ms" for f in record["guardrail"])


async def test_a_request_for_several_answers_is_refused_where_a_guard_model_judges_answers(
    gw: Gateway, engine: MockEngine
) -> None:
    guard_answers(gw, engine)
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("two?"), n=2)
    assert "rule “judged”: a guard model judges each answer here, so one is asked at a time (2 asked)" in (
        caught.value.message
    )
    assert [s.body["model"] for s in engine.seen] == []


async def test_a_rule_that_cannot_run_refuses_what_its_policy_covers_and_a_log_rule_only_notes_it(
    gw: Gateway, engine: MockEngine
) -> None:
    # Saved before expressions were checked by RE2: a look-behind, which RE2 cannot run.
    stale = rule("old pattern", "regex", "redact", pattern="(?<=card )\\d+")
    policies(gw, stale)
    with pytest.raises(openai.InternalServerError) as caught:
        await gw.openai().chat.completions.create(model="m", messages=ask("hello"))
    assert caught.value.status_code == 503 and caught.value.code == "guardrail_invalid"  # type: ignore[attr-defined]
    assert "policy “company”, rule “old pattern”: the rule cannot be applied" in caught.value.message
    assert "“(?<=”, a look-ahead or look-behind" in caught.value.message
    assert engine.seen == []
    record = await gw.usage.wait()
    assert record["guardrail"][0]["action"] == "refuse" and "look-behind" in record["guardrail"][0]["error"]
    policies(gw, rule("old pattern", "regex", "log", pattern="(?<=card )\\d+"), CODENAME)
    answer = await gw.openai().chat.completions.create(model="m", messages=ask("hello"))
    assert answer.choices[0].message.content == "Hello there"
    record = await gw.usage.wait(2)
    assert [(f["rule"], f["action"]) for f in record["guardrail"]] == [("old pattern", "log")]
