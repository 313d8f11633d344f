"""Matching is linear in the text whatever the rules: every pathological expression a campaign found
is either refused when saved or compiled by RE2 (which never backtracks) and answers at once on the
inputs that made the old engine stall; finding every match of an expression whose matches need long
look-ahead is bounded by counts, not by time; and the built-in detectors and terms find what they
should on the real inputs, with digits and words separated as people write them."""

from __future__ import annotations

from typing import Any

import pytest

from apps.guardrails import scanners
from apps.guardrails.engine import DETECTORS, MASK, OutputGuard, PatternError, PolicySet, RuleSpec, check_pattern
from apps.guardrails.patterns import is_re2

# What the campaign saved as rules (the old check took each) and what stalled the process with them.
PATHOLOGICAL = {
    "(a|a?)+b": "a" * 23,
    "(a{1,30})+b": "a" * 40,
    "(.*a){12}x": "a" * 40,
    ".*a.*a.*a.*a.*a.*x": "a" * 40,
    r"(?:\d|\w\w)+$": "1" * 40 + "!",
    r"(?:\wb|ab)+c": "ab" * 40,
    r"\d+\d+\d+\d+x": "1" * 40,
    ".*.*.*.*=": "a" * 40,
    "(a+)+$": "a" * 40 + "!",
    "(a|aa)+$": "a" * 40 + "!",
    r"(\w+\s?)+$": "word " * 40 + "!",
    "(x+x+)+y": "x" * 40,
}
LONG = 100_000  # characters: the old engine took hours on a few dozen


def policy(*specs: RuleSpec) -> PolicySet:
    return PolicySet(list(specs))


def regex(pattern: str, action: str = "refuse", applies_to: str = "both") -> RuleSpec:
    return RuleSpec("ops", "pattern", "regex", action, pattern=pattern, applies_to=applies_to)


@pytest.mark.parametrize("pattern", list(PATHOLOGICAL))
def test_each_pathological_expression_is_compiled_by_re2_and_answers_on_the_input_that_stalled(pattern: str) -> None:
    compiled = check_pattern(pattern)
    assert is_re2(compiled)
    adversarial = PATHOLOGICAL[pattern]
    long = adversarial[:-1] * (LONG // len(adversarial)) + adversarial[-1]
    for text in (adversarial, long):
        verdict, _ = policy(regex(pattern)).check_texts([text])
        assert (verdict.refusal is not None) == (compiled.search(text) is not None)


@pytest.mark.parametrize("pattern", list(PATHOLOGICAL))
def test_each_pathological_expression_streams_an_answer_of_its_adversarial_text(pattern: str) -> None:
    guard = OutputGuard(policy(regex(pattern, "stop", "output")))
    text = PATHOLOGICAL[pattern] * 50
    sent = "".join(guard.feed(text[i : i + 3]) for i in range(0, len(text), 3)) + guard.finish()
    if guard.stopped is None:
        assert sent == text
    else:
        assert text.startswith(sent)


class Counted:
    """Counts RE2's calls by a scanner and the bytes each may look at (its window): the work, by count."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.window_bytes = 0
        real = scanners.search

        def counted(compiled: Any, data: bytes, pos: int = 0, end: int | None = None) -> Any:
            self.calls += 1
            self.window_bytes += (len(data) if end is None else end) - pos
            return real(compiled, data, pos, end)

        monkeypatch.setattr(scanners, "search", counted)


def test_redacting_every_match_of_an_expression_that_looks_far_ahead_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "a*b|a" must read to the end of a run of "a" before it knows a match is "a": each of the
    # matches would look at the rest of the text, the square of its length in all.
    counted = Counted(monkeypatch)
    text = "a" * 300_000
    verdict, [out] = policy(regex("a*b|a", "redact")).check_texts([text])
    assert verdict.redacted
    assert out == MASK * (scanners.MAX_MATCHES + 1)  # the first 1,000 matches, then the rest as one
    assert counted.calls == scanners.MAX_MATCHES
    # The first search reads the text, each next one a short window: not the rest of the text each time.
    assert counted.window_bytes <= len(text) + scanners.MAX_MATCHES * scanners.FIRST_WINDOW


def test_long_matches_after_the_first_are_still_redacted_whole() -> None:
    line = "secret: " + "x" * 50_000
    text = f"{line}\nplain\n{line}\nplain\n{line}"
    verdict, [out] = policy(regex("secret: .*", "redact")).check_texts([text])
    assert out == f"{MASK}\nplain\n{MASK}\nplain\n{MASK}"


def test_an_ordinary_expression_redacts_every_match_of_a_long_text() -> None:
    text = "ticket-1234 and " * 5_000
    verdict, [out] = policy(regex(r"ticket-\d+", "redact")).check_texts([text])
    assert out == f"{MASK} and " * 5_000


# Detectors and terms on what the campaign sent -----------------------------------------------------


def detector(name: str, action: str = "redact") -> RuleSpec:
    return RuleSpec("pii", name, "detector", action, detector=name)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("email", "a" * 30_000 + "@"),  # quadratic for the old expression: 32.7 s
        ("email", "a." * 15_000 + "@b"),
        ("iban", "ş" * 300_000 + "tr33"),  # a megabyte of non-ASCII: 1.8 s for the IBAN detector
        ("card", "1234 " * 60_000),
        ("phone", "1" * 300_000),
        ("phone", "+" * 300_000),
        ("api_key", "gh" * 150_000),
        ("tckn", "1" * 300_000),
    ],
)
def test_a_detector_on_an_adversarial_text_finds_nothing_there_is_not(name: str, text: str) -> None:
    verdict, [out] = policy(detector(name)).check_texts([text])
    assert verdict.findings == [] and out == text


def test_a_terms_rule_on_a_megabyte_of_non_ascii_text_finds_its_terms_only() -> None:
    text = "şğüöçı İstanbul'da bahar " * 40_000
    rules = policy(RuleSpec("words", "codename", "terms", "redact", terms=("Project Falcon", "bahar")))
    verdict, [out] = rules.check_texts([text + "project—falcon"])
    assert out == ("şğüöçı İstanbul'da " + MASK + " ") * 40_000 + MASK
    assert [f.rule for f in verdict.findings] == ["codename"]


MAILS = "write to ali.veli@example.com.tr, cc Ayşe.Yılmaz+ops@posta.örnek.com.tr or x_y@sub.example.io."


def test_e_mail_addresses_are_found_and_masked_whole() -> None:
    _verdict, [out] = policy(detector("email")).check_texts([MAILS])
    assert out == f"write to {MASK}, cc {MASK} or {MASK}."
    _verdict, [out] = policy(detector("email")).check_texts(["ali@example.com " * 10_000])
    assert out == f"{MASK} " * 10_000


IBAN_TR = "TR33 0006 1005 1978 6457 8413 26"
IBAN_ES = "ES91 2100 0418 4502 0005 1332"  # 24 characters: groups of four to the end


@pytest.mark.parametrize(
    "written",
    [
        f"iban {IBAN_TR} lütfen",
        f"iban {IBAN_TR.replace(' ', '')}.",
        f"iban {IBAN_TR.replace(' ', '-')}",
        f"cuenta {IBAN_ES} para pagar",  # the word after it is no group of the IBAN
        f"cuenta {IBAN_ES.lower()}",
    ],
)
def test_ibans_are_found_however_they_are_written(written: str) -> None:
    verdict, [out] = policy(detector("iban")).check_texts([written])
    assert [f.rule for f in verdict.findings] == ["iban"], written
    assert "0006" not in out and "0418" not in out and MASK in out


CARD = "4111 1111 1111 1111"


@pytest.mark.parametrize(
    "written",
    [
        "4111.1111.1111.1111",
        "4111/1111/1111/1111",
        "4111\n1111\n1111\n1111",
        "4111 - 1111 - 1111 - 1111",
        "4111_1111_1111_1111",
        "4111\u20131111\u20131111\u20131111",  # en dashes
        "4111111111111111",
        "３７８２ ８２２４６３ １０００５",  # an Amex test number, 4-6-5, full-width
    ],
)
def test_cards_are_found_with_their_digits_grouped_as_people_write_them(written: str) -> None:
    verdict, [out] = policy(detector("card")).check_texts([f"card: {written}, thanks"])
    assert out == f"card: {MASK}, thanks", written


def test_a_card_followed_by_more_digits_is_masked_and_the_digits_kept() -> None:
    _verdict, [out] = policy(detector("card")).check_texts([f"{CARD} 12/27 and {CARD} 2025"])
    assert out == f"{MASK} 12/27 and {MASK} 2025"


@pytest.mark.parametrize(
    "text",
    ["10.20.30.40 192.168.100.200", "2024/01/15 10.30.00", "0212 555 12 34", "4111.1111.1111.1112", "1/2/3/4/5/6/7"],
)
def test_addresses_dates_phone_numbers_and_bad_checksums_are_no_cards(text: str) -> None:
    verdict, _ = policy(detector("card")).check_texts([text])
    assert verdict.findings == []


CODENAME = RuleSpec("words", "codename", "terms", "refuse", terms=("Project Falcon",))


@pytest.mark.parametrize(
    "written",
    [
        "Project  Falcon",
        "Project\nFalcon",
        "Project\r\n\tFalcon",
        "Project-Falcon",
        "Project — Falcon",
        "project_falcon",
        "PROJECT/FALCON",
        "Project.Falcon",
        "Project . / _ Falcon",
        "Ｐroject\u00a0Ｆalcon",  # full-width letters, a no-break space
    ],
)
def test_a_term_is_found_whatever_separates_its_words(written: str) -> None:
    verdict, _ = policy(CODENAME).check_texts([f"about {written} today"])
    assert verdict.refusal is not None, written


@pytest.mark.parametrize("written", ["ProjectFalcon", "Project Falconry", "Project, Falcon", "subproject falcon"])
def test_a_term_is_still_whole_words(written: str) -> None:
    verdict, _ = policy(CODENAME).check_texts([written])
    assert verdict.refusal is None, written


def test_a_term_with_hyphens_matches_other_separators_too() -> None:
    rule = RuleSpec("words", "mail", "terms", "refuse", terms=("e-mail",))
    assert policy(rule).check_texts(["send an e mail"])[0].refusal is not None
    assert policy(rule).check_texts(["send an email"])[0].refusal is None


ANSWER = "The plan for Project \n \t Falcon ships in May, and the card is 4111.1111\n1111/1111 ok."


@pytest.mark.parametrize("split", range(1, len(ANSWER)))
def test_a_term_and_a_card_with_odd_separators_are_caught_wherever_a_chunk_ends(split: int) -> None:
    rules = policy(
        RuleSpec("words", "codename", "terms", "redact", terms=("project falcon",), applies_to="output"),
        RuleSpec("pii", "card", "detector", "redact", detector="card", applies_to="output"),
    )
    guard = OutputGuard(rules)
    sent = guard.feed(ANSWER[:split]) + guard.feed(ANSWER[split:]) + guard.finish()
    assert sent == f"The plan for {MASK} ships in May, and the card is {MASK} ok."


def test_a_redaction_is_mapped_back_past_characters_whose_fold_is_longer_or_gone() -> None:
    text = "İİ ß\u200bﬁ straße: 4111 1111 1111 1111 end"
    _verdict, [out] = policy(detector("card")).check_texts([text])
    assert out == f"İİ ß\u200bﬁ straße: {MASK} end"
    terms = RuleSpec("words", "street", "terms", "redact", terms=("strasse",))
    _verdict, [out] = policy(terms).check_texts([text])
    assert out == f"İİ ß\u200bﬁ {MASK}: 4111 1111 1111 1111 end"


def test_a_lone_surrogate_in_a_prompt_is_read_not_a_crash() -> None:
    text = "bad \ud800 half, card 4111 1111 1111 1111"
    _verdict, [out] = policy(detector("card"), CODENAME).check_texts([text])
    assert out == f"bad \ud800 half, card {MASK}"


def test_every_detector_is_an_re2_expression() -> None:
    for name in DETECTORS:
        matcher = policy(detector(name)).inbound
        assert is_re2(matcher.scanners[0].compiled), name  # type: ignore[attr-defined]


def test_an_unknown_detector_cannot_run_and_says_which_there_are() -> None:
    rules = policy(RuleSpec("pii", "dna", "detector", "refuse", detector="dna"))
    assert [item.rule.name for item in rules.broken] == ["dna"]
    assert isinstance(rules.broken[0].problem, PatternError) and "card" in str(rules.broken[0].problem)
