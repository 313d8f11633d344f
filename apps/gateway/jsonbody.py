"""A request body read as the gateway's JSON, with no Django: the web process reads most bodies with
it on its event loop (apps.gateway.intake.parse_body), and a guardrails worker process reads the
largest ones (apps.guardrails.offload.read_json), by the same rules.

What is refused, with why: what is not JSON, NaN and the infinities (not JSON numbers), what is
not an object, what nests deeper than MAX_DEPTH (checked by a loop, never by recursion: 2,000
levels made Python's reader recurse until it failed), and a lone UTF-16 surrogate, which is no
text and which no engine, usage record or encoder takes.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["MAX_DEPTH", "NotAccepted", "read_json", "read_json_outcome"]

MAX_DEPTH = 64  # no real request nests deeper


class NotAccepted(Exception):
    """Why a body is refused (a 400): `message`, and `code` where the API names one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# json.loads(raw, parse_constant=_no_constant) builds a decoder for every call; this one is kept.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def read_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; NotAccepted saying what is wrong with it."""
    nested = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH  # a cheap test first; only then walk it
    try:
        body = _DECODER.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
    except RecursionError:
        raise NotAccepted(f"The body nests deeper than {MAX_DEPTH} levels.", "too_deep") from None
    except ValueError as exc:
        raise NotAccepted(f"The body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise NotAccepted("The body must be a JSON object.")
    if nested and _depth_over(body, MAX_DEPTH):
        raise NotAccepted(f"The body nests deeper than {MAX_DEPTH} levels.", "too_deep")
    if _SURROGATE.search(raw) and _lone_surrogate(body):
        raise NotAccepted(
            "The body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text.", "invalid_text"
        )
    return body


def read_json_outcome(raw: bytes) -> tuple[dict[str, Any] | None, str, str | None]:
    """`read_json` as plain values, to come back from another process: (body, "", None), or
    (None, why, code)."""
    try:
        return read_json(raw), "", None
    except NotAccepted as exc:
        return None, exc.message, exc.code


def _depth_over(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item if isinstance(v, dict | list))
    return False


def _lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
