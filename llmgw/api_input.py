"""What the REST API accepts: bounded pagination, and a JSON parser that refuses, with a 400,
what the database would otherwise refuse later with a 500.

Named in REST_FRAMEWORK and loaded while DRF's own views and generics are still being
imported, so this module imports nothing that imports them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from django.conf import settings
from django.utils.translation import gettext
from rest_framework import parsers
from rest_framework.exceptions import ParseError, ValidationError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

__all__ = ["MAX_JSON_DEPTH", "JSONParser", "Pagination"]


# Pagination ---------------------------------------------------------------------------------

_WHOLE_NUMBER = re.compile(r"[0-9]{1,19}")


class Pagination(LimitOffsetPagination):
    """?limit= and ?offset=, each a whole number within its bounds; anything else is a 400 that
    names the parameter and the bounds (a silent default would hide a script's mistake)."""

    max_limit = 1000
    # Far past any list llmgw keeps, and well inside the 64-bit integers SQL offsets are.
    max_offset = 2**31 - 1

    def _bounded(self, request: Request, name: str, low: int, high: int, default: int | None) -> int | None:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        value = int(raw) if _WHOLE_NUMBER.fullmatch(raw) else None
        if value is None or not low <= value <= high:
            raise ValidationError(
                {
                    name: [
                        gettext("Expected a whole number from %(low)s to %(high)s; got “%(value)s”.")
                        % {"low": low, "high": high, "value": raw[:40]}
                    ]
                }
            )
        return value

    def get_limit(self, request: Request) -> int | None:
        return self._bounded(request, self.limit_query_param, 1, self.max_limit, self.default_limit)

    def get_offset(self, request: Request) -> int:
        return self._bounded(request, self.offset_query_param, 0, self.max_offset, 0) or 0

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        parameters = super().get_schema_operation_parameters(view)
        bounds = {self.limit_query_param: (1, self.max_limit), self.offset_query_param: (0, self.max_offset)}
        for parameter in parameters:
            low, high = bounds[parameter["name"]]
            parameter["schema"].update({"minimum": low, "maximum": high})
        return parameters


# Request bodies -----------------------------------------------------------------------------

MAX_JSON_DEPTH = 64


def _path_text(path: tuple[str | int, ...]) -> str:
    """models[0].profiles[1].name, as SpecError names fields; the body itself when empty."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or gettext("the body")


def _text_problem(value: str) -> str | None:
    """Why a string cannot be stored as text (PostgreSQL refuses both), or None when it can."""
    if "\x00" in value:
        return gettext("Holds a NUL character (\\u0000), which text may not contain.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return gettext("Holds a lone UTF-16 surrogate (\\ud800 to \\udfff), which is not text.")
    return None


def _refuse(path: tuple[str | int, ...], message: str) -> ParseError:
    field = _path_text(path)
    return ParseError(
        {
            "detail": gettext("%(field)s: %(message)s") % {"field": field, "message": message},
            "errors": {field: [message]},
        }
    )


def _refuse_constant(name: str) -> Any:
    raise ValueError(gettext("%(name)s is not a number JSON allows.") % {"name": name})


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(gettext("%(value)s is too large a number.") % {"value": text[:40]})
    return value


class JSONParser(parsers.JSONParser):
    """JSON bodies as DRF reads them, less what would fail later with a 500: bodies nested
    deeper than MAX_JSON_DEPTH, NaN and Infinity (and numbers too large for a float), and
    strings with a NUL or a lone surrogate (in values and in keys). Each is a 400 naming where."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Mapping[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding") or settings.DEFAULT_CHARSET
        try:
            "".encode(encoding)  # a text encoding, not a codec such as bz2_codec that would inflate the body
        except (LookupError, UnicodeError):
            raise ParseError(gettext("Unsupported charset “%(charset)s”.") % {"charset": encoding[:40]}) from None
        try:
            text = stream.read().decode(encoding)
        except UnicodeDecodeError:
            raise ParseError(gettext("The body is not valid %(encoding)s text.") % {"encoding": encoding}) from None
        try:
            data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
        except RecursionError:
            raise ParseError(
                gettext("The JSON body nests deeper than %(max)s levels.") % {"max": MAX_JSON_DEPTH}
            ) from None
        except ValueError as exc:
            raise ParseError(gettext("The body is not valid JSON: %(error)s") % {"error": exc}) from None
        self._check(data)
        return data

    def _check(self, data: Any) -> None:
        # Iterative, so that checking a deep body cannot itself run out of stack. A level is an
        # object or an array: {"a": [1]} is two levels deep.
        stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
        while stack:
            value, path = stack.pop()
            if isinstance(value, str):
                problem = _text_problem(value)
                if problem:
                    raise _refuse(path, problem)
                continue
            if isinstance(value, dict | list) and len(path) >= MAX_JSON_DEPTH:
                raise ParseError(gettext("The JSON body nests deeper than %(max)s levels.") % {"max": MAX_JSON_DEPTH})
            if isinstance(value, dict):
                for key, item in value.items():
                    problem = _text_problem(key)
                    if problem:  # named as an escape, which the answer can carry
                        raise _refuse((*path, key.encode("unicode_escape").decode("ascii")), problem)
                    stack.append((item, (*path, key)))
            elif isinstance(value, list):
                stack.extend((item, (*path, i)) for i, item in enumerate(value))
