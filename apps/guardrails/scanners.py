"""How each text rule finds its matches in a folded text's UTF-8 (no Django).

A scanner has `expression` (RE2 syntax, for the screen), `first(data)` (the first match, as a
byte span, or None) and `every(data)` (all of them, in order). Every scan is linear in the text:

- terms (`TermScanner`): one RE2 alternation of a rule's terms, leftmost-longest, each term a
  whole phrase: its words in order, any run of whitespace, hyphens, dots, slashes or underscores
  between two of them matching a single space (or any such run) in the term, and no letter, digit
  or mark right before or after it. The next match is looked for from the character after the
  previous one's start, so terms that overlap are each found; a term spans a bounded number of
  words, so a character is looked at by a bounded number of searches.
- an operator's expression (`ExpressionScanner`): the first match is RE2's, over the whole text.
  Finding every match (to redact them) is where even RE2 can be slow: an expression such as
  `a*b|a` must look past each match to the end of a run of `a` before it knows the match is `a`,
  so matches times look-ahead can grow with the square of the text. After the first, each search
  looks FIRST_WINDOW bytes ahead, twice as far while it finds nothing or a match that reaches the
  window's end, up to LOOKAHEAD (so a match is found whole up to LOOKAHEAD bytes, and one longer
  than OVERLAP may be found in parts, or not at all when no part of it matches; a match that a
  longer one beyond the window would have been preferred to is taken as the window shows it), and
  after MAX_MATCHES matches the rest of the text is one more match (redacted whole: what was not
  scanned is not let through). A window only grows past what was found in the one before it, so
  the work is a few times the text, plus FIRST_WINDOW for each match.
- a detector (`DetectorScanner`): its candidates, each checked (see apps.guardrails.detectors).

`Screen` is every scanner's expression in one RE2 set: one pass over the text says which rules
can match at all, so a text nothing matches (most of them) costs one scan whatever the number of
rules. A set that RE2 cannot build or run (it is checked when built) is not used: every scanner
then runs, which is slower, never wrong.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import re2

from apps.guardrails.detectors import Detector
from apps.guardrails.folding import Folded
from apps.guardrails.patterns import PatternError, compile_re2, gettext_noop, search

__all__ = [
    "FIRST_WINDOW",
    "LOOKAHEAD",
    "MAX_MATCHES",
    "DetectorScanner",
    "ExpressionScanner",
    "Scanner",
    "Screen",
    "TermScanner",
    "term_expression",
]

FIRST_WINDOW = 256  # bytes an operator's expression first looks ahead for its next match
LOOKAHEAD = 1024 * 1024  # bytes it looks ahead at most, after its first match
OVERLAP = LOOKAHEAD // 2  # a window that found nothing is followed by one overlapping it this much
MAX_MATCHES = 10_000  # matches of one operator's expression in one text; past them the rest is one match
_NOT_WORD = r"[^\pL\pN\pM]"
# Separators between a term's words: whitespace, hyphens and dashes, dots, slashes, underscores.
SEPARATOR = r"[\t\n\v\f\r \x{1C}-\x{1F}\x{85}\pZ\p{Pd}._/\\]"
_SEPARATOR_CHARS = frozenset("\t\n\v\f\r \x1c\x1d\x1e\x1f\x85._/\\")
_SEPARATOR_CATEGORIES = frozenset({"Zs", "Zl", "Zp", "Pd"})
_CANARY = "\ufdd0llmgw\ufdd0"


class Scanner(Protocol):
    expression: str

    def first(self, data: bytes) -> tuple[int, int] | None: ...

    def every(self, data: bytes) -> Iterator[tuple[int, int]]: ...


def _is_separator(char: str) -> bool:
    return char in _SEPARATOR_CHARS or unicodedata.category(char) in _SEPARATOR_CATEGORIES


def _literal(char: str) -> str:
    return char if char.isalnum() else f"\\x{{{ord(char):x}}}"


def term_expression(term: str) -> str | None:
    """A term as RE2 matches it in folded text: its characters literally, each inner run of
    separators as a run of one or more; separators at its ends dropped. None for a term with
    nothing but separators."""
    folded = Folded(term).folded
    out: list[str] = []
    i = 0
    while i < len(folded):
        if _is_separator(folded[i]):
            j = i
            while j < len(folded) and _is_separator(folded[j]):
                j += 1
            if out and j < len(folded):
                out.append(SEPARATOR + "+")
            i = j
            continue
        out.append(_literal(folded[i]))
        i += 1
    return "".join(out) or None


def _too_large(exc: Exception) -> PatternError:
    text = exc.args[0] if exc.args else exc
    return PatternError(
        "too_large",
        gettext_noop("The rule is too large for the matching engine (RE2): %(error)s."),
        {"error": text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)},
    )


class TermScanner:
    """A terms rule's terms as one expression (see the module docstring)."""

    def __init__(self, terms: Sequence[str]) -> None:
        alternatives = sorted({e for e in map(term_expression, terms) if e}, key=lambda e: (-len(e), e))
        if not alternatives:
            raise ValueError("no term to match")
        self.expression = f"(?:^|{_NOT_WORD})({'|'.join(alternatives)})(?:{_NOT_WORD}|$)"
        try:
            self.compiled = compile_re2(self.expression, longest=True)
        except re2.error as exc:
            raise _too_large(exc) from None

    def _from(self, data: bytes, pos: int) -> tuple[int, int] | None:
        spans = search(self.compiled, data, pos)
        return spans[1] if spans is not None else None

    def first(self, data: bytes) -> tuple[int, int] | None:
        return self._from(data, 0)

    def every(self, data: bytes) -> Iterator[tuple[int, int]]:
        pos = 0
        while (span := self._from(data, pos)) is not None:
            yield span
            pos = span[0] + 1


def _next_char(data: bytes, pos: int) -> int:
    pos += 1
    while pos < len(data) and 0x80 <= data[pos] < 0xC0:  # a UTF-8 continuation byte
        pos += 1
    return pos


class ExpressionScanner:
    """An operator's expression, compiled by apps.guardrails.patterns.check_pattern."""

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.expression = str(compiled.pattern)

    def first(self, data: bytes) -> tuple[int, int] | None:
        return next(self.every(data), None)

    def every(self, data: bytes) -> Iterator[tuple[int, int]]:
        size, pos, found = len(data), 0, 0
        window = size  # the first search looks at the whole text
        while pos <= size:
            end = min(size, pos + window)
            spans = search(self.compiled, data, pos, end)
            if spans is None or (spans[0][1] == end < size and window < LOOKAHEAD):
                # Nothing in the window, or a match that may go on past it: a wider one, then further on.
                if end >= size:
                    return
                if window < LOOKAHEAD:
                    window = min(LOOKAHEAD, 2 * window)
                else:
                    pos = end - OVERLAP  # no match of up to OVERLAP bytes starts before this
                continue
            start, stop = spans[0]
            if stop > start:
                yield start, stop
                found += 1
                if found >= MAX_MATCHES:
                    if stop < size:
                        yield stop, size
                    return
                pos = stop
            else:
                pos = _next_char(data, start)
            window = FIRST_WINDOW


class DetectorScanner:
    """A detector's candidates, each checked."""

    def __init__(self, detector: Detector) -> None:
        self.detector = detector
        self.expression = detector.expression
        self.compiled = compile_re2(detector.expression, capture=False)
        self.bounded = detector.bounded

    def first(self, data: bytes) -> tuple[int, int] | None:
        return next(self.every(data), None)

    def _candidate(self, data: bytes, start: int, stop: int) -> tuple[int, int]:
        """The candidate inside a match: without the character taken before or after it."""
        if self.bounded:
            detector = self.detector
            if data[start] not in detector.starts:
                start = _next_char(data, start)
            if stop > start and data[stop - 1] not in detector.ends:
                stop -= 1
                while stop > start and 0x80 <= data[stop] < 0xC0:  # back to the character's first byte
                    stop -= 1
        return start, stop

    def every(self, data: bytes) -> Iterator[tuple[int, int]]:
        length = self.detector.length
        pos = 0
        while (spans := search(self.compiled, data, pos)) is not None:
            start, stop = self._candidate(data, *spans[0])
            pos = stop if stop > spans[0][0] else _next_char(data, spans[0][0])
            if length is None:
                yield start, stop
                continue
            candidate = data[start:stop].decode("utf-8", "replace")
            found = length(candidate)
            if found is not None:
                yield start, start + len(candidate[:found].encode("utf-8"))


class Screen:
    """The scanners' expressions in one RE2 set: which of them can match a text, in one pass."""

    def __init__(self, expressions: Sequence[str]) -> None:
        options = re2.Options()
        options.case_sensitive = False
        options.log_errors = False
        self.set = re2.Set.SearchSet(options)
        for expression in expressions:
            self.set.Add(expression)
        self.canary = self.set.Add(re2.escape(_CANARY))
        self.set.Compile()
        # RE2 sizes a set's automaton when it is built; one that could not be built answers "no
        # match" to everything, so it is asked once about a text only the canary matches.
        if self.canary not in (self.set.Match(_CANARY.encode()) or ()):
            raise re2.error("the set's automaton does not fit in its memory")

    @classmethod
    def build(cls, expressions: Sequence[str]) -> Screen | None:
        if not expressions:
            return None
        try:
            return cls(expressions)
        except re2.error:
            return None

    def hits(self, data: bytes) -> list[int]:
        """The indices of the expressions that match somewhere in `data`."""
        return [i for i in self.set.Match(data) or () if i != self.canary]
