"""Guardrails on the gateway's path: the prompt checked before it reaches an engine, the answer as it
passes (apps.guardrails.engine holds the rules).

On the way in (`check_request`), for every API (chat, completions, embeddings, and Messages and
Responses after their translation to chat): a model the policies do not allow, a prompt over an
input cap, a text a refusing rule matches are refused in the client's own error shape, naming the
policy and the rule, never what matched; a redacting rule masks its matches in the prompt the
engine is sent and nothing else; an output cap lowers the request's max_tokens (or refuses one
asking for more). Every rule that matched is kept on the call for its usage record and metrics.

On the way out (`AnswerGuard`), the engine's chat chunks are rewritten before they are relayed
or translated: each choice's text goes through an OutputGuard, which holds back a short window so
that a match split across chunks is caught whole. A stopping rule ends the answer where the match
begins: the chunk carries finish_reason "content_filter" (Anthropic's stop_reason "refusal",
Responses' incomplete with reason content_filter, by the translators), and the gateway stops
reading the engine, which cancels its request.

A policy set with a rule that cannot run (see apps.guardrails.engine: an expression RE2 refuses,
saved before it was checked so) fails closed: every request it covers is refused with 503
`guardrail_invalid`, naming the policy, the rule and why, unless the rule only logs, which cannot
change a request: then the request goes on and its usage record notes the miss.

Refusals name what a rule found in words (`describe`), never what it matched, and are written in
the site's language (LLMGW_LANGUAGE), as the gateway's other refusals are: /v1 runs outside
Django's middleware, so no language is activated per request.

Matching is linear in the text, but a long text still takes time: a prompt of OFF_LOOP_CHARS
characters or more, an engine's whole answer or streamed chunk of as many bytes, is handled in the
guard's own threads (`run_checked`), never on the event loop. RE2 releases the interpreter's lock
while it scans, but the folding and the checks of candidates are Python: a thread doing them makes
the event loop wait for the lock each time it gives it up, up to the switch interval (5 ms) each
time. So the texts a guard's thread matches of ELSEWHERE_CHARS or more are matched in the guard's
worker processes (apps.guardrails.offload), the thread waiting without the lock; and a prompt of
HEAVY_CHARS characters or more goes there straight from the event loop, one prompt of an API key
at a time (`KeyLanes`). The workers run at a lower CPU priority: when the cores are short, a flood
of long texts waits on itself, never the event loop on it. The body such a prompt came in still
costs the loop its reading, parsing and forwarding (a few milliseconds a megabyte).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from apps.gateway.errors import Refused
from apps.gateway.intake import parse_body, refused
from apps.gateway.jsonbody import NotAccepted, read_json_outcome
from apps.guardrails.engine import Finding, OutputGuard, PolicySet, Verdict
from apps.guardrails.offload import HEAVY_CHARS, Offload, OffloadFailed

__all__ = [
    "HEAVY_CHARS",
    "OFF_LOOP_CHARS",
    "OFF_LOOP_CHUNK_BYTES",
    "AnswerGuard",
    "GuardJudge",
    "GuardUnavailable",
    "KeyLanes",
    "answer_text",
    "check_prompt",
    "check_request",
    "chunk_text",
    "describe",
    "guard_prompt",
    "prompt_chars",
    "prompt_text",
    "run_checked",
]

# From this many characters of prompt (or bytes of an engine's chunk or answer) on, matching runs in
# the guard's threads. Below it, the built-in detectors and terms cost at most about a millisecond
# even on text made to be their worst (bench/guardrails.py prints the worst it measured), which is
# about what handing the work to a thread and back costs on a busy loop.
OFF_LOOP_CHARS = 1_024
# An engine's streamed chunk is mostly JSON around a few characters of text, and the answer guard
# scans only what a chunk adds: a chunk goes to a thread from this many bytes on.
OFF_LOOP_CHUNK_BYTES = 16_384
# Threads that match long texts: half the cores (at most 4), so that matching never takes every core
# from the event loop and the engines' other work.
GUARD_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


def _guard_executor() -> ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=GUARD_THREADS, thread_name_prefix="llmgw-guard")
        return _executor


class KeyLanes:
    """One long prompt of an API key matched at a time: `async with lanes.lane(key_id)`. The others
    of that key wait in the order they came (how many may wait is bounded by the bodies' memory
    budget, apps.gateway.intake.BodyBudget); another key's long prompt waits for the workers behind
    at most one prompt of each other key, never behind a key's whole flood."""

    def __init__(self) -> None:
        self._locks: dict[Any, asyncio.Lock] = {}
        self._users: dict[Any, int] = {}

    def waiting(self, key: Any) -> int:
        """The long prompts of a key in its lane: the one matched and those waiting."""
        return self._users.get(key, 0)

    @contextlib.asynccontextmanager
    async def lane(self, key: Any) -> AsyncIterator[None]:
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]


lanes = KeyLanes()
offload = Offload()

#: From this many bytes on, a body is read as JSON in a guardrails worker process, one of an API
#: key's at a time (`lanes`), not on the event loop: reading a megabyte of \u-escaped text took
#: the loop 5 ms, against well under one to hand it over and take the result back.
READ_ELSEWHERE_BYTES = 262_144


async def read_large_body(raw: bytes, key: Any) -> dict[str, Any]:
    """`parse_body(raw)` for a large body, read in a worker process; read here when no worker can."""
    async with lanes.lane(key):
        try:
            body, why, code = await offload.run(read_json_outcome, raw)
        except OffloadFailed:
            return parse_body(raw)
    if body is None:
        raise refused(NotAccepted(why, code))
    return body


async def run_checked[T](size: int, function: Callable[..., T], *args: Any, least: int = OFF_LOOP_CHARS) -> T:
    """`function(*args)`, which matches guardrail rules against `size` characters (or bytes) of
    text: in the guard's threads when that is `least` or more, else here."""
    if size < least:
        return function(*args)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_guard_executor(), functools.partial(_matched_elsewhere, function, *args))


def _matched_elsewhere[T](function: Callable[..., T], *args: Any) -> T:
    """`function(*args)` in a guard's thread, its long texts matched in a worker process: the thread
    waits without the interpreter's lock, so the event loop never waits on the matching."""
    with offload.elsewhere():
        return function(*args)


# What a rule found, in words, never what it matched: (in the prompt, in the answer), whole phrases
# so that each language can order its words (by a finding's detector, else by its rule's kind).
WHAT = {
    "terms": (_("a blocked term in the prompt"), _("a blocked term in the answer")),
    "regex": (_("a pattern it blocks in the prompt"), _("a pattern it blocks in the answer")),
    "email": (_("an e-mail address in the prompt"), _("an e-mail address in the answer")),
    "phone": (_("a phone number in the prompt"), _("a phone number in the answer")),
    "card": (_("a payment card number in the prompt"), _("a payment card number in the answer")),
    "iban": (_("an IBAN in the prompt"), _("an IBAN in the answer")),
    "tckn": (_("a Turkish national ID number in the prompt"), _("a Turkish national ID number in the answer")),
    "api_key": (_("an API key or token in the prompt"), _("an API key or token in the answer")),
    "llmgw_key": (_("an llmgw API key in the prompt"), _("an llmgw API key in the answer")),
}
PERSONAL_DATA = (_("personal data in the prompt"), _("personal data in the answer"))
A_MATCH = (_("a match in the prompt"), _("a match in the answer"))


def describe(finding: Finding, where: str = "prompt") -> str:
    """What a rule found, in words, without what it matched (`where`: "prompt" or "answer")."""
    if finding.kind == "detector":
        phrases = WHAT.get(finding.detector, PERSONAL_DATA)
    else:
        phrases = WHAT.get(finding.kind, A_MATCH)
    return str(phrases[1] if where == "answer" else phrases[0])


def _refusal(finding: Finding, reason: str, status: int = 400, kind: str = "invalid_request_error") -> Refused:
    return Refused(
        status,
        gettext("Refused by guardrail policy “%(policy)s”, rule “%(rule)s”: %(reason)s.")
        % {"policy": finding.policy, "rule": finding.rule, "reason": reason},
        kind=kind,
        code="guardrail_refused",
    )


def _text_slots(body: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(container, key) of every text the engine will read: message contents and their text parts, a
    completion's prompt, an embedding's input."""
    slots: list[tuple[Any, Any]] = []
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, str):
            slots.append((message, "content"))
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    slots.append((part, "text"))
    for field in ("prompt", "input"):
        value = body.get(field)
        if isinstance(value, str):
            slots.append((body, field))
        elif isinstance(value, list):
            slots.extend((value, i) for i, item in enumerate(value) if isinstance(item, str))
    return slots


def prompt_chars(body: dict[str, Any]) -> int:
    """How many characters of text the rules read in a request's body."""
    return sum(len(container[key]) for container, key in _text_slots(body))


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt's texts (after redaction) as one, for a guard model to judge."""
    return "\n\n".join(container[key] for container, key in _text_slots(body))


class GuardUnavailable(Exception):
    """A guard model that gave no verdict: not served, busy, slow, failing, or saying neither."""


def guard_prompt(text: str, answer: str | None = None) -> list[dict[str, str]]:
    """What a guard model is asked: the user's turn as it is, and the answer as the assistant's turn
    when the answer is judged (Llama Guard and ShieldGemma take the conversation to judge as their
    input, its last turn the one judged, and answer safe/unsafe, or Yes/No)."""
    turns = [{"role": "user", "content": text}]
    if answer is not None:
        turns.append({"role": "assistant", "content": answer})
    return turns


def answer_text(data: dict[str, Any]) -> str:
    """A whole chat (or completions) answer's first choice's text."""
    choices = data.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = choice.get("message")
    text = message.get("content") if isinstance(message, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def chunk_text(data: dict[str, Any]) -> str:
    """The text a chat (or completions) chunk adds to its first choice."""
    text = ""
    for choice in data.get("choices") or []:
        if isinstance(choice, dict) and choice.get("index", 0) == 0:
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            text += piece if isinstance(piece, str) else ""
    return text


def guard_refusal(finding: Finding, model: str, answer: str) -> Refused:
    lines = answer.strip().splitlines()
    categories = lines[1].strip() if len(lines) > 1 else ""
    if categories:  # Llama Guard names the categories it found on its second line ("S2")
        reason = gettext("the guard model “%(model)s” judged the prompt unsafe (%(categories)s)") % {
            "model": model,
            "categories": categories,
        }
    else:
        reason = gettext("the guard model “%(model)s” judged the prompt unsafe") % {"model": model}
    return _refusal(finding, reason)


def guard_unavailable(finding: Finding, model: str, why: str) -> Refused:
    return Refused(
        503,
        gettext(
            "Refused by guardrail policy “%(policy)s”, rule “%(rule)s”: the guard model “%(model)s” gave no "
            "verdict (%(why)s), and the rule refuses when it cannot tell."
        )
        % {"policy": finding.policy, "rule": finding.rule, "model": model, "why": why},
        kind="api_error",
        code="guardrail_unavailable",
    )


def _estimate_tokens(texts: list[str]) -> int:
    return sum(len(text) for text in texts) // 4 + 1


def _check_broken(call: Any, policies: PolicySet) -> None:
    """Refuse a request a rule that cannot run would have checked (a rule that only logs is noted)."""
    for item in policies.broken:
        rule = item.rule
        finding = Finding(rule.policy, rule.name, rule.kind, rule.action, detector=rule.detector)
        closed = rule.action != "log"
        call.guard.append({**finding.to_dict(), "action": "refuse" if closed else "log", "error": str(item.problem)})
        if closed:
            problem = gettext(item.problem.template) % item.problem.params
            raise Refused(
                503,
                gettext(
                    "Refused by guardrail policy “%(policy)s”, rule “%(rule)s”: the rule cannot be applied "
                    "(%(problem)s), so the requests its policy covers are refused until an administrator "
                    "corrects it."
                )
                % {"policy": rule.policy, "rule": rule.name, "problem": problem},
                kind="api_error",
                code="guardrail_invalid",
            )


def check_request(call: Any, policies: PolicySet) -> None:
    """Apply the policies to the request on its way in (see the module docstring). Every rule that
    matched is on `call.guard` as it is found, so a refusal's record names it too."""
    check_before_texts(call, policies)
    slots = _text_slots(call.body)
    check_after_texts(call, policies, slots, *policies.check_texts([container[key] for container, key in slots]))


async def check_prompt(call: Any, policies: PolicySet) -> None:
    """`check_request`, with its texts matched where their length says: here, in the guard's threads
    (OFF_LOOP_CHARS or more) or, from HEAVY_CHARS on, in the guard's worker processes, one prompt of
    a key at a time (`lanes`): a key's flood of long prompts waits on itself; no short request waits
    on it, and another key's long prompt waits behind one of its prompts at most."""
    size = prompt_chars(call.body)
    if size < HEAVY_CHARS:
        await run_checked(size, check_request, call, policies)
        return
    check_before_texts(call, policies)  # a broken rule or a model refused: the texts are not matched
    slots = _text_slots(call.body)
    texts = [container[key] for container, key in slots]
    entry = getattr(call, "entry", None)
    async with lanes.lane(getattr(entry, "key_id", None)):
        try:
            verdict, masked = await offload.check_texts(policies, texts)
        except OffloadFailed:
            verdict, masked = await run_checked(size, policies.check_texts, texts)
    check_after_texts(call, policies, slots, verdict, masked)


def check_before_texts(call: Any, policies: PolicySet) -> None:
    """What is checked before the prompt's texts: a rule that cannot run, the model."""
    _check_broken(call, policies)
    model = policies.check_model(call.model)
    if model is not None:
        call.guard.append(model.to_dict())
        if model.action == "refuse":
            raise _refusal(
                model,
                gettext("the model “%(model)s” is not among those it allows") % {"model": call.model},
                403,
                "permission_error",
            )


def check_after_texts(
    call: Any, policies: PolicySet, slots: list[tuple[Any, Any]], verdict: Verdict, masked: list[str]
) -> None:
    """The texts' verdict applied (a refusal, the redactions), then the caps and the answer's guard."""
    noted = call.guard
    noted.extend(f.to_dict() for f in verdict.findings)
    if verdict.refusal is not None:
        raise _refusal(verdict.refusal, describe(verdict.refusal))
    if verdict.redacted:
        for (container, key), text in zip(slots, masked, strict=True):
            container[key] = text
    tokens = policies.check_input_tokens(_estimate_tokens(masked))
    if tokens is not None:
        noted.append(tokens.to_dict())
        if tokens.action == "refuse":
            cap_of = _limit(policies, tokens)
            raise _refusal(tokens, gettext("the prompt is over its cap of %(limit)s tokens") % {"limit": cap_of})
    cap = policies.max_output_tokens()
    if cap is not None and call.endpoint.name != "embeddings":  # an embedding has no output tokens
        rule, limit = cap
        asked = [call.body.get(k) for k in ("max_tokens", "max_completion_tokens") if isinstance(call.body.get(k), int)]
        if asked and max(asked) > limit:
            finding = Finding(rule.policy, rule.name, rule.kind, rule.action)
            noted.append(finding.to_dict())
            if rule.action == "refuse":
                raise _refusal(
                    finding,
                    gettext("%(asked)s output tokens asked for, its cap is %(limit)s")
                    % {"asked": max(asked), "limit": limit},
                )
        for key in ("max_tokens", "max_completion_tokens"):
            if key in call.body or key == "max_tokens":
                current = call.body.get(key)
                call.body[key] = min(current, limit) if isinstance(current, int) else limit
    choices = call.body.get("n")
    if policies.guard_answers and isinstance(choices, int) and not isinstance(choices, bool) and choices > 1:
        judge = policies.guard_answers[0]
        finding = Finding(judge.policy, judge.name, judge.kind, "refuse")
        noted.append(finding.to_dict())
        raise _refusal(
            finding,
            gettext("a guard model judges each answer here, so one is asked at a time (%(asked)s asked)")
            % {"asked": choices},
        )
    if policies.watches_output and call.endpoint.name != "embeddings":
        call.answer_guard = AnswerGuard(policies, call)


def _limit(policies: PolicySet, finding: Finding) -> int | None:
    return next((r.limit for r in policies.caps if r.name == finding.rule and r.policy == finding.policy), None)


class AnswerGuard:
    """The answer's choices checked as they stream (or whole): see the module docstring."""

    def __init__(self, policies: PolicySet, call: Any) -> None:
        self.policies = policies
        self.call = call
        self.guards: dict[int, OutputGuard] = {}
        self.stopped: Finding | None = None
        self.judged: Finding | None = None  # a guard model's verdict that withholds a whole answer

    def _guard(self, index: int) -> OutputGuard:
        guard = self.guards.get(index)
        if guard is None:
            guard = self.guards[index] = OutputGuard(self.policies)
        return guard

    def _note(self, guard: OutputGuard, seen: int) -> None:
        for finding in guard.findings[seen:]:
            self.call.guard.append(finding.to_dict())

    def chunk(self, data: dict[str, Any]) -> dict[str, Any]:
        """A chat (or completions) chunk with its text as it may be sent now."""
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0) if isinstance(choice.get("index", 0), int) else 0
            guard = self._guard(index)
            delta = choice.get("delta")
            holder, key = (delta, "content") if isinstance(delta, dict) else (choice, "text")
            text = holder.get(key) if isinstance(holder, dict) else None
            seen = len(guard.findings)
            if guard.stopped is not None:
                released = ""
            elif isinstance(text, str):
                released = guard.feed(text)
            else:
                released = ""
            if choice.get("finish_reason") is not None and guard.stopped is None:
                released += guard.finish()  # the end: what was held back goes now
            self._note(guard, seen)
            if isinstance(holder, dict) and (isinstance(text, str) or released):
                holder[key] = released
            if guard.stopped is not None:
                choice["finish_reason"] = "content_filter"
                if self.stopped is None:
                    self.stopped = guard.stopped
        if self.stopped is not None:
            # Said beside the standard fields (clients ignore what they do not know): the chat page
            # names the policy that stopped the answer.
            data["llmgw_guardrail"] = {"policy": self.stopped.policy, "rule": self.stopped.rule, "action": "stop"}
        return data

    def stopping_chunk(self, finding: Finding) -> dict[str, Any]:
        """The chunk that ends a streamed answer a guard model stopped (the rest is not sent)."""
        self.stopped = finding
        call = self.call
        completions = call.endpoint.name == "completions"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "content_filter"}
        if completions:
            choice["text"] = ""
        else:
            choice["delta"] = {}
        return {
            "id": call.request_id,
            "object": "text_completion" if completions else "chat.completion.chunk",
            "created": int(time.time()),
            "model": call.model,
            "choices": [choice],
            "llmgw_guardrail": {"policy": finding.policy, "rule": finding.rule, "action": "stop"},
        }

    def whole(self, data: dict[str, Any]) -> dict[str, Any]:
        """A whole (not streamed) answer with its text checked: masked, cut where it must stop, or
        withheld when a guard model judged it."""
        if self.judged is not None:
            for choice in data.get("choices") or []:
                if not isinstance(choice, dict):
                    continue
                if isinstance(choice.get("message"), dict):
                    choice["message"] = {"role": "assistant", "content": ""}
                else:
                    choice["text"] = ""
                choice["finish_reason"] = "content_filter"
            self.stopped = self.judged
            data["llmgw_guardrail"] = {"policy": self.judged.policy, "rule": self.judged.rule, "action": "stop"}
            return data
        for choice in data.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            message = choice.get("message")
            holder, key = (message, "content") if isinstance(message, dict) else (choice, "text")
            text = holder.get(key) if isinstance(holder, dict) else None
            if not isinstance(text, str) or not isinstance(holder, dict):
                continue
            guard = OutputGuard(self.policies)
            holder[key] = guard.feed(text) + guard.finish()
            self._note(guard, 0)
            if guard.stopped is not None:
                choice["finish_reason"] = "content_filter"
                self.stopped = self.stopped or guard.stopped
        if self.stopped is not None:
            data["llmgw_guardrail"] = {"policy": self.stopped.policy, "rule": self.stopped.rule, "action": "stop"}
        return data


class GuardJudge:
    """Guard models' verdicts on prompts and answers: a model llmgw serves (hosted or external) is
    asked, within its rule's time, whether the text is safe. `route(model)` gives the model's route,
    `keeper` its slots, `post(upstream, path, body, headers)` sends a request to an upstream."""

    def __init__(self, route: Callable[[str], Any], keeper: Any, post: Callable[..., Any]) -> None:
        self.route = route
        self.keeper = keeper
        self.post = post

    async def prompt(self, call: Any, rules: list[Any]) -> None:
        """The guard models' verdicts on the prompt, in the rules' order: refused when one holds it."""
        for rule in rules:
            held = await self.judge(call, rule)
            if held is not None:
                finding, unsafe, detail = held
                model = rule.models[0]
                raise guard_refusal(finding, model, detail) if unsafe else guard_unavailable(finding, model, detail)

    async def answer(self, call: Any, answer: str, *, final: bool = True) -> Any:
        """The guard models' verdicts on an answer: the finding that stops it, or None. A check while
        it streams (not `final`) stops it only on an unsafe verdict, and records only that."""
        guard = call.answer_guard
        for rule in guard.policies.guard_answers if guard is not None else ():
            held = await self.judge(call, rule, answer, final=final)
            if held is not None:
                return held[0]
        return None

    async def judge(
        self, call: Any, rule: Any, answer: str | None = None, *, final: bool = True
    ) -> tuple[Any, bool, str] | None:
        """Ask a rule's guard model for its verdict on the prompt, or on the answer when one is given,
        within the rule's time. None when the request (or answer) goes on; else (finding, unsafe,
        detail): judged unsafe (detail: the model's answer) or no verdict from a rule that fails
        closed (detail: why). Every outcome is on the call's record."""
        from apps.guardrails.engine import GUARD_TIMEOUT_MS, guard_verdict

        model = rule.models[0]
        holds = rule.action != "log"
        acted = ("stop" if answer is not None else "refuse") if holds else "log"
        finding = Finding(rule.policy, rule.name, rule.kind, acted)
        where = {"where": "answer"} if answer is not None else {}
        timeout = (rule.limit or GUARD_TIMEOUT_MS) / 1000
        try:
            said = await asyncio.wait_for(self._ask(call, model, answer), timeout)
            verdict = guard_verdict(said)
            if verdict is None:
                neither = gettext("it answered neither safe nor unsafe: %(answer)s") % {"answer": repr(said[:60])}
                raise GuardUnavailable(neither)
        except (TimeoutError, GuardUnavailable) as exc:
            if isinstance(exc, TimeoutError):
                why = gettext("no answer within %(ms)s ms") % {"ms": f"{timeout * 1000:.0f}"}
            else:
                why = str(exc)
            if not final:
                return None  # a check while the answer streams: its end is judged again, and recorded
            closed = holds and not rule.fail_open
            call.guard.append({**finding.to_dict(), **where, "action": acted if closed else "log", "error": why})
            return (finding, False, why) if closed else None
        if not verdict or (not final and not holds):
            return None  # safe; or a logging rule's verdict while the answer streams (its end is recorded)
        call.guard.append({**finding.to_dict(), **where})
        return (finding, True, said) if holds else None

    async def _ask(self, call: Any, model: str, answer: str | None) -> str:
        import json

        route = self.route(model)
        if route is None or not route.upstreams:
            if route is None:
                raise GuardUnavailable(gettext("“%(model)s” is not in the catalog") % {"model": model})
            raise GuardUnavailable(gettext("“%(model)s” has no replica ready") % {"model": model})
        lease = await self.keeper.acquire(route.upstreams, None)
        if lease is None:
            raise GuardUnavailable(gettext("every replica of “%(model)s” is busy") % {"model": model})
        try:
            upstream = lease.upstream
            body = {
                "model": upstream.upstream_model,
                "messages": guard_prompt(prompt_text(call.body), answer),
                "max_tokens": 16,
                "temperature": 0,
            }
            try:
                status, raw = await self.post(upstream, "/v1/chat/completions", body, call.request_id)
            except Exception as exc:  # the pool's connection and read errors
                raise GuardUnavailable(gettext("it could not be asked: %(error)s") % {"error": exc}) from None
            if status != 200:
                raise GuardUnavailable(gettext("it answered %(status)s") % {"status": status})
            try:
                return str(json.loads(raw)["choices"][0]["message"]["content"] or "")
            except (ValueError, KeyError, IndexError, TypeError):
                raise GuardUnavailable(gettext("its answer is not a chat completion")) from None
        finally:
            self.keeper.release(lease)
