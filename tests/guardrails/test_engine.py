"""The rules themselves: checksums, folding that Unicode tricks do not get past, one screening set
per direction, redaction mapped back to what was written, and an answer checked as it streams with
a match split across chunks at every possible point."""

from __future__ import annotations

import pytest

from apps.guardrails.engine import (
    DETECTORS,
    MASK,
    OutputGuard,
    PatternError,
    PolicySet,
    RuleSpec,
    check_pattern,
    fold,
    iban_ok,
    luhn_ok,
    tckn_ok,
)
from apps.guardrails.patterns import is_re2

CARD = "4111 1111 1111 1111"  # a test card number, Luhn-valid
NOT_A_CARD = "4111 1111 1111 1112"
IBAN = "TR33 0006 1005 1978 6457 8413 26"
TCKN = "10000000146"


def rules(*specs: RuleSpec) -> PolicySet:
    return PolicySet(list(specs))


def detector(name: str, action: str = "refuse", rule: str | None = None) -> RuleSpec:
    return RuleSpec("pii", rule or name, "detector", action, detector=name)


@pytest.mark.parametrize(
    ("number", "ok"),
    [("4111111111111111", True), ("4111111111111112", False), ("5500005555555559", True), ("123", False)],
)
def test_luhn(number: str, ok: bool) -> None:
    assert luhn_ok(number) is ok


def test_iban_and_tckn_checksums() -> None:
    assert iban_ok(IBAN) and iban_ok("GB82 WEST 1234 5698 7654 32")
    assert not iban_ok("TR34 0006 1005 1978 6457 8413 26")  # one check digit off
    assert tckn_ok(TCKN) and not tckn_ok("10000000147") and not tckn_ok("00000000146")


def test_folding_reads_as_the_eye_does_and_maps_back() -> None:
    text = "Ｐrо\u200bject"  # full-width P, Cyrillic o, a zero-width space
    folded, where = fold(text)
    assert folded == "project"
    assert [text[i] for i in where] == ["Ｐ", "r", "о", "j", "e", "c", "t"]
    assert fold("４１１１")[0] == "4111"  # full-width digits are digits


@pytest.mark.parametrize(
    "written",
    [CARD, "4111-1111-1111-1111", "４１１１ １１１１ １１１１ １１１１", "4111\u200b1111\u200b1111\u200b1111"],
)
def test_a_card_is_found_however_it_is_written_and_masked_where_it_was(written: str) -> None:
    policy = rules(detector("card", "redact"))
    verdict, [out] = policy.check_texts([f"pay with {written} today"])
    assert verdict.redacted and out == f"pay with {MASK} today"
    assert [f.rule for f in verdict.findings] == ["card"]


def test_detectors_validate_what_they_find() -> None:
    policy = rules(detector("card"), detector("iban"), detector("tckn"), detector("email", "log"))
    verdict, _ = policy.check_texts([f"{NOT_A_CARD} and 10000000147 and TR34 0006 1005 1978 6457 8413 26"])
    assert verdict.findings == [] and verdict.refusal is None
    verdict, _ = policy.check_texts([f"write to a@b.example, IBAN {IBAN}"])
    assert verdict.refusal is not None and verdict.refusal.rule == "iban"
    assert [f.rule for f in verdict.findings] == ["email", "iban"]
    verdict, _ = policy.check_texts([f"kimlik no {TCKN}"])
    assert verdict.refusal is not None and verdict.refusal.detector == "tckn"


def test_secrets_of_common_shapes_and_llmgws_own_keys() -> None:
    policy = rules(detector("api_key", "redact"), detector("llmgw_key", "redact"))
    secrets = [
        "sk-proj-" + "a1B2" * 12,
        "ghp_" + "x" * 36,
        "AKIA" + "ABCDEFGHIJKLMNOP",
        "llmgw_" + "Zx9-" * 10,
    ]
    verdict, outs = policy.check_texts([f"key {s} end" for s in secrets])
    assert outs == [f"key {MASK} end"] * len(secrets)
    assert [f.rule for f in verdict.findings] == ["api_key", "api_key", "api_key", "llmgw_key"]


def test_terms_match_whole_words_whatever_the_case_or_the_script() -> None:
    policy = rules(RuleSpec("words", "codenames", "terms", "refuse", terms=("Project Falcon", "hush")))
    assert policy.check_texts(["PROJECT falcon"])[0].refusal is not None
    assert policy.check_texts(["about prоject fal\u200bcon"])[0].refusal is not None  # Cyrillic о, zero-width
    assert policy.check_texts(["hushed tones"])[0].refusal is None  # not the whole word
    assert policy.check_texts(["Hush!"])[0].refusal is not None


def test_two_hundred_terms_and_twenty_expressions_are_one_screening_set_of_re2_expressions() -> None:
    specs = [
        RuleSpec("big", f"t{i}", "terms", "log", terms=tuple(f"word{i}x{j}" for j in range(10))) for i in range(20)
    ]
    specs += [RuleSpec("big", f"r{i}", "regex", "log", pattern=rf"ticket-{i}\d+") for i in range(20)]
    specs += [RuleSpec("big", name, "detector", "log", detector=name) for name in DETECTORS]
    policy = rules(*specs)
    matcher = policy.inbound
    assert matcher.screen is not None and len(matcher.scanners) == 20 + 20 + len(DETECTORS)
    assert all(is_re2(scanner.compiled) for scanner in matcher.scanners)  # type: ignore[attr-defined]
    assert matcher.screen.hits(b"nothing to see here") == []  # one pass says no rule can match
    verdict, _ = policy.check_texts(["word7x3 and ticket-123 and word19x9"])
    assert [f.rule for f in verdict.findings] == ["t7", "r1", "r12", "t19"]  # ticket-1\d+ and ticket-12\d+ both


def test_the_first_refusal_in_the_stated_order_is_the_one_named() -> None:
    policy = rules(
        RuleSpec("org", "first", "terms", "log", terms=("alpha",)),
        RuleSpec("team", "second", "terms", "refuse", terms=("beta",)),
        RuleSpec("model", "third", "terms", "refuse", terms=("gamma",)),
    )
    verdict, _ = policy.check_texts(["alpha gamma beta"])
    assert verdict.refusal is not None and verdict.refusal.rule == "third"  # the first refusing match in the text
    assert [f.rule for f in verdict.findings] == ["first", "third", "second"]


@pytest.mark.parametrize(
    ("pattern", "code"),
    [
        ("(a|)+", "empty"),
        ("x*", "empty"),
        (r"\b", "empty"),
        ("(", "syntax"),
        (r"(\d{3})-\1", "backreference"),
        ("(?P<n>a)(?P=n)", "backreference"),
        ("(?<=a)b", "lookaround"),
        ("x(?!y)", "lookaround"),
        ("a++b", "possessive"),
        ("(?>a)b", "possessive"),
        ("(?(1)a|b)", "conditional"),
        (r"end\Z", "escape"),
        (r"\Cx", "byte"),
        ("a" * 2001, "too_long"),
    ],
)
def test_expressions_re2_cannot_run_are_refused_when_saved_saying_why(pattern: str, code: str) -> None:
    with pytest.raises(PatternError) as caught:
        check_pattern(pattern)
    assert caught.value.code == code


@pytest.mark.parametrize(
    "pattern", [r"ticket-\d+", "(foo|bar)+baz", "[a-z]+@[a-z]+", r"\bcodename\s+\w+", r"\pL+-\d{2,}", r"end\z"]
)
def test_ordinary_expressions_are_taken(pattern: str) -> None:
    compiled = check_pattern(pattern)
    assert compiled.pattern == pattern and is_re2(compiled)


def stream(policy: PolicySet, chunks: list[str]) -> tuple[str, OutputGuard]:
    guard = OutputGuard(policy)
    sent = "".join(guard.feed(chunk) for chunk in chunks) + guard.finish()
    return sent, guard


ANSWER = f"Sure. The number on file is {CARD}, and nothing else about it is shown here."


@pytest.mark.parametrize("split", range(1, len(ANSWER)))
def test_a_card_split_across_two_chunks_is_redacted_wherever_the_split_falls(split: int) -> None:
    sent, guard = stream(rules(detector("card", "redact")), [ANSWER[:split], ANSWER[split:]])
    assert sent == ANSWER.replace(CARD, MASK)
    assert [f.rule for f in guard.findings] == ["card"]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 16])
def test_an_answer_streamed_in_small_pieces_stops_where_the_match_begins(size: int) -> None:
    text = "Here is a secret: sk-ant-" + "q" * 40 + " and then more text follows."
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    sent, guard = stream(rules(detector("api_key", "stop")), chunks)
    assert sent == "Here is a secret: "
    assert guard.stopped is not None and guard.stopped.rule == "api_key"
    assert guard.feed("more") == "" and guard.finish() == ""


def test_a_clean_answer_streams_through_unchanged_and_only_the_window_is_held() -> None:
    guard = OutputGuard(rules(detector("card", "stop")), window=10, step=5)
    assert guard.feed("a" * 12) == ""  # not yet the window and a step: not scanned, nothing sent
    assert guard.feed("a" * 13) == "a" * 15  # scanned: all but the last ten
    assert guard.feed("b") == ""
    assert guard.finish() == "a" * 10 + "b"
    assert guard.stopped is None and guard.findings == []
