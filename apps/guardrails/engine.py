"""Guardrail rules, compiled once and matched against prompts and answers (no Django).

A policy is a name and an ordered list of rules; a rule has a kind, what it matches, and an
action:

- kinds: ``terms`` (words or phrases, matched whole, case-insensitively, any run of whitespace,
  hyphens, dots, slashes or underscores between two words matching one space), ``regex`` (an RE2
  expression, checked when saved), ``detector`` (personal data and secrets: ``email``, ``phone``,
  ``card`` (Luhn-checked), ``iban`` (mod-97-checked), ``tckn`` (a Turkish national ID number, its
  two check digits checked), ``api_key`` (common token shapes), ``llmgw_key``);
  ``max_input_tokens`` / ``max_output_tokens`` (a cap); ``models`` (the models allowed).
- actions: ``refuse`` (the request is refused, the rule named), ``redact`` (the match is masked in
  the prompt before it reaches the engine, or in the answer before it reaches the client),
  ``stop`` (the answer is ended where the match begins) and ``log`` (recorded, nothing changed).

Text is matched as the eye reads it, not as its bytes are (apps.guardrails.folding): full-width
digits are digits, zero-width characters and soft hyphens are dropped, Cyrillic and Greek letters
that look Latin read as Latin, case is folded; and a match is mapped back to the characters of the
original text, so a redaction masks what was really written.

Every expression is RE2's (apps.guardrails.patterns), so matching is linear in the text whatever
the rules; each rule is a scanner (apps.guardrails.scanners), and all the scanners of a direction
are one RE2 set, so a text no rule matches is scanned once. A rule that matches is then scanned for
where: its first match for a rule that refuses, stops or logs, every match for one that redacts.
Detectors' candidates are validated (the checksums), so "4111 1111 1111 1112" is no card.

A rule that cannot run (an expression RE2 refuses, saved before it was checked so; a detector that
is not known) is not dropped: the policy set lists it in `broken`, and the gateway refuses every
request the policy set covers, naming the rule and why. A guardrail that cannot be applied fails
closed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from apps.guardrails.detectors import DETECTORS, iban_ok, luhn_ok, tckn_ok
from apps.guardrails.folding import Folded, fold
from apps.guardrails.patterns import MAX_PATTERN, PatternError, check_pattern, gettext_noop
from apps.guardrails.scanners import DetectorScanner, ExpressionScanner, Scanner, Screen, TermScanner

__all__ = [
    "ACTIONS",
    "DETECTORS",
    "ELSEWHERE",
    "ELSEWHERE_CHARS",
    "HOLD",
    "KINDS",
    "MAX_PATTERN",
    "Broken",
    "Finding",
    "OutputGuard",
    "PatternError",
    "PolicySet",
    "RuleSpec",
    "Verdict",
    "check_pattern",
    "fold",
    "guard_verdict",
    "iban_ok",
    "luhn_ok",
    "rule_problem",
    "tckn_ok",
]

log = logging.getLogger("llmgw.guardrails")

ACTIONS = ("refuse", "redact", "stop", "log")
TEXT_KINDS = ("terms", "regex", "detector")
KINDS = (*TEXT_KINDS, "max_input_tokens", "max_output_tokens", "models", "guard_model")
GUARD_TIMEOUT_MS = 2000  # a guard model's time to answer when its rule gives none
MASK = "[redacted]"
WINDOW = 64  # characters of an answer held back so that a match split across chunks is caught whole
STEP = 32  # an answer is scanned once this many characters beyond the window have come, not every chunk
HOLD = 1024  # characters a redacted match still growing at the end of the answer is held back, at most
# A thread that sets ELSEWHERE.matches (a function of the matcher's rules and a text: its matches, or
# None to match it here) has the texts of ELSEWHERE_CHARS or more it matches matched there.
ELSEWHERE = threading.local()
ELSEWHERE_CHARS = 8_192


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


@dataclass(frozen=True, slots=True)
class Broken:
    """A rule that cannot run, and why (a PatternError: its code, template and numbers)."""

    rule: RuleSpec
    problem: PatternError


# --- rules as scanners --------------------------------------------------------------------------


def _scanner(rule: RuleSpec) -> Scanner | None:
    """The rule's scanner; None for a rule with nothing to match (no term, no expression). Raises
    PatternError for one that cannot run."""
    if rule.kind == "terms":
        terms = [t for t in rule.terms if t.strip()]
        try:
            return TermScanner(terms) if terms else None
        except ValueError:
            return None  # only separators: nothing to match
    if rule.kind == "regex":
        return ExpressionScanner(check_pattern(rule.pattern)) if rule.pattern else None
    if rule.kind == "detector":
        detector = DETECTORS.get(rule.detector)
        if detector is None:
            raise PatternError(
                "unknown_detector",
                gettext_noop("The detector “%(detector)s” is not known; the detectors are %(known)s."),
                {"detector": rule.detector, "known": ", ".join(DETECTORS)},
            )
        return DetectorScanner(detector)
    return None


def rule_problem(rule: RuleSpec) -> PatternError | None:
    """Why a text rule cannot run, or None when it can (what the console shows beside it)."""
    if rule.kind not in TEXT_KINDS:
        return None
    try:
        _scanner(rule)
    except PatternError as exc:
        return exc
    return None


class _Matcher:
    """The text rules of one direction, each a scanner, all of them in one screening set (see the
    module docstring). Matches are reported in the order of the text, each attributed to its rule."""

    def __init__(self, rules: Sequence[RuleSpec]) -> None:
        self.rules: list[RuleSpec] = []
        self.scanners: list[Scanner] = []
        self.broken: list[Broken] = []
        for rule in rules:
            try:
                scanner = _scanner(rule)
            except PatternError as exc:
                self.broken.append(Broken(rule, exc))
                continue
            if scanner is not None:
                self.rules.append(rule)
                self.scanners.append(scanner)
        self.screen = Screen.build([scanner.expression for scanner in self.scanners])

    @property
    def empty(self) -> bool:
        return not self.rules

    def _spans(self, data: bytes) -> list[tuple[int, int, int]]:
        """(start, end, rule position) in `data` of the first match of each rule that refuses, stops
        or logs, and of every match of each rule that redacts; in the order of the text."""
        positions = self.screen.hits(data) if self.screen is not None else range(len(self.scanners))
        found: list[tuple[int, int, int]] = []
        for position in positions:
            scanner = self.scanners[position]
            if self.rules[position].action == "redact":
                found.extend((start, end, position) for start, end in scanner.every(data))
            else:
                first = scanner.first(data)
                if first is not None:
                    found.append((*first, position))
        found.sort()
        return found

    def matches(self, text: str) -> list[tuple[int, int, int]]:
        """(start, end, rule position) of each match in the text, in order, mapped back to the
        original characters (see `_spans` for which matches). A text of ELSEWHERE_CHARS or more is
        matched by `ELSEWHERE.matches` when the calling thread set one (a guard's thread, which
        waits while a worker process matches: apps.guardrails.offload)."""
        if not self.rules or not text:
            return []
        elsewhere = getattr(ELSEWHERE, "matches", None)
        if elsewhere is not None and len(text) >= ELSEWHERE_CHARS:
            found = elsewhere(tuple(self.rules), text)
            if found is not None:
                return found
        return self.matches_here(text)

    def matches_here(self, text: str) -> list[tuple[int, int, int]]:
        """`matches`, in this thread."""
        if not self.rules or not text:
            return []
        folded = Folded(text)
        spans = self._spans(folded.data)
        if not spans:
            return []
        where = folded.spans([(start, end) for start, end, _position in spans])
        return [(start, end, found[2]) for (start, end), found in zip(where, spans, strict=True)]

    def finding(self, position: int, start: int = 0, end: int = 0) -> Finding:
        rule = self.rules[position]
        return Finding(rule.policy, rule.name, rule.kind, rule.action, start, end, rule.detector)

    def find(self, text: str) -> list[Finding]:
        """Each match in the text as a finding, in order."""
        return [self.finding(position, start, end) for start, end, position in self.matches(text)]


@dataclass
class Verdict:
    """What the rules said of a prompt: the findings (each rule once a text), the refusal if any,
    the text after redaction."""

    findings: list[Finding] = field(default_factory=list)
    refusal: Finding | None = None
    redacted: bool = False


_reported: set[tuple[str, str, str]] = set()  # broken rules already logged by this process


def _report(broken: Sequence[Broken]) -> None:
    for item in broken:
        key = (item.rule.policy, item.rule.name, str(item.problem))
        if key not in _reported:
            _reported.add(key)
            log.warning(
                "guardrail policy %r, rule %r cannot run, so every request the policy covers is refused "
                "until it is corrected: %s",
                item.rule.policy,
                item.rule.name,
                item.problem,
            )


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
        seen = set()
        self.broken: list[Broken] = []
        for item in (*self.inbound.broken, *self.outbound.broken):
            if id(item.rule) not in seen:
                seen.add(id(item.rule))
                self.broken.append(item)
        _report(self.broken)

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
        masked (unchanged where nothing is redacted). Each rule that matched a text is one finding
        of that text (its first match); the first refusing match, in the order of the texts, is
        the refusal."""
        verdict = Verdict()
        out: list[str] = []
        matcher = self.inbound
        for text in texts:
            spans: list[tuple[int, int]] = []
            noted: set[int] = set()
            for start, end, position in matcher.matches(text):
                action = matcher.rules[position].action
                if position not in noted:
                    noted.add(position)
                    verdict.findings.append(matcher.finding(position, start, end))
                    if action == "refuse" and verdict.refusal is None:
                        verdict.refusal = verdict.findings[-1]
                if action == "redact":
                    spans.append((start, end))
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
    `finish()` returns the rest. Once a stopping rule matches, `stopped` holds its finding and
    everything from the match on is dropped. Redacting rules mask their match (one still growing at
    the end is held back whole, up to HOLD characters, then masked as it is); logging rules are only
    recorded. Each rule that matched is one finding of the answer."""

    def __init__(self, policies: PolicySet, window: int = WINDOW, step: int = STEP, hold: int = HOLD) -> None:
        self.matcher = policies.outbound
        self.window = window
        self.step = step
        self.hold = hold
        self.pending = ""
        self.findings: list[Finding] = []
        self.stopped: Finding | None = None
        self._noted: set[int] = set()  # the rules (by position) already among the findings
        self._scan_at = window + step  # the length of `pending` at which it is scanned next

    def feed(self, delta: str) -> str:
        if self.stopped is not None:
            return ""
        if self.matcher.empty:
            return delta  # only a guard model watches this answer: nothing to hold back
        self.pending += delta
        if len(self.pending) < self._scan_at:
            return ""  # not scanned yet: nothing of it is sent before it is
        return self._release(final=False)

    def finish(self) -> str:
        if self.stopped is not None:
            return ""
        return self._release(final=True)

    def _note(self, position: int, start: int, end: int) -> Finding:
        finding = self.matcher.finding(position, start, end)
        if position not in self._noted:
            self._noted.add(position)
            self.findings.append(finding)
        return finding

    def _release(self, *, final: bool) -> str:
        text = self.pending
        spans: list[tuple[int, int]] = []
        cut = len(text) if final else max(len(text) - self.window, 0)
        rules = self.matcher.rules
        for start, end, position in self.matcher.matches(text):
            action = rules[position].action
            if action != "stop" and start >= cut and not final:
                break  # inside the held-back window: seen again, whole, with more text
            if action == "stop":  # at once, wherever it is: nothing from it on is sent
                self.stopped = self._note(position, start, end)
                released = _mask(text[:start], [s for s in spans if s[1] <= start])
                self.pending = ""
                return released
            if action == "redact" and end >= len(text) and not final and len(text) - start < self.hold:
                cut = min(cut, start)  # it may go on in the next chunk: held back whole
                break
            if position not in self._noted:
                self._note(position, start, end)
            if action == "redact":
                spans.append((start, end))
                cut = max(cut, end)
        # A redacted match that runs into the window is masked whole, then released.
        released = _mask(text[:cut], spans)
        self.pending = text[cut:]
        self._scan_at = max(len(self.pending), self.window) + self.step
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
