"""The built-in detectors of personal data and secrets, and the checksums that validate what they
find (no Django).

Each detector is an RE2 expression over the folded text (lower case, ASCII digits) that finds a
candidate, and a check of the candidate: the Luhn checksum of a card, the mod-97 one of an
IBAN, the two check digits of a Turkish national ID number. RE2 has no look-behind or look-ahead,
so "not preceded by a digit" is written as a character the expression takes before the candidate
(or the start of the text), and "not followed by one" as one it takes after it (or the end); the
next candidate is looked for from the candidate's last character on, so the character between two
candidates serves both.

Every expression is bounded in what it must look at past a candidate, so finding all of them is
linear in the text; the checks look at one candidate each, and at most a few of its prefixes.

Cards and IBANs are written with their digits in groups: a card's groups (3 to 6 digits) may be
separated by a short run of spaces, newlines, dots, slashes, hyphens or underscores; an IBAN's
groups of four by a space or a hyphen. A grouped candidate that fails its checksum is tried again
without its last groups (a card's last digit groups, or the word that followed an IBAN), so a card
followed by more digits, or an IBAN followed by a short word, is still found.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DETECTORS", "Detector", "iban_ok", "luhn_ok", "tckn_ok"]


# A digit doubled, its two digits added, as the digit character: "5" -> 10 -> "1".
_DOUBLED = bytes.maketrans(b"0123456789", b"0246813579")


def luhn_ok(digits: str) -> bool:
    if not 13 <= len(digits) <= 19 or not digits.isascii() or not digits.isdigit():
        return False
    backwards = digits[::-1].encode("ascii")
    plain, doubled = backwards[0::2], backwards[1::2].translate(_DOUBLED)
    return (sum(plain) + sum(doubled) - 48 * len(backwards)) % 10 == 0  # 48: the code of "0"


_IBAN = re.compile(r"[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}")
_NOT_ALNUM = re.compile(r"[^A-Za-z0-9]")
_LETTER_NUMBERS = str.maketrans({chr(code): str(code - 55) for code in range(ord("A"), ord("Z") + 1)})  # A=10


def iban_ok(text: str) -> bool:
    iban = _NOT_ALNUM.sub("", text).upper() if len(text) <= 64 else ""
    if not _IBAN.fullmatch(iban):
        return False
    return int((iban[4:] + iban[:4]).translate(_LETTER_NUMBERS)) % 97 == 1


def tckn_ok(digits: str) -> bool:
    """A Turkish national ID number: 11 digits, not starting with 0, its 10th and 11th digits the
    checksums of the ones before."""
    if len(digits) != 11 or not digits.isdigit() or digits[0] == "0":
        return False
    d = list(map(int, digits))
    tenth = ((d[0] + d[2] + d[4] + d[6] + d[8]) * 7 - (d[1] + d[3] + d[5] + d[7])) % 10
    return d[9] == tenth and d[10] == sum(d[:10]) % 10


_NON_DIGIT = re.compile(r"[^0-9]")
_GROUP_END = re.compile(r"[A-Za-z0-9](?=[^A-Za-z0-9])")


def _digits(text: str) -> str:
    return _NON_DIGIT.sub("", text)


def _group_ends(candidate: str) -> list[int]:
    """Where each group of a candidate ends but the last, longest first."""
    return [match.end() for match in _GROUP_END.finditer(candidate)][::-1]


def card_length(candidate: str) -> int | None:
    """How much of a candidate is a payment card number (Luhn-valid, 13 to 19 digits), or None."""
    if candidate.isdigit():
        return len(candidate) if luhn_ok(candidate) else None
    if luhn_ok(_digits(candidate)):
        return len(candidate)
    for end in _group_ends(candidate):
        if luhn_ok(_digits(candidate[:end])):
            return end
    return None


def iban_length(candidate: str) -> int | None:
    """How much of a candidate is an IBAN (its mod-97 checksum right), or None."""
    if iban_ok(candidate):
        return len(candidate)
    for end in _group_ends(candidate):
        if not _NOT_ALNUM.sub("", candidate[end:]).isalpha():
            break  # only a word that followed the IBAN is left out, never its digits
        if iban_ok(candidate[:end]):
            return end
    return None


def _whole_if(check: Callable[[str], bool]) -> Callable[[str], int | None]:
    return lambda candidate: len(candidate) if check(candidate) else None


_DIGITS = frozenset(b"0123456789")
_LETTERS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


@dataclass(frozen=True, slots=True)
class Detector:
    """`expression`: RE2, finding a candidate; `length`: how much of a candidate is a finding
    (None: none of it; no `length`: all of it). A bounded expression takes a character before and
    after the candidate (or the start or end of the text): `starts` and `ends` are the bytes a
    candidate starts and ends with, which those characters never are, so the candidate is the
    match less the characters it does not start or end with (RE2 then has no groups to find)."""

    name: str
    expression: str
    length: Callable[[str], int | None] | None = None
    starts: frozenset[int] = frozenset()
    ends: frozenset[int] = frozenset()

    @property
    def bounded(self) -> bool:
        return bool(self.starts)


# Separators between a card's groups: whitespace (newlines included), dots, slashes, hyphens and
# dashes, underscores; at most three in a row.
_CARD_SEPARATOR = r"[\t\n\v\f\r \x{85}\pZ\p{Pd}./\\_]"

DETECTORS: dict[str, Detector] = {
    detector.name: detector
    for detector in (
        # Letters of every script: an address is also written (and read) as "ayşe.yılmaz@örnek.com.tr".
        Detector("email", r"([\pL\pN\pM._%+-]+@[\pL\pN\pM-]+(?:\.[\pL\pN\pM-]+)*\.[\pL\pM]{2,63})"),
        Detector(
            "phone",
            r"(?:^|[^\pL\pN\pM_+])(\+?[0-9][0-9\t\n\f\r ().-]{8,17}[0-9])(?:[^\pL\pN\pM_]|$)",
            _whole_if(lambda s: 10 <= len(_digits(s)) <= 15),
            starts=_DIGITS | {ord("+")},
            ends=_DIGITS,
        ),
        Detector(
            "card",
            rf"(?:^|[^0-9])([0-9]{{3,6}}(?:{_CARD_SEPARATOR}{{1,3}}[0-9]{{3,6}}){{1,5}}|[0-9]{{13,19}})(?:[^0-9]|$)",
            card_length,
            starts=_DIGITS,
            ends=_DIGITS,
        ),
        Detector(
            "iban",
            r"(?:^|[^\pL\pN])([a-z]{2}[0-9]{2}(?:[a-z0-9]{11,30}|(?:[ -]?[a-z0-9]{4}){2,7}(?:[ -]?[a-z0-9]{1,4})?))"
            r"(?:[^\pL\pN]|$)",
            iban_length,
            starts=_LETTERS,
            ends=_LETTERS | _DIGITS,
        ),
        Detector("tckn", r"(?:^|[^0-9])([1-9][0-9]{10})(?:[^0-9]|$)", _whole_if(tckn_ok), starts=_DIGITS, ends=_DIGITS),
        Detector(
            "api_key",
            r"(sk-(?:ant-|proj-)?[a-z0-9_-]{20,}|gh[pousr]_[a-z0-9]{36,}|github_pat_[a-z0-9_]{22,}"
            r"|akia[0-9a-z]{16}|xox[abprs]-[a-z0-9-]{10,}|aiza[0-9a-z_-]{35}"
            r"|eyj[a-z0-9_-]{8,}\.eyj[a-z0-9_-]{8,}\.[a-z0-9_-]{8,})",
        ),
        Detector("llmgw_key", r"(llmgwe?_[a-z0-9_-]{20,})"),
    )
}
