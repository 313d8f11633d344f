"""Text as the eye reads it, for matching, and the way back to what was written (no Django).

`Folded(text)` is the text folded character by character: NFKC (full-width digits are digits,
ligatures letters), Cyrillic and Greek letters that look Latin read as Latin, every script's
decimal digits as ASCII digits, case folded, zero-width characters and soft hyphens dropped, and
a lone surrogate (which a JSON string may hold) read as U+FFFD. Its `data` is the folded text in
UTF-8, what the matchers scan; `spans()` maps byte spans in `data` back to spans of the
original text, so that a redaction masks what was really written.

The cost is linear in the text with a small constant: the folding is `str.translate` over a
table filled as characters are first seen (each character's fold is worked out once per
process), slice by slice, and the way back walks only the characters whose fold is not exactly one character
(`ß`, `İ`, a ligature, a zero-width space), looked up by bisection.
"""

from __future__ import annotations

import bisect
import re
import threading
import unicodedata
from collections.abc import Sequence

__all__ = ["Folded", "fold", "fold_char"]

_INVISIBLE = frozenset(map(ord, "\u00ad\u180e\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff"))
# Letters of other scripts that read as Latin ones (the confusables an attacker reaches for first).
_HOMOGLYPHS = str.maketrans(
    "АВЕЗІЈКМНОРСТУХаеіјорсуххѕԁԛԝΑΒΕΖΗΙΚΜΝΟΡΤΥΧαβεικνορτυχ",
    "ABE3IJKMHOPCTYXaeijopcyxxsdqwABEZHIKMNOPTYXabeiknoptux",
)
TABLE_MOST = 200_000  # characters whose fold is kept; beyond, a rare character is worked out each time
# A long text is folded in slices: an ASCII one is only lower-cased (much faster), and between two
# slices the interpreter may switch threads (one str.translate holds the GIL: the event loop would
# wait for a whole megabyte's).
SLICE = 16_384


def fold_char(char: str) -> str:
    """One character as it is matched: "" for an invisible one, "ss" for "ß", "4" for "４"."""
    code = ord(char)
    if code in _INVISIBLE:
        return ""
    if 0xD800 <= code <= 0xDFFF:
        return "\ufffd"  # a lone surrogate cannot be encoded: it reads as the replacement character
    if char.isascii():
        return char.lower()
    piece = unicodedata.normalize("NFKC", char).translate(_HOMOGLYPHS).casefold()
    return "".join(_digit(c) for c in piece if ord(c) not in _INVISIBLE)


def _digit(char: str) -> str:
    return str(unicodedata.decimal(char)) if not char.isascii() and char.isdecimal() else char


class _Table(dict[int, str]):
    """Code point -> its fold, filled as characters are seen; `uneven` holds the characters whose
    fold is not one character long (what the way back has to walk)."""

    def __init__(self) -> None:
        super().__init__((code, chr(code).lower()) for code in range(128))
        self.uneven: set[int] = set()
        self._lock = threading.Lock()
        self._pattern: tuple[int, re.Pattern[str]] | None = None

    def __missing__(self, code: int) -> str:
        piece = fold_char(chr(code))
        if len(piece) != 1:
            with self._lock:
                self.uneven.add(code)
        if len(self) < TABLE_MOST:
            self[code] = piece
        return piece

    def uneven_pattern(self) -> re.Pattern[str]:
        """A character class of every uneven character seen so far (rebuilt when one is added)."""
        with self._lock:
            cached = self._pattern
            if cached is None or cached[0] != len(self.uneven):
                codes = sorted(self.uneven)
                body = "".join(f"\\U{code:08x}" for code in codes)
                cached = self._pattern = (len(codes), re.compile(f"[{body}]" if codes else "(?!)"))
            return cached[1]


_TABLE = _Table()


def _fold_slice(piece: str) -> str:
    return piece.lower() if piece.isascii() else piece.translate(_TABLE)


class Folded:
    """A text folded for matching: `folded` (str), `data` (its UTF-8, what is scanned) and the way
    back from offsets in `data` to indices in `text`."""

    __slots__ = ("_steps", "data", "folded", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        if text.isascii():
            self.folded = text.lower()
            self.data = self.folded.encode("ascii")
        else:
            self.folded = "".join(map(_fold_slice, (text[i : i + SLICE] for i in range(0, len(text), SLICE))))
            self.data = self.folded.encode("utf-8")
        self._steps: tuple[list[int], list[int], list[int]] | None = None

    def spans(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Each (start, end) byte span of `data` as the (start, end) span of `text` its characters
        came from (a match ending inside a character's fold ends after that character)."""
        if self.text.isascii():
            return list(pairs)
        chars = self._chars([offset for pair in pairs for offset in pair])
        out = []
        for k in range(len(pairs)):
            start, end = chars[2 * k], chars[2 * k + 1]
            first = self._original(start)
            out.append((first, self._original(end - 1) + 1 if end > start else first))
        return out

    def _chars(self, offsets: list[int]) -> list[int]:
        """Each byte offset of `data` as an index in `folded` (one pass over `data`, whatever the order)."""
        if len(self.data) == len(self.folded):  # one byte a character
            return offsets
        order = sorted(range(len(offsets)), key=offsets.__getitem__)
        chars = [0] * len(offsets)
        last_byte = last_char = 0
        for i in order:
            offset = offsets[i]
            last_char += len(self.data[last_byte:offset].decode("utf-8", "replace"))
            last_byte = offset
            chars[i] = last_char
        return chars

    def _original(self, index: int) -> int:
        """The index in `text` of folded character `index` (len(folded) -> len(text))."""
        if index >= len(self.folded):
            return len(self.text)
        starts, positions, lengths = self._uneven_steps()
        k = bisect.bisect_right(starts, index) - 1
        if k < 0:
            return index
        if index < starts[k] + lengths[k]:
            return positions[k]
        return positions[k] + 1 + (index - starts[k] - lengths[k])

    def _uneven_steps(self) -> tuple[list[int], list[int], list[int]]:
        """Where each uneven character is: its folded start, its index in `text`, its fold's length."""
        if self._steps is None:
            starts: list[int] = []
            positions: list[int] = []
            lengths: list[int] = []
            shift = 0
            if len(self.folded) != len(self.text) or _TABLE.uneven:
                for match in _TABLE.uneven_pattern().finditer(self.text):
                    position = match.start()
                    length = len(_TABLE[ord(match.group())])
                    starts.append(position + shift)
                    positions.append(position)
                    lengths.append(length)
                    shift += length - 1
            self._steps = (starts, positions, lengths)
        return self._steps


def fold(text: str) -> tuple[str, list[int] | None]:
    """The text as it is matched, and for each of its characters the index in `text` it came from
    (None when they are the same: plain ASCII, only lower-cased)."""
    folded = Folded(text)
    if text.isascii():
        return folded.folded, None
    return folded.folded, [folded._original(i) for i in range(len(folded.folded))]
