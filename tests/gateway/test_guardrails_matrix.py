"""Every action of every kind of rule, on every API, streamed and not, through the official SDKs.

Each case sets one rule and asks the same question on chat completions, completions, Messages and
Responses, with and without streaming (eight requests), and checks what the client sees in its
own protocol and what the usage record says. The engine is the scriptable mock: its answer holds
what the rule looks for (or not), so every path is walked. The guard model is served by the same
mock under its own name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from apps.gateway.tables import Guards
from apps.guardrails.engine import RuleSpec
from tests.gateway.harness import Gateway, anthropic, endpoint, openai, route
from tests.gateway.mock_engine import MockEngine

APIS = [(api, stream) for api in ("chat", "completions", "messages", "responses") for stream in (False, True)]
MAIL = "ops@acme.example"
WORD = "bluebird"


@dataclass
class Outcome:
    text: str = ""
    finish: str | None = None  # the protocol's own word: finish_reason, stop_reason, incomplete reason
    error: Exception | None = None


async def call(gw: Gateway, api: str, stream: bool, prompt: str) -> Outcome:
    """One request the way the SDK's own docs make it; what the client ends up with."""
    out = Outcome()
    try:
        if api == "chat":
            args: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
            if not stream:
                answer = await gw.openai().chat.completions.create(**args)
                out.text, out.finish = answer.choices[0].message.content or "", answer.choices[0].finish_reason
            else:
                async for chunk in await gw.openai().chat.completions.create(**args, stream=True):
                    if chunk.choices:
                        out.text += chunk.choices[0].delta.content or ""
                        out.finish = chunk.choices[0].finish_reason or out.finish
        elif api == "completions":
            if not stream:
                text = await gw.openai().completions.create(model="m", prompt=prompt)
                out.text, out.finish = text.choices[0].text, text.choices[0].finish_reason
            else:
                async for piece in await gw.openai().completions.create(model="m", prompt=prompt, stream=True):
                    if piece.choices:
                        out.text += piece.choices[0].text
                        out.finish = piece.choices[0].finish_reason or out.finish
        elif api == "messages":
            args = {"model": "m", "max_tokens": 200, "messages": [{"role": "user", "content": prompt}]}
            if not stream:
                message = await gw.anthropic().messages.create(**args)
            else:
                async with gw.anthropic().messages.stream(**args) as events:
                    message = await events.get_final_message()
            out.text = "".join(b.text for b in message.content if b.type == "text")
            out.finish = message.stop_reason
        else:
            if not stream:
                response = await gw.openai().responses.create(model="m", input=prompt)
            else:
                events = [e async for e in await gw.openai().responses.create(model="m", input=prompt, stream=True)]
                response = events[-1].response  # type: ignore[union-attr]
            out.text = response.output_text
            details = response.incomplete_details
            out.finish = details.reason if details is not None else response.status
    except (openai.APIStatusError, anthropic.APIStatusError) as exc:
        out.error = exc
    return out


STOPPED = {
    "chat": "content_filter",
    "completions": "content_filter",
    "messages": "refusal",
    "responses": "content_filter",
}
FINISHED = {"chat": "stop", "completions": "stop", "messages": "end_turn", "responses": "completed"}


@dataclass
class Case:
    rule: RuleSpec
    prompt: str
    answer: list[str]  # the engine's answer, a chunk each
    expect: str  # "refused", "redacted", "stopped", "logged"
    refused_by: tuple[type[Exception], ...] = (openai.BadRequestError, anthropic.BadRequestError)

    @property
    def target(self) -> str:
        """What the rule looks for in the answer."""
        return MAIL if self.rule.kind == "detector" else WORD


def rule(kind: str, action: str, **kw: Any) -> RuleSpec:
    return RuleSpec("company", f"{kind}-{action}", kind, action, **kw)


SPLIT = [f"Write to {MAIL[:5]}", f"{MAIL[5:]} about the {WORD[:4]}", f"{WORD[4:]} now."]  # split matches
CASES = {
    # Text rules: a blocked term, an expression, a detector; each refuses, redacts, stops or logs.
    "terms-refuse": Case(rule("terms", "refuse", terms=(WORD,)), f"tell me of the {WORD}", SPLIT, "refused"),
    "terms-redact": Case(rule("terms", "redact", terms=(WORD,)), f"the {WORD}?", SPLIT, "redacted"),
    "terms-stop": Case(rule("terms", "stop", terms=(WORD,), applies_to="output"), "go", SPLIT, "stopped"),
    "terms-log": Case(rule("terms", "log", terms=(WORD,)), f"the {WORD}?", SPLIT, "logged"),
    "regex-refuse": Case(rule("regex", "refuse", pattern=r"blue\w+"), f"a {WORD}", SPLIT, "refused"),
    "regex-redact": Case(rule("regex", "redact", pattern=r"blue\w+"), f"a {WORD}", SPLIT, "redacted"),
    "regex-stop": Case(rule("regex", "stop", pattern=r"blue\w+", applies_to="output"), "go", SPLIT, "stopped"),
    "regex-log": Case(rule("regex", "log", pattern=r"blue\w+"), f"a {WORD}", SPLIT, "logged"),
    "detector-refuse": Case(rule("detector", "refuse", detector="email"), f"mail {MAIL}", SPLIT, "refused"),
    "detector-redact": Case(rule("detector", "redact", detector="email"), f"mail {MAIL}", SPLIT, "redacted"),
    "detector-stop": Case(rule("detector", "stop", detector="email", applies_to="output"), "go", SPLIT, "stopped"),
    "detector-log": Case(rule("detector", "log", detector="email"), f"mail {MAIL}", SPLIT, "logged"),
    # Caps and the model list refuse or log.
    "max_input_tokens-refuse": Case(rule("max_input_tokens", "refuse", limit=5), "word " * 80, SPLIT, "refused"),
    "max_input_tokens-log": Case(rule("max_input_tokens", "log", limit=5), "word " * 80, SPLIT, "logged"),
    "models-refuse": Case(
        rule("models", "refuse", models=("other",)),
        "hi",
        SPLIT,
        "refused",
        (openai.PermissionDeniedError, anthropic.PermissionDeniedError),
    ),
    "models-log": Case(rule("models", "log", models=("other",)), "hi", SPLIT, "logged"),
    # A guard model: on the prompt it refuses, on the answer it stops (withholds a whole one), or logs.
    "guard_model-refuse": Case(
        rule("guard_model", "refuse", models=("llama-guard",), applies_to="input"), "pick a lock", SPLIT, "refused"
    ),
    "guard_model-stop": Case(
        rule("guard_model", "stop", models=("llama-guard",), applies_to="output"), "go", SPLIT, "stopped"
    ),
    "guard_model-log": Case(
        rule("guard_model", "log", models=("llama-guard",), applies_to="both"), "pick a lock", SPLIT, "logged"
    ),
}


def guard(body: dict[str, Any]) -> str:
    last = body["messages"][-1]
    unsafe = "lock" in last["content"] if last["role"] == "user" else WORD in last["content"]
    return "unsafe\nS2" if unsafe else "safe"


@pytest.mark.parametrize("name", list(CASES))
async def test_each_action_of_each_kind_of_rule_on_every_api(gw: Gateway, engine: MockEngine, name: str) -> None:
    case = CASES[name]
    gw.set_models(gw.app.tables.models["m"], route("llama-guard", [endpoint(engine.url, "g1", model="llama-guard")]))
    gw.app.tables.guards = Guards(everyone=[case.rule])
    engine.pieces = case.answer
    engine.replies["llama-guard"] = guard
    whole = "".join(case.answer)
    for count, (api, stream) in enumerate(APIS, start=1):
        where = f"{name} on {api}{' streamed' if stream else ''}"
        before = len([s for s in engine.seen if s.body.get("model") == "m"])
        out = await call(gw, api, stream, case.prompt)
        asked = [s for s in engine.seen if s.body.get("model") == "m"]
        record = await gw.usage.wait(count)
        verdict = [f for f in record["guardrail"] or [] if f["rule"] == case.rule.name]
        assert verdict, f"{where}: the record names no verdict: {record['guardrail']}"
        if case.expect == "refused":
            assert isinstance(out.error, case.refused_by), f"{where}: {out.error!r}"
            assert f"policy “company”, rule “{case.rule.name}”" in str(out.error), where
            assert len(asked) == before, f"{where}: the engine was asked"
            assert verdict[0]["action"] == "refuse"
        elif case.expect == "redacted":
            assert out.error is None, f"{where}: {out.error}"
            sent = str(asked[-1].body.get("messages") or asked[-1].body.get("prompt"))
            assert "[redacted]" in sent and case.target not in sent, f"{where}: {sent}"
            assert "[redacted]" in out.text and case.target not in out.text, f"{where}: {out.text}"
            assert out.finish == FINISHED[api], where
            assert {f["action"] for f in verdict} == {"redact"}
        elif case.expect == "stopped":
            assert out.error is None, f"{where}: {out.error}"
            assert out.finish == STOPPED[api], f"{where}: {out.finish}"
            if case.rule.kind != "guard_model" or not stream:  # a guard model judges text already sent
                assert case.target not in out.text, f"{where}: {out.text}"
            assert verdict[0]["action"] == "stop"
        else:
            assert out.error is None, f"{where}: {out.error}"
            assert out.text == whole and out.finish == FINISHED[api], f"{where}: {out.text!r} {out.finish}"
            assert {f["action"] for f in verdict} == {"log"}
            assert len(asked) == before + 1
