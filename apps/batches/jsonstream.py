"""The items of one array in a JSON object read from a file piece by piece, in bounded memory.

An Anthropic Message Batch is created with one body `{"requests": [{...}, {...}, ...]}` of up to
LLMGW_BATCH_MAX_FILE_BYTES. Reading it whole would hold the body several times over as Python
objects; `array_items` yields the items of the named array one at a time, holding at most one item
(and at most `max_item` characters of it) at once. Other keys of the object are read and dropped
(each within the same bound). A body that is not such an object raises `NotJson` saying where.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["NotJson", "array_items"]

_WHITESPACE = " \t\n\r"


class NotJson(ValueError):
    """The body is not the JSON object it should be."""


class _Text:
    """A growing window of decoded text over a binary reader."""

    def __init__(self, read: Callable[[int], bytes], chunk: int, max_item: int) -> None:
        self.read = read
        self.chunk = chunk
        self.max_item = max_item
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buffer = ""
        self.at = 0
        self.eof = False

    def more(self, size: int | None = None) -> bool:
        if self.eof:
            return False
        data = self.read(size or self.chunk)
        if not data:
            self.eof = True
            try:
                self.buffer += self.decoder.decode(b"", final=True)
            except UnicodeDecodeError:
                raise NotJson("the body is not UTF-8") from None
            return False
        try:
            self.buffer += self.decoder.decode(data)
        except UnicodeDecodeError:
            raise NotJson("the body is not UTF-8") from None
        return True

    def skip_space(self) -> None:
        while True:
            while self.at < len(self.buffer) and self.buffer[self.at] in _WHITESPACE:
                self.at += 1
            if self.at < len(self.buffer) or not self.more():
                return

    def peek(self) -> str:
        self.skip_space()
        return self.buffer[self.at] if self.at < len(self.buffer) else ""

    def expect(self, char: str, where: str) -> None:
        if self.peek() != char:
            found = self.peek() or "the end of the body"
            raise NotJson(f"expected “{char}” {where}, found “{found[:20]}”")
        self.at += 1

    def value(self) -> Any:
        """The next JSON value. A value cut off at the window's end is read again with more text
        (twice as much each time, so a large value costs a few reads, not one per chunk)."""
        self.skip_space()
        want = self.chunk
        while True:
            try:
                value, end = _DECODER.raw_decode(self.buffer, self.at)
            except json.JSONDecodeError as exc:
                if len(self.buffer) - self.at > self.max_item:
                    raise NotJson(f"a value is over {self.max_item} characters or is not valid JSON") from None
                if not self.more(want):
                    raise NotJson(f"not valid JSON: {exc.msg}") from None
                want *= 2
                continue
            except RecursionError:
                raise NotJson("a value nests too deep") from None
            # A number at the window's end may go on in the next chunk ("12" of "1234").
            at_end = end == len(self.buffer) and not self.eof and isinstance(value, int | float)
            if at_end and self.more(want):
                continue
            self.at = end
            self.trim()
            return value

    def trim(self) -> None:
        if self.at > self.chunk:
            self.buffer = self.buffer[self.at :]
            self.at = 0


def _no_constant(name: str) -> Any:
    raise NotJson(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


def array_items(
    read: Callable[[int], bytes], key: str, *, chunk: int = 256 * 1024, max_item: int = 32 * 1024 * 1024
) -> Iterator[Any]:
    """Each item of the array at `key` of the object `read` gives, in order."""
    text = _Text(read, chunk, max_item)
    text.expect("{", "at the start of the body")
    found = False
    if text.peek() == "}":
        text.at += 1
    else:
        while True:
            name = text.value()
            if not isinstance(name, str):
                raise NotJson("an object key is not a string")
            text.expect(":", f"after the key “{name[:40]}”")
            if name == key and not found:
                found = True
                yield from _items(text, key)
            else:
                text.value()
            if text.peek() == ",":
                text.at += 1
                continue
            text.expect("}", "at the end of the object")
            break
    text.skip_space()
    if text.at < len(text.buffer):
        raise NotJson("there is more after the object")
    if not found:
        raise NotJson(f"the object has no “{key}”")


def _items(text: _Text, key: str) -> Iterator[Any]:
    text.expect("[", f"as “{key}” must be an array")
    if text.peek() == "]":
        text.at += 1
        return
    while True:
        yield text.value()
        if text.peek() == ",":
            text.at += 1
            continue
        text.expect("]", f"at the end of “{key}”")
        return
