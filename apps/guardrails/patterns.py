"""Operators' regular expressions, run by RE2 (no Django).

Every expression of a guardrail (an operator's pattern, the terms, the detectors) is compiled by
RE2 (the `google-re2` package), whose matching time is linear in the text whatever the
expression: it never backtracks, so no pattern (`(a|a?)+b`, `(.*a){12}x`) can make one prompt
stall the process. What RE2 cannot run in linear time it does not have, and an operator's pattern
that uses it is refused when it is saved, saying which construct and why: looking ahead or
behind, a backreference, a possessive quantifier or an atomic group, a conditional, recursion,
`\\C` (one byte, which can cut a character in two). So is one that does not compile, one over
MAX_PATTERN characters, and one that can match the empty string.

The syntax is RE2's (https://github.com/google/re2/wiki/Syntax), close to Python's and PCRE's:
`\\d`, `\\w`, `\\s` and `\\b` are ASCII; `\\pL`, `\\p{Greek}`, `\\pN` name Unicode classes.
Expressions match case-insensitively, on the folded text (see apps.guardrails.folding).

A refusal is a `PatternError`: a code, an English template (marked for translation, translated
by the Django side) and its numbers.
"""

from __future__ import annotations

from typing import Any

import re2

__all__ = [
    "MAX_PATTERN",
    "PatternError",
    "check_pattern",
    "compile_re2",
    "gettext_noop",
    "is_re2",
    "search",
]

MAX_PATTERN = 2000  # characters of a rule's expression
_EMPTY_PROBES = ("", " ", "a", "a a\n1")  # an expression matching nothing at all on one of these is refused


def gettext_noop(s: str) -> str:
    """Mark a msgid for extraction without translating it (the engine never imports Django)."""
    return s


class PatternError(ValueError):
    """An expression that is refused: `code`, an English `template` and its `params`."""

    def __init__(self, code: str, template: str, params: dict[str, Any] | None = None) -> None:
        self.code = code
        self.template = template
        self.params = params or {}
        super().__init__(template % self.params)


def _options(*, longest: bool = False, capture: bool = True) -> Any:
    options = re2.Options()
    options.case_sensitive = False
    options.log_errors = False  # a refusal is reported by the caller, not written to stderr
    options.longest_match = longest
    options.never_capture = not capture
    return options


def compile_re2(expression: str, *, longest: bool = False, capture: bool = True) -> Any:
    """An RE2 expression, case-insensitive (`longest`: leftmost-longest rather than leftmost-first;
    `capture`: its groups' spans are wanted, which costs RE2 a second, slower pass over each match).
    Raises re2.error when RE2 refuses it."""
    return re2.compile(expression, _options(longest=longest, capture=capture))


_UNANCHORED = re2._re2.RE2.Anchor.UNANCHORED
_NO_MATCH = (-1, -1)


def search(compiled: Any, data: bytes, pos: int = 0, end: int | None = None) -> list[tuple[int, int]] | None:
    """The spans (the match, then each group; (-1, -1) for a group that took no part) of the first
    match of `compiled` in data[pos:end] (assertions such as ^ and $ see the whole of `data`), or
    None. RE2's own call, without the `re`-like wrapper's match object: a scan that finds many
    matches makes one such call for each."""
    spans: list[tuple[int, int]] = compiled._regexp.Match(_UNANCHORED, data, pos, len(data) if end is None else end)
    return None if spans[0] == _NO_MATCH else spans


def is_re2(compiled: Any) -> bool:
    """Whether a compiled expression is RE2's (so matching it is linear in the text)."""
    return type(compiled).__module__.split(".")[0] == "re2"


# --- why an expression is refused --------------------------------------------------------------

_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")
_ATOMIC = ("(?>",)
_CONDITIONAL = ("(?(",)
_RECURSION = ("(?R", "(?&", "(?P>", "(?0", "(?1", "(?2", "(?3", "(?4", "(?5", "(?6", "(?7", "(?8", "(?9")
_BACKREFERENCE_GROUPS = ("(?P=",)
_BACKREFERENCE_ESCAPES = ("1", "2", "3", "4", "5", "6", "7", "8", "9", "g", "k")
_OTHER_ESCAPES = {"K": "\\K", "G": "\\G", "Z": "\\Z", "R": "\\R", "X": "\\X", "h": "\\h", "H": "\\H", "V": "\\V"}
_QUANTIFIER_ENDS = ("*", "+", "?", "}")

_WHY: dict[str, str] = {
    "lookaround": gettext_noop(
        "The expression uses “%(construct)s”, a look-ahead or look-behind, which the matching engine (RE2) "
        "does not run: it matches in time linear in the text, and looking around cannot. Match the "
        "neighbouring text itself, or use \\b for a word boundary."
    ),
    "backreference": gettext_noop(
        "The expression uses “%(construct)s”, a reference back to a group, which the matching engine (RE2) "
        "does not run: a backreference cannot be matched in time linear in the text."
    ),
    "possessive": gettext_noop(
        "The expression uses “%(construct)s”, a possessive quantifier or an atomic group, which the matching "
        "engine (RE2) does not have; it never backtracks, so the plain quantifier does the same."
    ),
    "conditional": gettext_noop(
        "The expression uses “%(construct)s”, a conditional or a recursion, which the matching engine (RE2) "
        "does not have."
    ),
    "escape": gettext_noop(
        "The expression uses “%(construct)s”, which the matching engine (RE2) does not have (for the end of "
        "the text, write \\z)."
    ),
    "byte": gettext_noop(
        "The expression uses “\\C” (any one byte), which can cut a character in two; use . for any character."
    ),
}


def _constructs(pattern: str) -> list[tuple[str, str]]:
    """(kind, construct) of every construct RE2 does not run, in the order written: a walk of the
    expression that skips escaped characters and character classes."""
    found: list[tuple[str, str]] = []
    i, size, in_class = 0, len(pattern), False
    while i < size:
        char = pattern[i]
        if char == "\\" and i + 1 < size:
            escape = pattern[i + 1]
            if not in_class:
                found.extend(_escape_kind(escape))
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1
            if pattern[i : i + 1] == "^":
                i += 1
            if pattern[i : i + 1] == "]":
                i += 1  # "[]...]" and "[^]...]": the first ] is a member
            continue
        elif char == "(":
            found.extend(_group_kind(pattern[i : i + 4]))
        elif char == "+" and i and pattern[i - 1] in _QUANTIFIER_ENDS and not _escaped(pattern, i - 1):
            found.append(("possessive", pattern[i - 1 : i + 1]))
        i += 1
    return found


def _escaped(pattern: str, index: int) -> bool:
    backslashes = len(pattern[:index]) - len(pattern[:index].rstrip("\\"))
    return backslashes % 2 == 1


def _escape_kind(escape: str) -> list[tuple[str, str]]:
    if escape in _BACKREFERENCE_ESCAPES:
        return [("backreference", "\\" + escape)]
    if escape == "C":
        return [("byte", "\\C")]
    if escape in _OTHER_ESCAPES:
        return [("escape", _OTHER_ESCAPES[escape])]
    return []


def _group_kind(opening: str) -> list[tuple[str, str]]:
    for kind, starts in (
        ("lookaround", _LOOKAROUND),
        ("possessive", _ATOMIC),
        ("conditional", _CONDITIONAL),
        ("conditional", _RECURSION),
        ("backreference", _BACKREFERENCE_GROUPS),
    ):
        for start in starts:
            if opening.startswith(start):
                return [(kind, start)]
    return []


def _compile_error(exc: Exception) -> str:
    text = exc.args[0] if exc.args else str(exc)
    return text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)


def check_pattern(pattern: str) -> Any:
    """Compile an operator's expression with RE2, or raise PatternError saying why it cannot be taken
    (see the module docstring)."""
    if len(pattern) > MAX_PATTERN:
        raise PatternError(
            "too_long",
            gettext_noop("The expression is %(length)s characters long; at most %(most)s."),
            {"length": len(pattern), "most": MAX_PATTERN},
        )
    constructs = _constructs(pattern)
    try:
        compiled = compile_re2(pattern)
    except re2.error as exc:
        if constructs:
            kind, construct = constructs[0]
            raise PatternError(kind, _WHY[kind], {"construct": construct}) from None
        raise PatternError(
            "syntax",
            gettext_noop("The expression does not compile under RE2's syntax: %(error)s."),
            {"error": _compile_error(exc)},
        ) from None
    if any(kind == "byte" for kind, _construct in constructs):
        raise PatternError("byte", _WHY["byte"], {"construct": "\\C"})
    for probe in _EMPTY_PROBES:
        match = compiled.search(probe)
        if match is not None and match.start() == match.end():
            raise PatternError(
                "empty",
                gettext_noop("The expression matches the empty string, so it would match everywhere."),
            )
    return compiled
