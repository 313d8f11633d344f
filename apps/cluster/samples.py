"""A node's stored heartbeat sample (`Node.sample`, JSON), read back as the type it is.

agent.messages.HeartbeatSample declares what a sample holds (every key the control plane reads,
with its unit), and agent.protocol refuses a heartbeat whose sample breaks that shape. What a row
holds may still not be what a heartbeat carried: one written by an older server, the simulator or
a hand, or on SQLite a NaN (PostgreSQL's jsonb cannot hold one). `read_sample` holds the stored
JSON to the declared types, key by key, at every depth, and never raises:

- a value of the wrong type (a string or a bool where a number goes, a fraction where a whole
  number goes, NaN or an infinity, a list where an object goes) is left out, as if the agent had
  not sent that key: unknown, never 0;
- an item of a list of records (a GPU, a pool, a port, a shard) that is not an object or lacks a
  key its type requires (a GPU's index) is left out, the others kept;
- a list of plain values (the load averages, the warnings) with a bad item is left out whole: its
  positions mean something; an entry of a mapping (an engine's figures, XID counts) with a bad
  value is left out;
- keys the types do not declare (a newer agent's) are kept as they are: no reader names them.

A sample that is right (every heartbeat since the protocol checked it) comes back as the same
object, nothing copied: a cleaned copy is built only of the records where something was left out.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from typing import Any, cast

from agent.messages import HeartbeatSample

__all__ = ["read_sample"]


class _Drop:
    """What a check returns for a value to leave out."""

    __slots__ = ()


DROP: Any = _Drop()

# A check takes a JSON value and returns it (the same object when it fits), a cleaned copy, or DROP.
Check = Callable[[Any], Any]


def _anything(value: Any) -> Any:
    return value


def _nullable(inner: Check) -> Check:
    def check(value: Any) -> Any:
        return value if value is None else inner(value)

    return check


def _plain_list(inner: Check) -> Check:
    """A list of plain values: one bad item spoils the whole list (positions mean something)."""

    def check(value: Any) -> Any:
        if value.__class__ is not list:
            return DROP
        for item in value:
            if inner(item) is not item:
                return DROP
        return value

    return check


def _record_list(inner: Check) -> Check:
    """A list of records: a bad record is left out, the others kept (cleaned where they need it)."""

    def check(value: Any) -> Any:
        if value.__class__ is not list:
            return DROP
        cleaned: list[Any] | None = None
        for i, item in enumerate(value):
            got = inner(item)
            if got is not item and cleaned is None:
                cleaned = value[:i]
            if cleaned is not None and got is not DROP:
                cleaned.append(got)
        return value if cleaned is None else cleaned

    return check


def _mapping(inner: Check) -> Check:
    """A mapping with free keys: an entry whose value is bad is left out."""

    def check(value: Any) -> Any:
        if value.__class__ is not dict:
            return DROP
        cleaned: dict[str, Any] | None = None
        for key, item in value.items():
            got = inner(item)
            if got is item:
                continue
            if cleaned is None:
                cleaned = dict(value)
            if got is DROP:
                del cleaned[key]
            else:
                cleaned[key] = got
        return value if cleaned is None else cleaned

    return check


def _record(fields: dict[str, Check | frozenset[type]], required: frozenset[str]) -> Check:
    """A TypedDict: its keys checked, a bad optional one left out, a record without a required one
    (or with a bad one) left out whole. Undeclared keys are kept.

    A scalar key's check is the set of the classes its value may have (a float also finite), tested
    here without a call: a card's forty-odd figures are most of what a sample holds."""
    plain = {key: kinds for key, kinds in fields.items() if isinstance(kinds, frozenset)}
    nested = {key: check for key, check in fields.items() if not isinstance(check, frozenset)}

    def check(value: Any) -> Any:
        if value.__class__ is not dict:
            return DROP
        for key in required:
            if key not in value:
                return DROP
        cleaned: dict[str, Any] | None = None
        for key, item in value.items():
            kinds = plain.get(key)
            if kinds is not None:
                cls = item.__class__
                if cls in kinds and (cls is not float or item - item == 0):  # x - x: NaN for NaN and infinities
                    continue
                got = DROP
            else:
                inner = nested.get(key)
                if inner is None:
                    continue
                got = inner(item)
                if got is item:
                    continue
            if got is DROP and key in required:
                return DROP
            if cleaned is None:
                cleaned = dict(value)
            if got is DROP:
                del cleaned[key]
            else:
                cleaned[key] = got
        return value if cleaned is None else cleaned

    return check


# The classes a JSON scalar of each type may have: a whole number is a number too; a bool is neither.
_KINDS: dict[Any, frozenset[type]] = {
    int: frozenset({int}),
    float: frozenset({int, float}),
    str: frozenset({str}),
    bool: frozenset({bool}),
}


def _as_check(found: Check | frozenset[type]) -> Check:
    """A check as a call (for the items of a list or a mapping)."""
    if not isinstance(found, frozenset):
        return found
    kinds = found

    def check(value: Any) -> Any:
        cls = value.__class__
        return value if cls in kinds and (cls is not float or value - value == 0) else DROP

    return check


def _compile(tp: Any) -> Check | frozenset[type]:
    if typing.is_typeddict(tp):
        fields = {key: _compile(hint) for key, hint in typing.get_type_hints(tp).items()}
        return _record(fields, frozenset(tp.__required_keys__))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [arg for arg in args if arg is not type(None)]
        if len(options) != 1 or len(options) == len(args):
            raise TypeError(f"no check for {tp}: only `X | None` unions are read")
        inner = _compile(options[0])
        return inner | {type(None)} if isinstance(inner, frozenset) else _nullable(inner)
    if origin is list:
        (item,) = args
        return (_record_list if typing.is_typeddict(item) else _plain_list)(_as_check(_compile(item)))
    if origin is dict:
        return _mapping(_as_check(_compile(args[1])))
    if tp is Any:
        return _anything
    if tp in _KINDS:
        return _KINDS[tp]
    raise TypeError(f"no check for {tp}")


def compile_check(tp: Any) -> Check:
    """The check of a value of type `tp`: one of JSON's scalars, `X | None`, list[X], dict[str, X]
    or a TypedDict of them (what agent.messages uses)."""
    return _as_check(_compile(tp))


_SAMPLE = compile_check(HeartbeatSample)


def read_sample(raw: object) -> HeartbeatSample | None:
    """A stored sample held to HeartbeatSample (see the module docstring); None when it is not a
    JSON object at all (no sample: unknown)."""
    if raw is None:
        return None
    checked = _SAMPLE(raw)
    return None if checked is DROP else cast(HeartbeatSample, checked)
