"""Guardrail rules, compiled once and matched against prompts and answers (no Django).

A policy is a name and an ordered list of rules; a rule has a kind, what it matches, and an
action:

- kinds: ``terms`` (words or phrases, matched whole, case-insensitively), ``regex`` (a regular
  expression, checked when saved), ``detector`` (personal data and secrets: ``email``, ``phone``,
  ``card`` (Luhn-checked), ``iban`` (mod-97-checked), ``tckn`` (a Turkish national ID number, its
  two check digits checked), ``api_key`` (common token shapes), ``llmgw_key``);
  ``max_input_tokens`` / ``max_output_tokens`` (a cap); ``models`` (the models allowed).
- actions: ``refuse`` (the request is refused, the rule named), ``redact`` (the match is masked in
  the prompt before it reaches the engine, or in the answer before it reaches the client),
  ``stop`` (the answer is ended where the match begins) and ``log`` (recorded, nothing changed).

Text is matched as the eye reads it, not as its bytes are: it is folded first (NFKC, so full-width
digits are digits; zero-width characters and soft hyphens removed; Cyrillic and Greek letters that
look Latin read as Latin; case folded), and a match is mapped back to the characters of the
original text, so a redaction masks what was really written.

Every text rule of a policy set is one combined expression: a prompt is scanned once whatever the
number of rules. A match is attributed to the first rule (in the stated order) whose group took
it. Detectors' candidates are then validated (the checksums), so "4111 1111 1111 1112" is no card.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

try:  # Python 3.11+: the parser behind re
    import re._parser as sre_parse  # type: ignore[import-not-found]
    from re import _constants as sre_constants  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

__all__ = [
    "ACTIONS",
    "DETECTORS",
    "KINDS",
    "Finding",
    "OutputGuard",
    "PatternError",
    "PolicySet",
    "RuleSpec",
    "fold",
    "luhn_ok",
    "iban_ok",
    "tckn_ok",
    "check_pattern",
    "guard_verdict",
]

ACTIONS = ("refuse", "redact", "stop", "log")
TEXT_KINDS = ("terms", "regex", "detector")
KINDS = (*TEXT_KINDS, "max_input_tokens", "max_output_tokens", "models", "guard_model")
GUARD_TIMEOUT_MS = 2000  # a guard model's time to answer when its rule gives none
MASK = "[redacted]"
MAX_PATTERN = 2000  # characters of a rule's expression
WINDOW = 64  # characters of an answer held back so that a match split across chunks is caught whole
STEP = 32  # an answer is scanned once this many characters beyond the window have come, not every chunk

# --- folding ----------------------------------------------------------------------------------

_INVISIBLE = dict.fromkeys(map(ord, "\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff"))
# Letters of other scripts that read as Latin ones (the confusables an attacker reaches for first).
_HOMOGLYPHS = str.maketrans(
    "АВЕЗІЈКМНОРСТУХаеіјорсуххѕԁԛԝΑΒΕΖΗΙΚΜΝΟΡΤΥΧαβεικνορτυχ",
    "ABE3IJKMHOPCTYXaeijopcyxxsdqwABEZHIKMNOPTYXabeiknoptux",
)


def fold(text: str) -> tuple[str, list[int] | None]:
    """The text as it is matched, and for each of its characters the index in `text` it came from
    (None when they are the same: plain ASCII, only lower-cased)."""
    if text.isascii():
        return text.lower(), None
    out: list[str] = []
    where: list[int] = []
    for index, char in enumerate(text):
        if ord(char) in _INVISIBLE:
            continue
        piece = unicodedata.normalize("NFKC", char) if not char.isascii() else char
        piece = piece.translate(_HOMOGLYPHS).casefold()
        for folded in piece:
            if ord(folded) in _INVISIBLE:
                continue
            out.append(folded)
            where.append(index)
    return "".join(out), where


# --- checksums --------------------------------------------------------------------------------


def luhn_ok(digits: str) -> bool:
    if not 13 <= len(digits) <= 19 or not digits.isdigit():
        return False
    total = 0
    for position, char in enumerate(reversed(digits)):
        value = int(char)
        if position % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def iban_ok(text: str) -> bool:
    iban = text.replace(" ", "").upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}", iban):
        return False
    moved = iban[4:] + iban[:4]
    number = "".join(str(int(char, 36)) for char in moved)
    return int(number) % 97 == 1


def tckn_ok(digits: str) -> bool:
    """A Turkish national ID number: 11 digits, not starting with 0, its 10th and 11th digits the
    checksums of the ones before."""
    if len(digits) != 11 or not digits.isdigit() or digits[0] == "0":
        return False
    d = [int(c) for c in digits]
    tenth = ((d[0] + d[2] + d[4] + d[6] + d[8]) * 7 - (d[1] + d[3] + d[5] + d[7])) % 10
    return d[9] == tenth and d[10] == sum(d[:10]) % 10


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


# Detectors: a candidate expression (on folded text) and a validation of what it found.
DETECTORS: dict[str, tuple[str, Any]] = {
    "email": (r"[a-z0-9._%+-]+@[a-z0-9-]+(?:\.[a-z0-9-]+)*\.[a-z]{2,}", None),
    "phone": (r"(?<![\w+])\+?\d[\d\s().-]{8,17}\d(?!\w)", lambda s: 10 <= len(_digits(s)) <= 15),
    "card": (r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)", lambda s: luhn_ok(_digits(s))),
    "iban": (r"(?<![a-z0-9])[a-z]{2}\d{2}(?: ?[a-z0-9]){11,30}(?![a-z0-9])", lambda s: iban_ok(s)),
    "tckn": (r"(?<!\d)[1-9]\d{10}(?!\d)", tckn_ok),
    "api_key": (
        r"(?:sk-(?:ant-|proj-)?[a-z0-9_-]{20,}|gh[pousr]_[a-z0-9]{36,}|github_pat_[a-z0-9_]{22,}"
        r"|akia[0-9a-z]{16}|xox[abprs]-[a-z0-9-]{10,}|aiza[0-9a-z_-]{35}"
        r"|eyj[a-z0-9_-]{8,}\.eyj[a-z0-9_-]{8,}\.[a-z0-9_-]{8,})",
        None,
    ),
    "llmgw_key": (r"llmgwe?_[a-z0-9_-]{20,}", None),
}


class PatternError(ValueError):
    """A rule's expression that is refused, and why."""


def _unbounded(items: Any) -> bool:
    """Whether a parsed expression can repeat without bound anywhere inside."""
    for op, arg in items:
        if op in (
            sre_constants.MAX_REPEAT,
            sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", None),
        ):
            low, high, body = arg
            if high == sre_constants.MAXREPEAT or _unbounded(body):
                return True
        elif op == sre_constants.SUBPATTERN:
            if _unbounded(arg[-1]):
                return True
        elif op == sre_constants.BRANCH and any(_unbounded(branch) for branch in arg[1]):
            return True
    return False


def _nested(items: Any) -> bool:
    """Whether an unbounded repetition holds another repetition that can grow (the shape that
    backtracks catastrophically: (a+)+, (a*)*, (a|aa)+ and their kin)."""
    for op, arg in items:
        if op in (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT):
            low, high, body = arg
            if high == sre_constants.MAXREPEAT and (_unbounded(body) or _alternation_repeats(body)):
                return True
            if _nested(body):
                return True
        elif op == sre_constants.SUBPATTERN:
            if _nested(arg[-1]):
                return True
        elif op == sre_constants.BRANCH and any(_nested(branch) for branch in arg[1]):
            return True
    return False


def _alternation_repeats(items: Any) -> bool:
    """Alternatives inside a repeated group that can match the same text in more than one way ((a|aa)+,
    (a|)+): one of them empty, or two starting alike."""
    for op, arg in items:
        if op == sre_constants.SUBPATTERN and _alternation_repeats(arg[-1]):
            return True
        if op == sre_constants.BRANCH:
            branches = arg[1]
            firsts = [str(branch[0]) if len(branch) else "" for branch in branches]
            if "" in firsts or len(set(firsts)) < len(firsts):
                return True
            if any(_alternation_repeats(branch) for branch in branches):
                return True
    return False


def check_pattern(pattern: str) -> re.Pattern[str]:
    """Compile a rule's expression, or say why it cannot be taken: it does not compile, it is too
    long, it matches the empty string, or it nests repetitions that backtrack catastrophically."""
    if len(pattern) > MAX_PATTERN:
        raise PatternError(f"The expression is {len(pattern)} characters long; at most {MAX_PATTERN}.")
    try:
        compiled = re.compile(pattern, re.IGNORECASE)
        parsed = sre_parse.parse(pattern, re.IGNORECASE)
    except (re.error, RecursionError, OverflowError) as exc:
        raise PatternError(f"The expression does not compile: {exc}.") from None
    if _nested(list(parsed)):
        raise PatternError(
            "The expression nests repetitions (as in (a+)+), which can take exponential time on a "
            "long input; rewrite it without a repeated group that can itself repeat."
        )
    if compiled.fullmatch(""):
        raise PatternError("The expression matches the empty string, so it would match everywhere.")
    # Groups are renumbered inside the combined expression; a backreference would point elsewhere.
    if compiled.groups and re.search(r"\\[1-9]|\(\?P=", pattern):
        raise PatternError("The expression uses a backreference, which a combined rule set cannot keep.")
    return compiled


# --- rules and their combination --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RuleSpec:
    """One rule as policies state it (the database's rows, or a test's)."""

    policy: str
    name: str
    kind: str
    action: str
    terms: tuple[str, ...] = ()
    pattern: str = ""
    detector: str = ""
    limit: int | None = None
    models: tuple[str, ...] = ()
    applies_to: str = "both"  # "input", "output" or "both"
    fail_open: bool = False  # a guard model that does not answer: let the request through (else refuse)


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule that matched: where in the original text (start, end), never what it matched."""

    policy: str
    rule: str
    kind: str
    action: str
    start: int = 0
    end: int = 0
    detector: str = ""

    def to_dict(self) -> dict[str, Any]:
        found: dict[str, Any] = {"policy": self.policy, "rule": self.rule, "kind": self.kind, "action": self.action}
        if self.detector:
            found["detector"] = self.detector
        return found


_WORD = re.compile(r"\w+")
_SEPARATOR = re.compile(r"\W+")
# What a detector's match cannot do without: a text lacking it is not scanned for the detector.
_NEEDS: dict[str, Any] = {
    "email": lambda t: "@" in t,
    "phone": re.compile(r"\d[\d\s().-]{8,17}\d").search,
    "card": re.compile(r"\d(?:[ -]?\d){12}").search,
    "iban": re.compile(r"[a-z]{2}\d{2}").search,
    "tckn": re.compile(r"\d{11}").search,
    "api_key": lambda t: any(p in t for p in ("sk-", "gh", "github_pat_", "akia", "xox", "aiza", "eyj")),
    "llmgw_key": lambda t: "llmgw" in t,
}


def _phrase(term: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """A term as its words and the separators between them, when it starts and ends with a word
    character (others are matched as an expression)."""
    folded = fold(term.strip())[0]
    words = tuple(_WORD.findall(folded))
    if not words or not re.fullmatch(r"\w.*\w|\w", folded, re.S):
        return None
    separators = tuple(_SEPARATOR.findall(folded))
    if len(separators) != len(words) - 1:
        return None
    return words, separators


def _inline(pattern: str) -> str:
    """A user's expression made safe to sit in a combined one: its groups made non-capturing."""
    return re.sub(r"(?<!\\)\((?!\?)", "(?:", pattern)


class _Matcher:
    """The text rules of one direction. Terms are looked up word by word in an index of their first
    words; the users' expressions (and terms that do not start and end with a word character) are
    one combined expression; each detector is its own expression, run only on a text that has what
    its match needs (a digit run for a card, an @ for an e-mail address). Matches are reported in
    the order of the text, each attributed to its rule."""

    def __init__(self, rules: Sequence[RuleSpec]) -> None:
        self.rules: list[RuleSpec] = []
        self.first_words: dict[str, list[tuple[tuple[str, ...], tuple[str, ...], int]]] = {}
        parts: list[str] = []
        self.detectors: list[tuple[int, Any, Any, Any]] = []
        for rule in rules:
            position = len(self.rules)
            if rule.kind == "terms":
                used = False
                for term in rule.terms:
                    found = _phrase(term)
                    if found is not None:
                        words, separators = found
                        self.first_words.setdefault(words[0], []).append((words, separators, position))
                        used = True
                    elif term.strip():
                        parts.append(f"(?P<r{position}>(?<!\\w){re.escape(fold(term.strip())[0])}(?!\\w))")
                        used = True
                if not used:
                    continue
            elif rule.kind == "regex" and rule.pattern:
                parts.append(f"(?P<r{position}>{_inline(rule.pattern)})")
            elif rule.kind == "detector" and rule.detector in DETECTORS:
                expression, check = DETECTORS[rule.detector]
                self.detectors.append((position, re.compile(expression, re.IGNORECASE), check, _NEEDS[rule.detector]))
            else:
                continue
            self.rules.append(rule)
        self.expression = re.compile("|".join(parts), re.IGNORECASE) if parts else None

    @property
    def empty(self) -> bool:
        return not self.rules

    def _spans(self, folded: str) -> list[tuple[int, int, int]]:
        """(start, end, rule position) of every match in the folded text."""
        found: list[tuple[int, int, int]] = []
        if self.first_words:
            index = self.first_words
            tokens = [(m.group(), m.start(), m.end()) for m in _WORD.finditer(folded)]
            for i, (word, start, _end) in enumerate(tokens):
                for words, separators, position in index.get(word, ()):
                    last = i + len(words) - 1
                    if last >= len(tokens):
                        continue
                    if all(tokens[i + k][0] == words[k] for k in range(1, len(words))) and all(
                        folded[tokens[i + k][2] : tokens[i + k + 1][1]] == separators[k] for k in range(len(separators))
                    ):
                        found.append((start, tokens[last][2], position))
        if self.expression is not None:
            for match in self.expression.finditer(folded):
                if match.lastgroup is not None:
                    found.append((match.start(), match.end(), int(match.lastgroup[1:])))
        for position, expression, check, needs in self.detectors:
            if not needs(folded):
                continue
            for match in expression.finditer(folded):
                if check is None or check(match.group()):
                    found.append((match.start(), match.end(), position))
        found.sort()
        return found

    def find(self, text: str) -> Iterator[Finding]:
        """Each match in the text, in order, mapped back to the original characters."""
        if not self.rules or not text:
            return
        folded, where = fold(text)
        for start, end, position in self._spans(folded):
            rule = self.rules[position]
            if where is not None:
                start, end = where[start], where[end - 1] + 1
            yield Finding(rule.policy, rule.name, rule.kind, rule.action, start, end, rule.detector)


@dataclass
class Verdict:
    """What the rules said of a prompt: the findings (each logged), the refusal if any, the text after
    redaction."""

    findings: list[Finding] = field(default_factory=list)
    refusal: Finding | None = None
    redacted: bool = False


class PolicySet:
    """The rules in force for one request (the policies of its organisation, team, project and model,
    in that order), compiled once."""

    def __init__(self, rules: Sequence[RuleSpec]) -> None:
        self.rules = list(rules)
        self.inbound = _Matcher([r for r in self.rules if r.kind in TEXT_KINDS and r.applies_to in ("input", "both")])
        self.outbound = _Matcher([r for r in self.rules if r.kind in TEXT_KINDS and r.applies_to in ("output", "both")])
        self.caps = [r for r in self.rules if r.kind in ("max_input_tokens", "max_output_tokens", "models")]
        guards = [r for r in self.rules if r.kind == "guard_model" and r.models]
        self.guard_prompts = [r for r in guards if r.applies_to in ("input", "both")]
        self.guard_answers = [r for r in guards if r.applies_to in ("output", "both")]

    def __bool__(self) -> bool:
        return bool(self.rules)

    @property
    def watches_output(self) -> bool:
        return not self.outbound.empty or bool(self.guard_answers)

    def max_output_tokens(self) -> tuple[RuleSpec, int] | None:
        found = [(r, r.limit) for r in self.caps if r.kind == "max_output_tokens" and r.limit]
        return min(found, key=lambda item: item[1]) if found else None  # type: ignore[return-value]

    def check_model(self, model: str) -> Finding | None:
        for rule in self.caps:
            if rule.kind == "models" and rule.models and model not in rule.models:
                return Finding(rule.policy, rule.name, rule.kind, rule.action)
        return None

    def check_input_tokens(self, tokens: int) -> Finding | None:
        for rule in self.caps:
            if rule.kind == "max_input_tokens" and rule.limit is not None and tokens > rule.limit:
                return Finding(rule.policy, rule.name, rule.kind, rule.action)
        return None

    def check_texts(self, texts: list[str]) -> tuple[Verdict, list[str]]:
        """Match the prompt's texts: the verdict, and the texts with the redacting rules' matches
        masked (unchanged where nothing is redacted). A refusing match ends the check."""
        verdict = Verdict()
        out: list[str] = []
        for text in texts:
            spans: list[tuple[int, int]] = []
            for finding in self.inbound.find(text):
                verdict.findings.append(finding)
                if finding.action == "refuse" and verdict.refusal is None:
                    verdict.refusal = finding
                elif finding.action == "redact":
                    spans.append((finding.start, finding.end))
            if spans:
                verdict.redacted = True
                text = _mask(text, spans)
            out.append(text)
        return verdict, out


def _mask(text: str, spans: list[tuple[int, int]]) -> str:
    pieces: list[str] = []
    last = 0
    for start, end in sorted(spans):
        if start < last:
            start = last
        if start >= end:
            continue
        pieces.append(text[last:start])
        pieces.append(MASK)
        last = end
    pieces.append(text[last:])
    return "".join(pieces)


class OutputGuard:
    """An answer's text checked as it streams: `feed(delta)` returns what may be sent now, holding
    back the last WINDOW characters so that a match split across chunks is seen whole (and scanning
    only once STEP more have come, so a stream of short chunks is not scanned chunk by chunk);
    `finish()` returns the rest. Once a stopping rule matches, `stopped` holds its finding and everything from
    the match on is dropped. Redacting rules mask their match; logging rules are only recorded."""

    def __init__(self, policies: PolicySet, window: int = WINDOW, step: int = STEP) -> None:
        self.matcher = policies.outbound
        self.window = window
        self.step = step
        self.pending = ""
        self.findings: list[Finding] = []
        self.stopped: Finding | None = None
        self._seen: set[tuple[str, str, int]] = set()
        self._offset = 0  # characters of the answer already released before `pending`

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        if self.matcher.empty:
            return delta  # only a guard model watches this answer: nothing to hold back
        self.pending += delta
        if len(self.pending) < self.window + self.step:
            return ""  # not scanned yet: nothing of it is sent before it is
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped is not None:
            return ""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        text = self.pending
        spans: list[tuple[int, int]] = []
        cut = len(text) if final else max(len(text) - self.window, 0)
        for finding in self.matcher.find(text):
            key = (finding.rule, finding.policy, self._offset + finding.start)
            if finding.action != "stop" and finding.start >= cut and not final:
                break  # inside the held-back window: seen again, whole, with more text
            if key not in self._seen:
                self._seen.add(key)
                self.findings.append(finding)
            if finding.action == "stop":  # at once, wherever it is: nothing from it on is sent
                self.stopped = finding
                released = _mask(text[: finding.start], [s for s in spans if s[1] <= finding.start])
                self.pending = ""
                return released
            if finding.action == "redact":
                if finding.end >= len(text) and not final:
                    cut = min(cut, finding.start)  # it may go on in the next chunk: held back whole
                    break
                spans.append((finding.start, finding.end))
                cut = max(cut, finding.end)
        # A redacted match that runs into the window is masked whole, then released.
        released = _mask(text[:cut], spans)
        self._offset += cut
        self.pending = text[cut:]
        return released


def guard_verdict(answer: str) -> bool | None:
    """What a guard model's answer says of the text: True when it is unsafe (Llama Guard's "unsafe",
    ShieldGemma's "Yes", it violates the policy), False when safe ("safe", "No"), None when the answer
    says neither."""
    words = answer.strip().split()
    first = words[0].strip(".,:;!").casefold() if words else ""
    if first in ("unsafe", "yes"):
        return True
    if first in ("safe", "no"):
        return False
    return None
